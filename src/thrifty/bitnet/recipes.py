"""Recipes by name, and the one code path that applies them: :func:`linear_factory` for the reference model's
Linear seam, :func:`convert` for any Llama-family model (the reference model or a transformers one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import check_choice, check_impl, check_range
from .bitlinear import BitLinear, SharedInput

# Which quantizer feeds each projection; "other" is any Linear outside the Llama names (e.g. a custom head).
# int4-all's FFN-down input uses β = 2·mean|x| (the paper's full-INT4 ablation), noted as ("int4", 2.0).
RECIPES: dict[str, Optional[dict]] = {
    "fp": None,
    "b1.58": dict(qkv="int8", out="int8", gate="int8", up="int8", down="int8", other="int8"),
    "a4.8": dict(qkv="int4", out="topk_int8", gate="int4", up="int4", down="int8", other="int8"),
    "a4.8-fp4": dict(qkv="fp4", out="topk_int8", gate="fp4", up="fp4", down="int8", other="int8"),
    "int4-all": dict(qkv="int4", out="int4", gate="int4", up="int4", down=("int4", 2.0), other="int4"),
}
ROLES = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "out", "gate_proj": "gate",
         "up_proj": "up", "down_proj": "down"}
SUB_NORM_ROLES = ("out", "down")  # the inputs no pre-norm of the Llama block normalizes
# projections of one block that read the same input tensor: quantized once for all of them (SharedInput)
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
CHECKPOINT_KEY = "thrifty_bitnet"  # config.json key holding the recipe of a saved BitNet model


@dataclass
class BitNetConfig:
    """Everything a BitNet conversion needs; every field is checked here.

    recipe: ``"fp"``, ``"b1.58"``, ``"a4.8"``, ``"a4.8-fp4"`` or ``"int4-all"`` (see :data:`RECIPES`).
    sub_norm: RMSNorm before the attention-output and FFN-down quantizers (BitNet's architecture).
    topk_ratio: share of each token's entries TopK keeps on the attention-output input (paper: 0.5).
    strength: λ of the gradual switch, 1 = the recipe exactly; start at 0 to convert a pretrained model.
    impl: the BitLinear kernels: "auto" (Triton on CUDA, the reference elsewhere), "triton" (forced: CUDA, or the
    CPU under TRITON_INTERPRET=1) or "reference" (plain PyTorch).
    norm_eps: ε of the sub-norms.
    exclude: Linear names (last component) kept in full precision; the LM head always is.
    """

    recipe: str = "a4.8"
    sub_norm: bool = True
    topk_ratio: float = 0.5
    strength: float = 1.0
    impl: str = "auto"
    norm_eps: float = 1e-5
    exclude: tuple = field(default_factory=lambda: ("lm_head",))

    def __post_init__(self):
        check_choice("recipe", self.recipe, tuple(RECIPES))
        if not isinstance(self.sub_norm, bool):
            raise TypeError(f"sub_norm: expected a bool, got {type(self.sub_norm).__name__}")
        check_impl(self.impl)
        check_range("topk_ratio", self.topk_ratio, 0.0, 1.0, lo_open=True)
        check_range("strength", self.strength, 0.0, 1.0)
        check_range("norm_eps", self.norm_eps, 0.0, 1.0, lo_open=True)
        if not isinstance(self.exclude, (list, tuple)) or not all(isinstance(e, str) for e in self.exclude):
            raise TypeError(f"exclude: expected a tuple of module names, got {self.exclude!r}")
        self.exclude = tuple(self.exclude) + (() if "lm_head" in self.exclude else ("lm_head",))

    @property
    def is_bitnet(self) -> bool:
        return RECIPES[self.recipe] is not None


def as_config(recipe_or_config) -> BitNetConfig:
    if isinstance(recipe_or_config, BitNetConfig):
        return recipe_or_config
    if isinstance(recipe_or_config, str):
        return BitNetConfig(recipe=recipe_or_config)
    raise TypeError(f"recipe: expected a recipe name or a BitNetConfig, got {type(recipe_or_config).__name__}")


def _role(name: str) -> str:
    return ROLES.get(name.rsplit(".", 1)[-1], "other")


def _quantizer(cfg: BitNetConfig, role: str) -> dict:
    spec = RECIPES[cfg.recipe][role]
    kind, beta_scale = spec if isinstance(spec, tuple) else (spec, 1.0)
    return dict(activation=kind, beta_scale=beta_scale, topk_ratio=cfg.topk_ratio, strength=cfg.strength,
                impl=cfg.impl)


# ----------------------------------------------------------------------------------------------- ReLU²

def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


relu_squared.glu_kind = "relu2"  # the reference model's inference path fuses relu(gate)**2 * up into one launch


class RampedReLUSquared(nn.Module):
    """The GLU gate activation of a converted model: ``(1 − λ)·original(g) + λ·ReLU²(g)``; at λ = 1 exactly ReLU²."""

    def __init__(self, original: Callable, strength: float):
        super().__init__()
        self.original = original
        self.strength = float(strength)

    def forward(self, g):
        if self.strength == 1.0:
            return relu_squared(g)
        if self.strength == 0.0:
            return self.original(g)
        return (1.0 - self.strength) * self.original(g) + self.strength * relu_squared(g)


def mlp_activation(recipe_or_config) -> Callable:
    """The GLU gate activation of a recipe, for ``LlamaForCausalLM(..., activation=...)``: SiLU for "fp", else
    ReLU² (BitNet's ReLU²GLU: its zeros are the sparsity of the FFN-down input)."""
    cfg = as_config(recipe_or_config)
    return relu_squared if cfg.is_bitnet else F.silu


def linear_factory(recipe_or_config) -> Callable:
    """A factory for the reference model's Linear seam:
    ``LlamaForCausalLM(config, linear=linear_factory("a4.8"), activation=mlp_activation("a4.8"))``."""
    cfg = as_config(recipe_or_config)
    shared: dict = {}  # (parent name, group) -> the SharedInput of those siblings

    def factory(in_features: int, out_features: int, *, name: str) -> nn.Module:
        parent, _, leaf = name.rpartition(".")
        role = _role(name)
        if not cfg.is_bitnet or leaf in cfg.exclude:
            return nn.Linear(in_features, out_features, bias=False)
        layer = BitLinear(in_features, out_features, sub_norm=cfg.sub_norm and role in SUB_NORM_ROLES,
                          norm_eps=cfg.norm_eps, **_quantizer(cfg, role))
        group = next((g for g in SHARED_INPUT_GROUPS if leaf in g), None)
        if group is not None and layer.norm is None:
            members = [n for n in group if n not in cfg.exclude]
            if len(members) > 1:
                layer.shared_input = shared.setdefault((parent, group), SharedInput(len(members)))
        return layer

    return factory


def convert(model: nn.Module, recipe_or_config) -> nn.Module:
    """Applies a recipe to ``model`` in place and returns it.

    Every ``nn.Linear`` but the LM head (and ``exclude``) becomes a :class:`BitLinear` with the recipe's input
    quantizer for its projection (q/k/v, o, gate, up, down by their Llama names), sub-norms before o and down,
    and each MLP's ``act_fn`` becomes ReLU². Embeddings and the LM head stay full precision. Works on
    :class:`thrifty.models.LlamaForCausalLM` and on transformers Llama-family models (same module names).

    On a model that is already BitNet, only the quantizers change (no new parameters), so the optimizer state
    stays valid: that is the b1.58 → a4.8 switch of two-stage training. Converting back to ``"fp"`` is refused.

    **Converting a pretrained full-precision model** to ternary weights and ReLU² at once loses what it knew:
    SmolLM2-135M goes from perplexity 32.7 to ~4·10⁷ on the corpus (b1.58, λ = 1). Convert with
    ``BitNetConfig(recipe, strength=0.0, sub_norm=False)`` — the model then computes exactly what it did — and
    raise λ over the first ~1000 fine-tuning steps with :func:`set_strength` (e.g.
    ``set_strength(model, min(1, step / 1000))``): every quantizer and the SiLU→ReLU² switch is blended as
    ``x + λ(new(x) − x)`` (λ = 0.1 measured: perplexity 51.5). Leave the sub-norms out when converting: a fresh
    unit-weight RMSNorm rescales the o/down inputs by 1/RMS, and even λ = 0.1 of it sends the perplexity to ~9·10⁴.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    cfg = as_config(recipe_or_config)
    has_bitlinear = any(isinstance(m, BitLinear) for m in model.modules())
    if not cfg.is_bitnet:
        if has_bitlinear:
            raise ValueError("recipe: 'fp' cannot be applied to a model that is already BitNet")
        return model
    eps = getattr(getattr(model, "config", None), "rms_norm_eps", cfg.norm_eps)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if child_name in cfg.exclude:
                continue
            role = _role(child_name)
            if isinstance(child, BitLinear):
                child.configure(**_quantizer(cfg, role))
            elif isinstance(child, nn.Linear):
                setattr(parent, child_name, BitLinear.from_linear(
                    child, sub_norm=cfg.sub_norm and role in SUB_NORM_ROLES, norm_eps=eps, **_quantizer(cfg, role)))
        _share_inputs(parent)
        if hasattr(parent, "gate_proj") and hasattr(parent, "act_fn"):
            act = parent.act_fn
            if isinstance(act, RampedReLUSquared):
                act.strength = cfg.strength
            elif act is not relu_squared:
                parent.act_fn = RampedReLUSquared(act, cfg.strength)
    return model


def revert(model: nn.Module) -> nn.Module:
    """Undoes :func:`convert` in place: each BitLinear made from an ``nn.Linear`` becomes an ``nn.Linear`` again,
    holding its latent weight in the dtype it came in (bit for bit the original while untrained), and each
    ReLU² gate gets its original activation back. Sub-norms go with their BitLinear. A BitLinear built as one
    (:func:`linear_factory`) has no full-precision original: ValueError."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    born_bitnet = [n for n, m in model.named_modules() if isinstance(m, BitLinear) and not hasattr(m, "source_dtype")]
    if born_bitnet:
        raise ValueError(f"model: {born_bitnet[0]} was built as a BitLinear, not converted from an nn.Linear; "
                         "there is no full-precision layer to revert to")
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, BitLinear):
                setattr(parent, child_name, _as_linear(child))
            elif isinstance(child, RampedReLUSquared):
                delattr(parent, child_name)  # the original may be a plain function, not a submodule
                setattr(parent, child_name, child.original)
    return model


def _as_linear(layer: BitLinear) -> nn.Linear:
    linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                       device=layer.weight.device, dtype=layer.source_dtype)
    with torch.no_grad():
        linear.weight.copy_(layer.weight)
        if layer.bias is not None:
            linear.bias.copy_(layer.bias)
    linear.weight.requires_grad_(layer.weight.requires_grad)
    return linear


def _share_inputs(parent: nn.Module) -> None:
    """Gives the un-normed sibling BitLinears that read one input (q/k/v, gate/up) a common SharedInput."""
    for group in SHARED_INPUT_GROUPS:
        members = [m for n in group if isinstance(m := getattr(parent, n, None), BitLinear) and m.norm is None]
        if len(members) > 1 and not all(m.shared_input is members[0].shared_input is not None for m in members):
            cache = SharedInput(len(members))
            for m in members:
                m.shared_input = cache


def checkpoint_record(model: nn.Module) -> Optional[dict]:
    """The BitNet settings of ``model`` for its config.json (None when it has no BitLinear): the recipe its
    layers carry now and the BitNetConfig options that rebuild them (see :func:`from_checkpoint_record`)."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, BitLinear)]
    if not layers:
        return None
    recipe = current_recipe(model)
    if recipe == "custom":
        raise ValueError("model: its BitLinear layers follow no recipe of RECIPES, so a checkpoint could not "
                         "rebuild them; save the state dict instead")
    first = layers[0][1]
    normed = [m for _, m in layers if m.norm is not None]
    bitnet_names = {n.rsplit(".", 1)[-1] for n, _ in layers}
    exclude = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                      if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] not in bitnet_names})
    topk = [m.topk_ratio for _, m in layers if m.activation == "topk_int8"]
    return dict(recipe=recipe, sub_norm=bool(normed), topk_ratio=topk[0] if topk else first.topk_ratio,
                strength=first.strength, impl=first.impl, norm_eps=normed[0].norm.eps if normed else 1e-5,
                exclude=exclude)


def from_checkpoint_record(model: nn.Module, record) -> nn.Module:
    """Converts a freshly built full-precision ``model`` as :func:`checkpoint_record` described it."""
    if not isinstance(record, dict):
        raise ValueError(f"{CHECKPOINT_KEY}: expected an object of BitNetConfig fields, got {record!r}")
    known = list(BitNetConfig.__dataclass_fields__)
    unknown = set(record) - set(known)
    if unknown:
        raise ValueError(f"{CHECKPOINT_KEY}: unknown fields {sorted(unknown)}; a BitNet record holds {known}")
    return convert(model, BitNetConfig(**{**record, "exclude": tuple(record.get("exclude", ()))}))


def set_strength(model: nn.Module, strength: float) -> None:
    """Sets λ of the gradual switch on every BitLinear and ReLU² gate of ``model`` (see :func:`convert`)."""
    check_range("strength", strength, 0.0, 1.0)
    for m in model.modules():
        if isinstance(m, BitLinear):
            m.configure(strength=strength)
        elif isinstance(m, RampedReLUSquared):
            m.strength = float(strength)


def current_recipe(model: nn.Module) -> str:
    """The recipe whose quantizers ``model``'s BitLinears carry now ("fp" when it has none, "custom" when none fits)."""
    return recipe_of({n: m for n, m in model.named_modules() if isinstance(m, BitLinear)})


def recipe_of(layers: dict) -> str:
    """The recipe whose quantizers ``layers`` ({module name: BitLinear or PackedBitLinear}) carry ("fp" for none,
    "custom" when none fits)."""
    layers = [(_role(n), m.activation) for n, m in layers.items()]
    if not layers:
        return "fp"
    for name, spec in RECIPES.items():
        if spec is not None and all(_kind(spec[role]) == kind for role, kind in layers):
            return name
    return "custom"


def _kind(spec) -> str:
    return spec[0] if isinstance(spec, tuple) else spec
