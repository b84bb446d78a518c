"""thrifty.optimize / undo / describe through the public API, on a tiny transformers Llama and on thrifty's
reference model: every preset, undo bit for bit, refused inputs. Every allowed pair of techniques:
test_optimize_pairs.py."""

import copy

import pytest
import torch

import thrifty
from thrifty import AttentionConfig, OptimizeConfig, ShadowKVConfig
from thrifty.compose import PRESETS

VOCAB = 101
PROMPT_LEN = 40
# full budget and full rank (2 KV heads x 16): ShadowKV then selects every token, so its greedy tokens are the
# dense ones; min_prompt_len below the prompt so the cache really compresses
EXACT_SHADOWKV = ShadowKVConfig(rank=32, chunk_size=4, sparse_budget=400, outlier_chunks=2, local_chunks=2,
                                min_prompt_len=20, max_generated=16)


def tiny_hf(layers=2, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def tiny_reference():
    from thrifty.models import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).init_weights(seed=0).eval()


@pytest.fixture(scope="module")
def hf_base():
    return tiny_hf()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(1))


def preset_config(name, **overrides):
    if "long-context" in name:  # the paper's ShadowKV sizes need 4K-token prompts and rank 160
        overrides.setdefault("kv_cache", EXACT_SHADOWKV)
    return OptimizeConfig.preset(name, **overrides)


def model_for(name, base):
    model = copy.deepcopy(base)
    if name == "serve-bitnet":  # serves the BitLinears of a BitNet model (test_optimize_pack.py: the details)
        from thrifty import bitnet

        return bitnet.convert(model, "b1.58")
    return model.to(torch.bfloat16) if name == "serve-small" else model  # lossy NeuZip codes bf16 weights


def generate(model, ids, n=3):
    mask = torch.ones_like(ids)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)[:, ids.shape[1]:]


def train_loss(model, ids):
    model.train()
    out = model(ids, labels=ids)
    model.eval()
    return out


def eval_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def module_names(model, cls_name):
    return [n for n, m in model.named_modules() if type(m).__name__ == cls_name]


# ------------------------------------------------------------------------------ each technique actually on
def assert_on(model, technique, ids):
    """Runs the model and asserts that ``technique``'s own code path ran."""
    if technique == "bitnet":
        assert module_names(model, "BitLinear") and module_names(model, "RampedReLUSquared")
    elif technique == "pack_bitnet":
        packed = [m for m in model.modules() if type(m).__name__ == "PackedBitLinear"]
        for m in packed:
            m.last_path = None
        eval_logits(model, ids)
        assert packed and not module_names(model, "BitLinear") and all(m.last_path for m in packed)
    elif technique == "neuzip":
        runs = model.neuzip.stats["block_runs"]
        eval_logits(model, ids)
        assert module_names(model, "CompressedLinear") and model.neuzip.stats["block_runs"] > runs
    elif technique == "cce":
        out = train_loss(model, ids)
        assert out.logits is None and torch.isfinite(out.loss)  # the loss came without logits
    elif technique == "attention":
        from thrifty.compose.dispatch import attention_calls

        before = attention_calls(model).get("quantized", 0)
        eval_logits(model, ids)
        assert attention_calls(model)["quantized"] > before
    elif technique == "kv_cache":
        generate(model, ids)
        cache = model._thrifty_last_cache
        if isinstance(model.thrifty_config.kv_cache, ShadowKVConfig):
            assert not cache.dense and cache.engine.stats["reference_steps"] + cache.engine.stats["kernel_steps"] > 0
        else:
            assert type(cache.layers[0]).__name__ == "QuantizedKVLayer" and cache.layers[0].kv is not None


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_on_a_tiny_transformers_llama(name, hf_base, ids):
    model = thrifty.optimize(model_for(name, hf_base), preset_config(name))
    assert model.thrifty_config.techniques  # recorded on the model
    for technique in model.thrifty_config.techniques:
        assert_on(model, technique, ids)
    report = thrifty.describe(model)
    for technique in model.thrifty_config.techniques:
        assert f"  {technique}" in report


@pytest.mark.parametrize("name", PRESETS)
def test_presets_on_the_reference_model(name, ids):
    from thrifty.kv import QuantizedKVCache
    from thrifty.models import generate as ref_generate

    base = model_for(name, tiny_reference())
    expected = base(ids)
    model = thrifty.optimize(copy.deepcopy(base), preset_config(name, kv_cache=ShadowKVConfig(
        rank=32, chunk_size=4, sparse_budget=400, outlier_chunks=2, local_chunks=2, min_prompt_len=20))
        if name == "serve-long-context" else preset_config(name))
    config = model.thrifty_config
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == expected.shape and torch.isfinite(logits).all()
    if config.bitnet is not None:
        assert module_names(model, "BitLinear")
    if config.pack_bitnet:
        assert module_names(model, "PackedBitLinear") and not module_names(model, "BitLinear")
        assert module_names(model, "ProjectionSlice")  # q/k/v and gate/up stacked
    if config.neuzip is not None:
        assert module_names(model, "CompressedLinear") and model.neuzip.stats["block_runs"] > 0
    if config.attention is not None:  # quantized: close to the exact logits, not equal
        assert not torch.equal(logits, expected) and (logits - expected).abs().max() < 0.05 * expected.abs().max()
    if config.cce is not None:
        from thrifty.models.llama import logits_cross_entropy

        labels = ids.roll(-1, 1)
        exact = logits_cross_entropy(model.model(ids, torch.arange(PROMPT_LEN)), model.lm_head.weight, labels)
        assert torch.allclose(model(ids, labels=labels), exact, atol=1e-5)
        assert model.loss_fn is not logits_cross_entropy
    if isinstance(config.kv_cache, ShadowKVConfig):
        ref_generate(model, ids, 3)
        assert not model._thrifty_last_cache.dense
    elif config.kv_cache is not None:  # the int8 cache: the prompt and the 3 new tokens cached
        ref_generate(model, ids, 3)
        cache = model._thrifty_last_cache
        assert type(cache) is QuantizedKVCache and cache.bits == 8 and len(cache) == PROMPT_LEN + 3
    for technique in config.techniques:
        assert f"  {technique}" in thrifty.describe(model)
    if config.neuzip is not None and config.neuzip.kept_bits is not None:  # lossy: the dropped bits are gone
        with pytest.raises(ValueError, match="lossy NeuZip .* cannot be restored"):
            thrifty.undo(model)
        return
    thrifty.undo(model)
    assert torch.equal(model(ids), expected)


# ------------------------------------------------------------------------ the int8 cache on the reference model
INT8_FIRST_STEP_ATOL = 1e-2  # the prompt's logits, int8 K/V vs the plain cache (the pairs test's INT8_ATOL)


def greedy_with_logits(model, ids, cache, n=4):
    """thrifty.models.generate's greedy loop through ``cache``, keeping every step's logits."""
    tokens, steps = [], []
    with torch.no_grad():
        logits = model(ids, cache=cache, logits_to_keep=1)
        for _ in range(n):
            steps.append(logits[:, -1].float())
            tokens.append(steps[-1].argmax(-1, keepdim=True))
            logits = model(tokens[-1], cache=cache)
    return torch.cat(tokens, 1), torch.stack(steps)


@pytest.mark.parametrize("bits", [8, 4])
def test_generate_on_the_reference_model_runs_through_the_low_bit_cache(bits, ids, monkeypatch):
    from thrifty.compose import LowBitKVConfig
    from thrifty.kv import QuantizedKVCache
    from thrifty.models import generate as ref_generate
    from thrifty.models.llama import KVCache

    model = thrifty.optimize(tiny_reference(), OptimizeConfig(kv_cache=LowBitKVConfig(bits=bits)))
    updates = []  # a spy on the quantized cache's update: the cache generate used, layer by layer
    real_update = QuantizedKVCache.update
    monkeypatch.setattr(QuantizedKVCache, "update",
                        lambda self, i, *a: updates.append((type(self), self.bits, i)) or real_update(self, i, *a))
    out = ref_generate(model, ids, 4)
    assert out.shape == (2, PROMPT_LEN + 4)
    assert set(updates) == {(QuantizedKVCache, bits, 0), (QuantizedKVCache, bits, 1)}
    assert len(updates) == 2 * (1 + 4)  # per layer: the prompt, then each new token as generate feeds it back
    assert "last generate cached" in thrifty.describe(model)
    monkeypatch.undo()

    quantized_tokens, quantized_steps = greedy_with_logits(model, ids, model.thrifty_cache_factory())
    plain_tokens, plain_steps = greedy_with_logits(model, ids, KVCache())
    assert torch.equal(out[:, PROMPT_LEN:], quantized_tokens)  # generate is this loop through the factory's cache
    assert not torch.equal(quantized_steps[0], plain_steps[0])  # the prompt attended to its quantized K/V
    if bits == 8:  # 8-bit K/V: the plain cache's logits up to the quantization, and its greedy tokens
        torch.testing.assert_close(quantized_steps[0], plain_steps[0], atol=INT8_FIRST_STEP_ATOL, rtol=0)
        assert torch.equal(quantized_tokens, plain_tokens)


def test_undo_of_the_low_bit_cache_restores_the_reference_model_bit_for_bit(ids):
    from thrifty.models import generate as ref_generate

    model = tiny_reference()
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_logits, before_tokens = model(ids), ref_generate(model, ids, 3)
    before_attention = [layer.self_attn.attention for layer in model.model.layers]
    before_dict = set(model.__dict__)
    config = OptimizeConfig(kv_cache="int8", attention=True)
    thrifty.optimize(model, config)
    ref_generate(model, ids, 3)
    assert type(model._thrifty_last_cache).__name__ == "QuantizedKVCache" and model._thrifty_last_cache.reads_codes
    thrifty.undo(model)
    state = model.state_dict()
    assert state.keys() == before_state.keys()
    assert all(torch.equal(state[k], v) and state[k].dtype == v.dtype for k, v in before_state.items())
    assert set(model.__dict__) == before_dict  # no cache factory, no last cache
    assert [layer.self_attn.attention for layer in model.model.layers] == before_attention
    assert torch.equal(model(ids), before_logits) and torch.equal(ref_generate(model, ids, 3), before_tokens)
    assert thrifty.describe(model).startswith("thrifty: nothing applied")
    thrifty.optimize(model, config)  # and it can be applied again


# ---------------------------------------------------------------------------------------------- undo
UNDOABLE = [preset_config("train-memory", training=False), preset_config("train-bitnet"),
            preset_config("serve-long-context"),
            OptimizeConfig(bitnet="b1.58", attention=AttentionConfig(qk_bits=4), skip_layers=(1,),
                           kv_cache="int8", cce=True)]


@pytest.mark.parametrize("config", UNDOABLE, ids=lambda c: "+".join(c.techniques))
def test_undo_restores_the_model_bit_for_bit(config, hf_base, ids):
    model = copy.deepcopy(hf_base)
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_logits, before_tokens = eval_logits(model, ids), generate(model, ids)
    before_modules = [(n, type(m)) for n, m in model.named_modules()]
    thrifty.optimize(model, config)
    assert_on(model, config.techniques[-1], ids)
    thrifty.undo(model)
    state = model.state_dict()
    assert state.keys() == before_state.keys()
    assert all(torch.equal(state[k], v) and state[k].dtype == v.dtype for k, v in before_state.items())
    assert [(n, type(m)) for n, m in model.named_modules()] == before_modules
    assert torch.equal(eval_logits(model, ids), before_logits) and torch.equal(generate(model, ids), before_tokens)
    assert model.config._attn_implementation == hf_base.config._attn_implementation
    assert not {"forward", "generate"} & set(model.__dict__)
    assert not [(n, k) for n, m in model.named_modules(remove_duplicate=False) for k in m.__dict__ if "thrifty" in k]
    assert thrifty.describe(model).startswith("thrifty: nothing applied")
    thrifty.optimize(model, config)  # and it can be applied again


def test_undo_of_lossy_neuzip_is_refused_and_leaves_the_model_on(hf_base):
    model = thrifty.optimize(model_for("serve-small", hf_base), "serve-small")
    with pytest.raises(ValueError, match="lossy NeuZip .* cannot be restored"):
        thrifty.undo(model)
    assert model.thrifty_config is not None and module_names(model, "CompressedLinear")


def test_undo_of_a_plain_model_is_refused(hf_base):
    with pytest.raises(ValueError, match="model: thrifty.optimize was not applied"):
        thrifty.undo(copy.deepcopy(hf_base))


# ---------------------------------------------------------------------------------------------- layers
def test_skip_layers_keep_exact_attention_and_full_precision_linears(ids):
    from thrifty.compose.dispatch import CALLS_ATTR

    model = thrifty.optimize(tiny_hf(layers=3), OptimizeConfig(bitnet="b1.58", attention=True, skip_layers=(0, 2)))
    eval_logits(model, ids)
    layers = model.model.layers
    assert [bool(module_names(layer, "BitLinear")) for layer in layers] == [False, True, False]
    assert [dict(layer.self_attn.__dict__[CALLS_ATTR]) for layer in layers] == [
        {"sdpa": 1}, {"quantized": 1}, {"sdpa": 1}]


def test_options_live_on_the_model(hf_base, ids):
    a = thrifty.optimize(copy.deepcopy(hf_base), OptimizeConfig(attention=AttentionConfig(qk_bits=4)))
    b = thrifty.optimize(copy.deepcopy(hf_base), OptimizeConfig(attention=AttentionConfig(qk_bits=8)))
    assert a.model.layers[0].self_attn._thrifty_sage_options["config"].qk_bits == 4
    assert b.model.layers[0].self_attn._thrifty_sage_options["config"].qk_bits == 8
    assert not torch.equal(eval_logits(a, ids), eval_logits(b, ids))


def test_impl_environment_override(monkeypatch):
    config = OptimizeConfig(attention=True, impl="auto")
    monkeypatch.setenv("THRIFTY_IMPL", "reference")
    assert config.resolved_impl() == "reference"
    monkeypatch.setenv("THRIFTY_IMPL", "fast")
    with pytest.raises(ValueError, match="THRIFTY_IMPL"):
        config.resolved_impl()


# ---------------------------------------------------------------------------------------------- refused
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(bitnet="a4.8", neuzip="lossless"), ValueError, "bitnet, neuzip: cannot go together"),
    (dict(neuzip="lossy"), TypeError, "neuzip: expected"),
    (dict(training=True, neuzip=None, cce=True, lomo="adamw"), TypeError, "lomo"),
    (dict(cce=True, skip_layers=(1,)), ValueError, "skip_layers: only BitNet and quantized attention"),
    (dict(attention=True, skip_layers=(True,)), TypeError, "skip_layers"),
    (dict(attention=AttentionConfig(plan={1: 4}), skip_layers=(1,)), ValueError, "skip_layers: layers \\[1\\]"),
    (dict(attention="yes"), TypeError, "attention: expected"),
    (dict(bitnet="fp"), ValueError, "bitnet: recipe 'fp'"),
    (dict(bitnet="b2"), ValueError, "recipe"),
    (dict(kv_cache="paged"), ValueError, "kv_cache"),
    (dict(impl="cuda"), ValueError, "impl"),
    (dict(training="yes"), TypeError, "training"),
])
def test_bad_configs_are_refused_with_the_argument_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        OptimizeConfig(**kwargs)


def test_lossy_neuzip_while_training_is_refused():
    from thrifty.neuzip import NeuZipConfig

    with pytest.raises(ValueError, match="neuzip: lossy NeuZip .* cannot train"):
        OptimizeConfig(neuzip=NeuZipConfig(mode="lossy", mantissa_bits=3), training=True)
    with pytest.raises(ValueError, match="neuzip: lossy"):
        OptimizeConfig.preset("serve-small", training=True)


def test_bad_models_and_calls_are_refused(hf_base):
    with pytest.raises(ValueError, match="preset: expected one of"):
        thrifty.optimize(copy.deepcopy(hf_base), "train-fast")
    with pytest.raises(TypeError, match="config: expected an OptimizeConfig"):
        thrifty.optimize(copy.deepcopy(hf_base), {"cce": True})
    with pytest.raises(TypeError, match="model: expected a transformers"):
        thrifty.optimize(torch.nn.Linear(4, 4), "train-bitnet")
    with pytest.raises(TypeError, match="overrides: unknown"):
        OptimizeConfig.preset("train-bitnet", recipe="b1.58")
    with pytest.raises(ValueError, match="skip_layers: layers \\[7\\] do not exist"):
        thrifty.optimize(copy.deepcopy(hf_base), OptimizeConfig(attention=True, skip_layers=(7,)))
    with pytest.raises(ValueError, match="rank"):  # the paper's rank 160 > 2 KV heads x 16
        thrifty.optimize(copy.deepcopy(hf_base), "serve-long-context")
    with pytest.raises(ValueError, match="bfloat16"):
        thrifty.optimize(copy.deepcopy(hf_base), "serve-small")  # fp32 weights: lossy NeuZip codes bf16


def test_a_failed_optimize_leaves_the_model_as_it_came(hf_base, ids, monkeypatch):
    import thrifty.attention.hf

    def broken(*args, **kwargs):
        raise RuntimeError("attention failed")

    model = copy.deepcopy(hf_base)
    expected = eval_logits(model, ids)
    monkeypatch.setattr(thrifty.attention.hf, "enable_hf", broken)  # fails after BitNet and CCE went on
    with pytest.raises(RuntimeError, match="attention failed"):
        thrifty.optimize(model, OptimizeConfig(bitnet="b1.58", cce=True, attention=True))
    assert not {"forward", "thrifty_config", "_thrifty_undo"} & set(model.__dict__)
    assert not module_names(model, "BitLinear")
    assert torch.equal(eval_logits(model, ids), expected)


def test_optimizing_twice_or_after_compile_is_refused(hf_base):
    model = thrifty.optimize(copy.deepcopy(hf_base), OptimizeConfig(cce=True))
    with pytest.raises(ValueError, match="already applied .* thrifty.undo"):
        thrifty.optimize(model, OptimizeConfig(attention=True))
    compiled = torch.compile(copy.deepcopy(hf_base))
    with pytest.raises(TypeError, match="torch.compile"):
        thrifty.optimize(compiled, "train-bitnet")
    in_place = copy.deepcopy(hf_base)
    in_place.compile()
    with pytest.raises(ValueError, match="compile"):
        thrifty.optimize(in_place, "train-bitnet")


def test_bitnet_then_neuzip_by_hand_says_why(hf_base):
    from thrifty import bitnet, neuzip

    model = bitnet.convert(copy.deepcopy(hf_base), "b1.58")
    with pytest.raises(ValueError, match="BitLinear"):
        neuzip.compress_model(model, "lossless")
