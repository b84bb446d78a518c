"""thrifty.optimize serving a BitNet model packed (``pack_bitnet``, the "serve-bitnet" preset), through the public
API, on a tiny transformers Llama and on thrifty's reference model: the packed model computes what its BitLinears
did, composes with quantized attention and the KV caches, goes straight on from "train-bitnet", undo gives the
BitLinears back bit for bit, describe measures the bytes, and what cannot work is refused with the reason."""

import copy

import pytest
import torch

import thrifty
from thrifty import OptimizeConfig, ShadowKVConfig, bitnet

VOCAB = 101
PROMPT_LEN = 40
LAYER_ATOL = 1e-5  # a packed layer vs its BitLinear on the same input: the same integer math, fp32 rounded
# elsewhere (~1e-7). Through a whole model a rounding difference can land on a quantizer's edge (an INT8 code at
# x.5, a TopK tie: ternary dot products collide) and move that code; at initialisation the small residual stream
# carries it on: logits then differ by up to ~0.5% of the largest (measured 0.003 of 0.6 on the reference model)
MODEL_RTOL = 0.02  # of max |logit|
# full budget and rank: ShadowKV selects every token (see test_optimize.py)
EXACT_SHADOWKV = ShadowKVConfig(rank=32, chunk_size=4, sparse_budget=400, outlier_chunks=2, local_chunks=2,
                                min_prompt_len=20, max_generated=16)


def tiny_hf():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def reference_config():
    from thrifty.models import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def bitnet_hf(recipe="b1.58"):
    """A transformers Llama whose linear layers are BitLinears (converted, as a fine-tune would start)."""
    return bitnet.convert(tiny_hf(), recipe)


def bitnet_reference(recipe="b1.58"):
    """The reference model built BitNet (its Linear seam)."""
    from thrifty.models import LlamaForCausalLM

    return LlamaForCausalLM(reference_config(), linear=bitnet.linear_factory(recipe),
                            activation=bitnet.mlp_activation(recipe)).init_weights(seed=0).eval()


BITNET_MODELS = {"transformers": bitnet_hf, "reference": bitnet_reference}


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(1))


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return (out if isinstance(out, torch.Tensor) else out.logits).float()


def greedy(model, ids, n=3):
    from thrifty.models import LlamaForCausalLM, generate

    with torch.no_grad():
        if isinstance(model, LlamaForCausalLM):
            return generate(model, ids, n)[:, ids.shape[1]:]
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=0)[:, ids.shape[1]:]


def names_of(model, cls_name):
    return [n for n, m in model.named_modules() if type(m).__name__ == cls_name]


def close_logits(actual, expected):
    assert (actual - expected).abs().max() <= MODEL_RTOL * expected.abs().max()


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def record_linears(model, ids) -> dict:
    """{name: (input, output)} of every projection (packed, stacked slice or BitLinear) in one forward."""
    seen = {}

    def hook(name):
        def record(module, args, out):
            seen.setdefault(name, (args[0], out))  # returns None: the output is left as it is
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n.rpartition(".")[2] in LINEARS]
    logits(model, ids)
    for h in handles:
        h.remove()
    return seen


def assert_layers_are_the_bitlinears(model, seen):
    """Each recorded packed projection's output is the output of the BitLinear now at its name (after undo) on the
    same input."""
    assert len(seen) == len(LINEARS) * len(model.model.layers)
    for name, (x, y) in seen.items():
        layer = model.get_submodule(name)
        assert type(layer).__name__ == "BitLinear"
        with torch.no_grad():
            torch.testing.assert_close(y, layer(x), atol=LAYER_ATOL, rtol=0)


def snapshot(model):
    """(state dict tensors cloned, (name, module type) of every module, the model's own attributes)."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, [(n, type(m)) for n, m in model.named_modules()], set(model.__dict__)


def assert_restored(model, before):
    state, modules, attributes = before
    now = model.state_dict()
    assert now.keys() == state.keys()
    assert all(torch.equal(now[k], v) and now[k].dtype == v.dtype and now[k].device == v.device
               for k, v in state.items())
    assert [(n, type(m)) for n, m in model.named_modules()] == modules
    assert set(model.__dict__) == attributes
    assert not [(n, k) for n, m in model.named_modules(remove_duplicate=False) for k in m.__dict__ if "thrifty" in k]
    assert thrifty.describe(model).startswith("thrifty: nothing applied")


def assert_packed_and_ran(model, ids):
    """Every BitLinear became packed, q/k/v and gate/up stacked, and every packed layer ran in a forward."""
    packed = [m for m in model.modules() if type(m).__name__ == "PackedBitLinear"]
    for m in packed:
        m.last_path = None
    logits(model, ids)
    assert packed and not names_of(model, "BitLinear") and all(m.last_path == "reference" for m in packed)
    layers = model.model.layers
    assert [(hasattr(layer.self_attn, "qkv_proj"), hasattr(layer.mlp, "gate_up_proj")) for layer in layers] == \
        [(True, True)] * len(layers)
    assert len(packed) == 4 * len(layers)  # qkv, o, gate_up, down
    assert type(layers[0].self_attn.q_proj).__name__ == "ProjectionSlice"


# ------------------------------------------------------------------------------------------------ serving
@pytest.mark.parametrize("kind", BITNET_MODELS)
def test_serve_bitnet_computes_what_the_bitlinears_did_and_undo_gives_them_back(kind, ids):
    model = BITNET_MODELS[kind]()
    before = snapshot(model)
    expected_logits, expected_tokens = logits(model, ids), greedy(model, ids)
    thrifty.optimize(model, "serve-bitnet")
    assert model.thrifty_config.techniques == ("pack_bitnet",)
    assert_packed_and_ran(model, ids)
    seen = record_linears(model, ids)
    close_logits(logits(model, ids), expected_logits)
    assert torch.equal(greedy(model, ids), expected_tokens)
    thrifty.undo(model)
    assert_restored(model, before)
    assert_layers_are_the_bitlinears(model, seen)
    assert torch.equal(logits(model, ids), expected_logits) and torch.equal(greedy(model, ids), expected_tokens)
    thrifty.optimize(model, "serve-bitnet")  # and it can be applied again
    assert_packed_and_ran(model, ids)


@pytest.mark.parametrize("kind", ["transformers", "reference"])
def test_train_bitnet_then_serve_bitnet_then_undo(kind, ids):
    """The demo's way: "train-bitnet", training, then "serve-bitnet" on the same model (training's CCE comes off,
    the trained BitLinears are packed); undo gives back the trained BitLinear model bit for bit."""
    from thrifty.models import LlamaForCausalLM

    model = tiny_hf() if kind == "transformers" else LlamaForCausalLM(reference_config()).init_weights(seed=0)
    fp_modules = [(n, type(m)) for n, m in model.named_modules()]
    thrifty.optimize(model, "train-bitnet")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(2):
        out = model(ids, labels=ids.roll(-1, 1) if kind == "reference" else ids)
        (out if kind == "reference" else out.loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trained_modules = [(n, type(m)) for n, m in model.named_modules()]
    trained_logits = logits(model, ids)

    thrifty.optimize(model, "serve-bitnet")
    assert model.thrifty_config == OptimizeConfig.preset("serve-bitnet")
    if kind == "transformers":  # train-bitnet's CCE is off: the forward is the stock one again
        assert "forward" not in model.__dict__
    else:
        from thrifty.models.llama import logits_cross_entropy

        assert model.loss_fn is logits_cross_entropy
    assert_packed_and_ran(model, ids)

    thrifty.undo(model)
    state = model.state_dict()
    assert state.keys() == trained.keys() and all(torch.equal(state[k], v) for k, v in trained.items())
    assert [(n, type(m)) for n, m in model.named_modules()] == trained_modules != fp_modules
    assert torch.equal(logits(model, ids), trained_logits)
    assert thrifty.describe(model).startswith("thrifty: nothing applied")


def test_a_failed_serve_bitnet_leaves_the_training_call_on(ids, monkeypatch):
    model = thrifty.optimize(tiny_hf(), "train-bitnet")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = [(n, type(m)) for n, m in model.named_modules()]

    def broken(model):
        raise RuntimeError("stacking failed")

    monkeypatch.setattr(bitnet, "stack_projections", broken)  # fails after the BitLinears were packed
    with pytest.raises(RuntimeError, match="stacking failed"):
        thrifty.optimize(model, "serve-bitnet")
    assert model.thrifty_config == OptimizeConfig.preset("train-bitnet")
    assert [(n, type(m)) for n, m in model.named_modules()] == modules
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    model.train()
    assert model(ids, labels=ids).logits is None  # CCE is back on
    model.eval()
    thrifty.undo(model)
    assert not names_of(model, "BitLinear") and torch.equal(logits(model, ids), logits(tiny_hf(), ids))


# ------------------------------------------------------------------------------------------ composition
COMPOSED = [("transformers", "int8"), ("transformers", "shadowkv"), ("reference", "int8")]


@pytest.mark.parametrize("kind, kv", COMPOSED, ids=["+".join(c) for c in COMPOSED])
def test_serve_bitnet_composes_with_quantized_attention_and_the_kv_caches(kind, kv, ids):
    """Packed layers with quantized attention and a KV cache: each path runs, and the logits and greedy tokens are
    those of the same BitLinear model with the same attention and cache."""
    kv_cache = EXACT_SHADOWKV if kv == "shadowkv" else kv
    base = BITNET_MODELS[kind]()
    unpacked = thrifty.optimize(copy.deepcopy(base), OptimizeConfig(attention=True, kv_cache=kv_cache))
    model = thrifty.optimize(copy.deepcopy(base), OptimizeConfig(pack_bitnet=True, attention=True, kv_cache=kv_cache))
    assert_packed_and_ran(model, ids)
    seen = record_linears(model, ids)
    close_logits(logits(model, ids), logits(unpacked, ids))
    expected = logits(base, ids)  # quantized attention moved the logits: it ran
    assert not torch.equal(logits(model, ids), expected) and \
        (logits(model, ids) - expected).abs().max() < 0.05 * expected.abs().max()
    assert torch.equal(greedy(model, ids), greedy(unpacked, ids))
    cache = model._thrifty_last_cache
    if kv == "shadowkv":
        assert type(cache).__name__ == "ShadowKVCache" and not cache.dense
    elif kind == "transformers":
        assert type(cache.layers[0]).__name__ == "QuantizedKVLayer" and cache.layers[0].kv is not None
    else:
        assert type(cache).__name__ == "QuantizedKVCache" and len(cache) == PROMPT_LEN + 3
    if kind == "transformers":
        from thrifty.compose.dispatch import attention_calls

        assert attention_calls(model).get("quantized", 0) > 0
    before = snapshot(base)
    thrifty.undo(model)
    assert_restored(model, before)
    assert_layers_are_the_bitlinears(model, seen)


# ---------------------------------------------------------------------------------------------- describe
def test_describe_measures_the_packed_bytes(ids):
    model = bitnet_hf()
    latent = sum(m.weight.numel() * 4 for m in model.modules() if type(m).__name__ == "BitLinear")
    thrifty.optimize(model, "serve-bitnet")
    packed = [m for m in model.modules() if type(m).__name__ == "PackedBitLinear"]
    stored = sum(m.packed.numel() + 4 * m.alpha.numel() for m in packed)
    line = thrifty.describe(model).splitlines()[1]
    assert line.startswith("  pack_bitnet 14 BitLinear layers packed 2-bit into 8 PackedBitLinear (4 of them stacked")
    assert f"(x{stored / latent:.3f}; x{2 * stored / latent:.3f} of" in line and "float32 latent" in line
    assert stored < latent / 2  # fewer bytes than bf16 even with the tiny rows padded to 256 weights
    assert "kept on the CPU for thrifty.undo" in line


def test_describe_of_train_bitnet_foretells_the_packed_bytes():
    """What describe says "train-bitnet"'s BitLinears will take packed is what "serve-bitnet" then measures; at
    widths of whole 256-weight groups that is 1/16 of the fp32 latent weights and 1/8 of bf16."""
    import re
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4)
    model = thrifty.optimize(LlamaForCausalLM(cfg).eval(), "train-bitnet")
    foretold = re.search(r"-> ([0-9.]+ MB) packed 2-bit for serving", thrifty.describe(model)).group(1)
    thrifty.optimize(model, "serve-bitnet")
    stored = sum(m.packed.numel() + 4 * m.alpha.numel() for m in model.modules()
                 if type(m).__name__ == "PackedBitLinear")
    assert foretold == f"{stored / 2**20:.1f} MB" and f"-> {foretold} (x0.063; x0.125 of" in thrifty.describe(model)


# ---------------------------------------------------------------------------------------------- refused
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(pack_bitnet=True, training=True), ValueError, "pack_bitnet: packed layers are for inference"),
    (dict(pack_bitnet=True, bitnet="a4.8"), ValueError, "bitnet, pack_bitnet: cannot go together"),
    (dict(pack_bitnet=True, neuzip="lossless"), ValueError,
     "neuzip, pack_bitnet: cannot go together. NeuZip entropy-codes nn.Linear weights; packed ternary"),
    (dict(pack_bitnet="yes"), TypeError, "pack_bitnet: expected a bool"),
    (dict(pack_bitnet=True, skip_layers=(1,)), ValueError, "skip_layers: only BitNet and quantized attention"),
])
def test_bad_configs_are_refused_with_the_reason(kwargs, error, match):
    with pytest.raises(error, match=match):
        OptimizeConfig(**kwargs)


def test_the_preset_refuses_training():
    with pytest.raises(ValueError, match="pack_bitnet: packed layers are for inference: .* \"train-bitnet\""):
        OptimizeConfig.preset("serve-bitnet", training=True)


def one_unpackable(model):
    """``model`` with its last BitLinear (layer 1's down_proj) half switched: the one layer that cannot pack."""
    model.model.layers[1].mlp.down_proj.configure(strength=0.5)
    return model


def test_models_that_cannot_be_packed_are_refused_and_left_untouched(ids):
    cases = [
        (tiny_hf(), "no BitLinear layer to pack.* \"train-bitnet\" preset.*without retraining"),
        (bitnet.pack(bitnet_hf()), "packed already"),
        (bitnet_hf("a4.8-fp4"), r"pack_bitnet: model\.layers\.0\.self_attn\.q_proj: activation 'fp4' has no integer "
                                "packed path"),
        (bitnet.convert(tiny_hf(), bitnet.BitNetConfig("b1.58", strength=0.5)),
         r"pack_bitnet: model\.layers\.0\.self_attn\.q_proj: strength is 0\.5"),
        (one_unpackable(bitnet_hf()), r"pack_bitnet: model\.layers\.1\.mlp\.down_proj: strength is 0\.5"),
        (thrifty.optimize(bitnet_hf(), OptimizeConfig(cce=True)),
         "already applied .* \\(pack_bitnet follows only a call that put BitNet on\\)"),
    ]
    for model, match in cases:
        before = snapshot(model)
        with pytest.raises(ValueError, match=match):
            thrifty.optimize(model, "serve-bitnet")
        state, modules, attributes = before
        assert [(n, type(m)) for n, m in model.named_modules()] == modules and set(model.__dict__) == attributes
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
