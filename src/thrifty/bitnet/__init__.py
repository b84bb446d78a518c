"""BitNet b1.58 / a4.8: ternary weights, 8-/4-bit and sparse activations, ReLU²GLU, two-stage training.

Public API::

    from thrifty import bitnet
    model = LlamaForCausalLM(cfg, linear=bitnet.linear_factory("b1.58"), activation=bitnet.mlp_activation("b1.58"))
    bitnet.convert(hf_model, "a4.8")                       # or a BitNetConfig; in place, every Linear but lm_head
    bitnet.revert(hf_model)                               # undoes convert (the latent weights, original dtype)
    Trainer(model, train, val, cfg, schedule=bitnet.TwoStageSchedule(stage1_share=0.95))
    bitnet.measure_sparsity(model, batches)               # Table 2 of the paper
    bitnet.export(model, "model.safetensors")             # inference: ternary weights packed 2 bits each
    model = LlamaForCausalLM.from_packed("model.safetensors", device="cuda")  # W2A8 Triton kernels on CUDA
    bitnet.load("model.safetensors", hf_model)            # into a model you built (a converted transformers one)
    bitnet.pack(model)                                    # the same in memory, in place
    bitnet.check_packable(model)                          # what pack checks first: ValueError naming a bad layer
    bitnet.stack_projections(model)                       # packed q/k/v and gate/up: one launch each (decode)
"""

from .bitlinear import BitLinear
from .export import check_packable, export, load, pack, packed_factory, read_header
from .packed import PackedBitLinear
from .recipes import (RECIPES, BitNetConfig, convert, current_recipe, linear_factory, mlp_activation,
                      relu_squared, revert, set_strength)
from .schedule import TwoStageSchedule
from .stacked import ProjectionSlice, stack_projections
from .sparsity import format_table, measure_sparsity

__all__ = ["BitLinear", "BitNetConfig", "RECIPES", "convert", "revert", "current_recipe", "linear_factory",
           "mlp_activation", "relu_squared", "set_strength", "TwoStageSchedule", "measure_sparsity",
           "format_table", "build_for_pretraining", "PackedBitLinear", "export", "load", "pack", "check_packable",
           "read_header", "packed_factory", "stack_projections", "ProjectionSlice"]


def build_for_pretraining(model, recipe: str, *, stage1_share: float = 0.95):
    """Converts a freshly initialised model for ``recipe`` and returns the Trainer schedule (None for "fp").

    "a4.8" and "a4.8-fp4" train two-stage from "b1.58"; "b1.58" and "int4-all" keep their recipe in both stages
    but get the same BitNet learning-rate and weight-decay schedule, so the comparison differs in the quantizers
    only."""
    config = BitNetConfig(recipe=recipe)  # validates the name
    if not config.is_bitnet:
        return None
    first = "b1.58" if recipe in ("a4.8", "a4.8-fp4") else recipe
    schedule = TwoStageSchedule(stage1_share=stage1_share, stage1_recipe=first, stage2_recipe=recipe)
    convert(model, first)
    return schedule
