"""thrifty.attention: the reference against fp64 attention, the public API, the model seams, plans, errors.

Inputs mimic real attention: K has channels with a large bias shared by all tokens (outliers that make
naive per-block INT8 lose most of its resolution), which K smoothing removes exactly."""

import json

import pytest
import torch

from thrifty.attention import (SageConfig, accuracy_metrics, apply_plan, calibrate, disable_hf, plan_from_scores, enable_hf,
                               exact_attention, load_plan, sage_attention, sage_attention_reference, sage_seam, save_plan)
from thrifty.attention.reference import QMAX, quantize_channels, quantize_tokens, round_to_format, token_groups


def qkv(B=1, H=4, Hkv=2, Sq=96, Sk=96, D=64, k_bias=0.0, heavy=False, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    def rnd(*shape):
        x = torch.randn(*shape, generator=g)
        if heavy:  # Student-t-like tails
            x = x / torch.rand(*shape, generator=g).clamp_min(0.05).sqrt()
        return x
    q = rnd(B, H, Sq, D) * 1.5
    k = rnd(B, Hkv, Sk, D) * 1.5
    if k_bias:  # a few channels with a large per-channel offset shared by every token, as in real K
        bias = torch.zeros(D)
        bias[torch.randperm(D, generator=g)[:6]] = k_bias * torch.sign(torch.randn(6, generator=g))
        k = k + bias
    v = rnd(B, Hkv, Sk, D)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def cos(a, b):
    return accuracy_metrics(a, b)["cos_sim"]


# ------------------------------------------------------------------------------------------------ quantizers
def test_round_to_format_grids():
    x = torch.tensor([-200.0, -7.6, -0.5, 0.4, 3.5, 126.6])
    assert round_to_format(x, "int4").tolist() == [-7, -7, -0, 0, 4, 7]
    assert round_to_format(x, "int8").tolist() == [-127, -8, -0, 0, 4, 127]
    assert round_to_format(torch.tensor([124.2, 500.0]), "e4m3").tolist() == [128.0, 448.0]


@pytest.mark.parametrize("gran", ["tensor", "block", "warp", "thread", "token"])
def test_quantize_tokens_granularity(gran):
    x = torch.randn(2, 3, 70, 16)
    vals, scale = quantize_tokens(x, "int8", gran, block=32, warp=16)
    assert vals.abs().max() <= 127 and torch.equal(vals, vals.round())
    assert (vals * scale - x).abs().max() <= scale.max() / 2 + 1e-6
    # thread: 4 full warp slices of 8 row groups, then the last slice's 6 rows (70 = 4 * 16 + 6)
    n_scales = {"tensor": 1, "block": 3, "warp": 5, "thread": 4 * 8 + 6, "token": 70}[gran]
    assert len(torch.unique(scale[0, 0])) <= n_scales
    groups = token_groups(70, gran, block=32, warp=16)
    assert int(groups.max()) + 1 == n_scales == len(torch.unique(groups))


def test_v_per_channel_fp8():
    v = torch.randn(1, 2, 50, 8) * torch.logspace(-2, 2, 8)
    vals, scale = quantize_channels(v, "e4m3")
    assert scale.shape == (1, 2, 1, 8) and vals.abs().amax(dim=2).allclose(torch.full((1, 2, 8), QMAX["e4m3"]))
    assert cos(vals * scale, v) > 0.999


# -------------------------------------------------------------------------------------- reference accuracy
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heavy", [False, True])
def test_reference_8bit_close_to_fp64(causal, heavy):
    q, k, v = qkv(Sq=77, Sk=130, heavy=heavy, k_bias=8.0)
    ref = exact_attention(q, k, v, causal=causal)
    out = sage_attention_reference(q, k, v, causal=causal)
    # heavy tails (|x| up to ~20σ) cost INT8 per-block K resolution; still close
    assert cos(out, ref) > (0.995 if heavy else 0.999)
    assert accuracy_metrics(out, ref)["rel_l1"] < (0.08 if heavy else 0.04)


def test_k_smoothing_recovers_accuracy_lost_to_k_bias():
    q, k, v = qkv(Sq=128, Sk=128, k_bias=80.0, seed=1)
    ref = exact_attention(q, k, v)
    kw = dict(k_granularity="block", q_granularity="block")
    raw = accuracy_metrics(sage_attention_reference(q, k, v, smooth_k=False, pv="fp32", **kw), ref)
    smooth = accuracy_metrics(sage_attention_reference(q, k, v, smooth_k=True, pv="fp32", **kw), ref)
    assert raw["cos_sim"] < 0.99 < 0.999 < smooth["cos_sim"]
    # INT4 needs smoothing even more; it stays usable only with it
    raw4 = cos(sage_attention_reference(q, k, v, qk_format="int4", smooth_k=False, **kw), ref)
    smooth4 = cos(sage_attention_reference(q, k, v, qk_format="int4", smooth_k=True, **kw), ref)
    assert raw4 < 0.5 and smooth4 > 0.9


def test_k_smoothing_is_exact_and_lse_shift_added_back():
    q, k, v = qkv(k_bias=5.0)
    a, lse_a = sage_attention_reference(q, k, v, qk_format="fp32", pv="fp32", smooth_k=True, return_lse=True)
    b, lse_b = exact_attention(q, k, v, return_lse=True)
    assert (a - b).abs().max() < 1e-5 and (lse_a - lse_b).abs().max() < 1e-4


def test_q_and_v_smoothing_are_exact_without_quantization():
    q, k, v = qkv(Sq=70, Sk=50)
    q, v = q + 3.0, v - 2.0
    out = sage_attention_reference(q, k, v, qk_format="fp32", pv="fp32", smooth_q=True, smooth_v=True,
                                   causal=True, block_m=32)
    assert (out - exact_attention(q, k, v, causal=True)).abs().max() < 1e-5
    # and with quantization Q smoothing helps INT4 on a Q with a shared offset
    ref = exact_attention(q, k, v)
    plain = cos(sage_attention_reference(q, k, v, qk_format="int4", q_granularity="block"), ref)
    smooth = cos(sage_attention_reference(q, k, v, qk_format="int4", q_granularity="block", smooth_q=True), ref)
    assert smooth > plain


@pytest.mark.parametrize("pv", ["fp8", "e5m2", "int8", "fp16"])
def test_pv_formats(pv):
    q, k, v = qkv()
    ref = exact_attention(q, k, v)
    assert cos(sage_attention_reference(q, k, v, pv=pv), ref) > (0.995 if pv == "e5m2" else 0.999)


def test_one_level_accumulation_is_worse_than_two_level():
    q, k, v = qkv(Sq=32, Sk=512)
    ref = exact_attention(q, k, v)
    two = accuracy_metrics(sage_attention_reference(q, k, v, pv="fp32", qk_format="fp32"), ref)["rmse"]
    one = accuracy_metrics(sage_attention_reference(q, k, v, pv="fp32", qk_format="fp32",
                                                    two_level_accum=False, accum_mantissa_bits=8), ref)["rmse"]
    assert one > two


def test_causal_fewer_queries_than_keys_means_last_positions():
    q, k, v = qkv(Sq=96, Sk=96)
    full = exact_attention(q, k, v, causal=True)
    tail = sage_attention(q[:, :, -10:], k, v, causal=True, impl="reference")
    assert cos(tail, full[:, :, -10:]) > 0.999
    # more queries than keys: the first rows see nothing and output zeros, no nan
    out = sage_attention(q, k[:, :, :40], v[:, :, :40], causal=True, impl="reference")
    assert torch.isfinite(out).all() and out[:, :, :56].abs().max() == 0


# ------------------------------------------------------------------------------------------------- public API
def test_public_api_layouts_gqa_lse_and_dtypes():
    q, k, v = qkv(Sq=40, Sk=64)
    out, lse = sage_attention(q, k, v, return_lse=True)
    ref, ref_lse = exact_attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and cos(out, ref) > 0.999 and (lse - ref_lse).abs().max() < 0.05
    out_nhd = sage_attention(*(x.transpose(1, 2) for x in (q, k, v)), layout="bshd")
    assert torch.allclose(out_nhd.transpose(1, 2), out)
    bf = sage_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    assert bf.dtype == torch.bfloat16 and cos(bf, exact_attention(q, k, v, causal=True)) > 0.998


def test_4bit_mode_is_less_accurate_than_8bit():
    q, k, v = qkv(k_bias=4.0)
    ref = exact_attention(q, k, v)
    c8 = cos(sage_attention(q, k, v), ref)
    c4 = cos(sage_attention(q, k, v, config=SageConfig(qk_bits=4)), ref)
    assert 0.95 < c4 < c8


def test_training_calls_run_exact_sdpa_by_default(monkeypatch):
    """impl="auto" with inputs that need gradients: exact SDPA forward and backward (the quantized forward made
    a training step slower), the quantized forward not called; with grad disabled the quantized path runs."""
    from thrifty.attention import sage as sage_module

    calls = []
    real = sage_module._forward
    monkeypatch.setattr(sage_module, "_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k, v = (x.requires_grad_() for x in qkv(Sq=24, Sk=24))
    out = sage_attention(q, k, v, causal=True)
    assert not calls
    assert torch.allclose(out, exact_attention(q, k, v, causal=True), atol=1e-5)
    out.pow(2).sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))
    with torch.no_grad():
        sage_attention(q, k, v, causal=True)
    assert calls == [1]


def test_training_route_keeps_the_nan_rule():
    q, k, v = (x.clone() for x in qkv(Sq=24, Sk=24))
    q[0, 1, 5] = float("nan")
    q.requires_grad_()
    out = sage_attention(q, k, v, causal=True)
    assert torch.isnan(out[0, 1, 5]).all() and torch.isfinite(out[0, 1, :5]).all()


def test_exact_backward_gradients():
    """The quantized forward (an explicit impl) with the gradients of exact attention."""
    q, k, v = (x.requires_grad_() for x in qkv(Sq=24, Sk=24))
    sage_attention(q, k, v, causal=True, impl="reference").pow(2).sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    out = exact_attention(q, k, v, causal=True, dtype=torch.float32)
    out.pow(2).sum().backward()
    for g, x in zip(grads, (q, k, v)):
        assert cos(g, x.grad) > 0.99  # exact backward, evaluated at the quantized forward's output


@pytest.mark.parametrize("bad, err, match", [
    (dict(k=torch.randn(1, 3, 8, 16), v=torch.randn(1, 3, 8, 16)), ValueError, "multiple of key/value heads"),
    (dict(k=torch.randn(1, 2, 8, 32), v=torch.randn(1, 2, 8, 32)), ValueError, "head_dim"),
    (dict(v=torch.randn(1, 2, 9, 16)), ValueError, "equal shapes"),
    (dict(q=torch.randn(1, 4, 8, 16).double()), TypeError, "dtype"),
    (dict(q=torch.randn(4, 8, 16)), ValueError, "4 dimensions"),
    (dict(q="x"), TypeError, "torch.Tensor"),
    (dict(impl="cuda"), ValueError, "impl"),
    (dict(config=dict(qk_bits=4)), TypeError, "config"),
    (dict(sm_scale=-1.0), ValueError, "sm_scale"),
])
def test_bad_input_raises_clear_errors(bad, err, match):
    args = dict(q=torch.randn(1, 4, 8, 16), k=torch.randn(1, 2, 8, 16), v=torch.randn(1, 2, 8, 16))
    kw = {n: bad.pop(n) for n in list(bad) if n not in args}
    args.update(bad)
    with pytest.raises(err, match=match):
        sage_attention(args["q"], args["k"], args["v"], **kw)


@pytest.mark.parametrize("field, value, err", [
    ("qk_bits", 6, ValueError), ("qk_bits", "8", ValueError), ("qk_bits", None, ValueError),
    ("pv", "int3", ValueError), ("pv", "e4m3", ValueError),
    ("smooth_k", 1, TypeError), ("smooth_q", "yes", TypeError), ("smooth_q", 0, TypeError),
    ("smooth_v", None, TypeError),
])
def test_config_refuses_bad_values_naming_the_field(field, value, err):
    with pytest.raises(err, match=field):
        SageConfig(**{field: value})


def test_config_is_frozen_and_resolves_smooth_q_when_built():
    import dataclasses

    cfg = SageConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.qk_bits = 4
    assert (cfg.qk_bits, cfg.pv, cfg.smooth_k, cfg.smooth_q, cfg.smooth_v) == (8, "fp8", True, None, False)
    assert not cfg.q_smoothed and SageConfig(qk_bits=4).q_smoothed  # default: on for 4 bits, off for 8
    assert not SageConfig(qk_bits=4, smooth_q=False).q_smoothed and SageConfig(smooth_q=True).q_smoothed
    assert dataclasses.replace(cfg, qk_bits=4).q_smoothed  # a per-layer plan's replace resolves it again
    assert SageConfig() == cfg and hash(SageConfig(qk_bits=4)) == hash(SageConfig(qk_bits=4))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_config_runs_what_the_reference_specifies(bits, causal):
    """The default config (SageAttention2-8b; with qk_bits=4 SageAttention2-4b, Q smoothed per 64-query block)
    runs exactly the reference with those knobs spelled out; the config's other fields reach it too."""
    from thrifty.attention.sage import SMOOTH_Q_BLOCK

    q, k, v = qkv(Sq=80, Sk=96, k_bias=4.0)
    spec = dict(causal=causal, qk_format=f"int{bits}", pv="fp8", smooth_k=True, smooth_q=bits == 4, smooth_v=False,
                block_m=SMOOTH_Q_BLOCK, k_granularity="token" if bits == 4 else "block", return_lse=True)
    config = None if bits == 8 else SageConfig(qk_bits=4)
    out, lse = sage_attention(q, k, v, causal=causal, impl="reference", return_lse=True, config=config)
    want, want_lse = sage_attention_reference(q, k, v, **spec)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    other = SageConfig(qk_bits=bits, pv="fp16", smooth_k=False, smooth_q=bits == 8, smooth_v=True)
    out = sage_attention(q, k, v, causal=causal, impl="reference", config=other)
    want = sage_attention_reference(q, k, v, **dict(spec, pv="fp16", smooth_k=False, smooth_q=bits == 8,
                                                    smooth_v=True, return_lse=False))
    assert torch.equal(out, want)


@pytest.mark.parametrize("old", [dict(qk_bits=4), dict(pv="fp16"), dict(smooth_k=False), dict(smooth_q=True),
                                 dict(smooth_v=True)])
def test_quantization_keywords_live_on_the_config_only(old):
    q, k, v = qkv(Sq=8, Sk=8)
    with pytest.raises(TypeError, match=next(iter(old))):
        sage_attention(q, k, v, **old)
    with pytest.raises(TypeError, match=next(iter(old))):
        sage_seam(**old)
    sage_attention(q, k, v, config=SageConfig(**old))


def test_optimize_attention_config_is_not_a_sage_config():
    from thrifty import AttentionConfig

    q, k, v = qkv(Sq=8, Sk=8)
    with pytest.raises(TypeError, match="config: expected a thrifty.attention.SageConfig.*AttentionConfig is optimize"):
        sage_attention(q, k, v, config=AttentionConfig(qk_bits=4))
    with pytest.raises(TypeError, match="config"):
        sage_seam(config=AttentionConfig())


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = qkv(Sq=8, Sk=8)
    with pytest.raises(ValueError, match="needs CUDA"):
        sage_attention(q, k, v, impl="triton")


# ------------------------------------------------------------------------------------------------- models
def _tiny_reference_model():
    from thrifty.models import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).init_weights(seed=0).eval()


def test_reference_model_seam():
    model = _tiny_reference_model()
    ids = torch.randint(0, 256, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids)
        ref = ref.logits if hasattr(ref, "logits") else ref
        model.set_attention(sage_seam())
        out = model(ids)
        out = out.logits if hasattr(out, "logits") else out
    assert cos(out, ref) > 0.999


def test_calibrate_plan_round_trip(tmp_path):
    model = _tiny_reference_model()
    batches = [torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    plan, scores = calibrate(model, batches, threshold=0.5, return_scores=True)
    assert set(plan) == {0, 1, 2} and set(plan.values()) <= {4, 8} and all(0 < s <= 1 for s in scores.values())
    assert calibrate(model, batches, threshold=1.0) == {0: 8, 1: 8, 2: 8}  # nothing is perfect at 4 bits
    # one calibration, plans for any threshold: the same rule calibrate applies
    assert plan_from_scores(scores, 0.5) == plan and plan_from_scores(scores, 0.0) == {0: 4, 1: 4, 2: 4}
    with pytest.raises(ValueError, match="threshold"):
        plan_from_scores(scores, 1.5)
    with pytest.raises(TypeError, match="scores"):
        plan_from_scores([0.9], 0.5)
    path = save_plan(plan, tmp_path / "plan.json", scores=scores, model="tiny")
    assert json.loads(path.read_text())["format"].startswith("thrifty.sage_plan")
    assert load_plan(path) == plan
    apply_plan(model, {0: 4, 1: 8})
    bits = [layer.self_attn.attention.options["config"].qk_bits for layer in model.model.layers]
    assert bits == [4, 8, 8]
    apply_plan(model, {0: 4, 1: 8}, impl="reference", config=SageConfig(smooth_v=True))  # the plan sets qk_bits
    configs = [layer.self_attn.attention.options["config"] for layer in model.model.layers]
    assert configs == [SageConfig(qk_bits=4, smooth_v=True), SageConfig(smooth_v=True), SageConfig(smooth_v=True)]
    assert [c.q_smoothed for c in configs] == [True, False, False]  # smooth_q=None resolved per layer's bits
    with pytest.raises(ValueError, match="do not exist"):
        apply_plan(model, {7: 4})
    with pytest.raises(ValueError, match="4 or 8"):
        apply_plan(model, {0: 3})
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match="not a thrifty sage plan"):
        load_plan(tmp_path / "junk.json")


def _tiny_hf_llama(attn_implementation: str):
    """A 2-layer transformers Llama (GQA 4/2 heads, 128 wide), seed 0."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   attn_implementation=attn_implementation)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_hf_integration_matches_eager_and_keeps_causal_mask():
    model = _tiny_hf_llama("eager").eval()
    ids = torch.randint(0, 128, (2, 40))
    with torch.no_grad():
        ref = model(ids).logits
        enable_hf(model)
        assert model.config._attn_implementation == "thrifty_sage"
        out = model(ids).logits
        # causality: changing the last token must not change earlier logits beyond quantization noise (the
        # K mean and the scales are taken over all tokens, so they move a little)
        ids2 = ids.clone()
        ids2[:, -1] = (ids2[:, -1] + 1) % 128
        out2 = model(ids2).logits
        padded = torch.ones(2, 40, dtype=torch.long)
        padded[0, :5] = 0
        out_pad = model(ids, attention_mask=padded).logits  # real mask: exact SDPA fallback
        disable_hf(model)
        assert model.config._attn_implementation == "eager"
        ref_pad = model(ids, attention_mask=padded).logits
    assert cos(out, ref) > 0.999
    assert cos(out2[:, :-1], out[:, :-1]) > 0.9999 and cos(out2[:, -1], out[:, -1]) < 0.99
    assert (out_pad[:, 5:] - ref_pad[:, 5:]).abs().max() < 1e-4


def test_hf_training_calls_take_transformers_sdpa(monkeypatch):
    """In a transformers model with impl="auto", a forward that builds gradients calls transformers' own SDPA
    (stock training cost, stock gradients) and not sage_attention; under no_grad the quantized path runs; an
    explicit impl keeps the quantized forward while training."""
    from thrifty.attention import hf as hf_module

    model = _tiny_hf_llama("sdpa").train()
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, 128, (2, 40))
    ref_loss = model(ids, labels=ids).loss
    sage_calls = []
    real = hf_module.sage_attention
    monkeypatch.setattr(hf_module, "sage_attention", lambda *a, **k: sage_calls.append(1) or real(*a, **k))
    enable_hf(model)
    loss = model(ids, labels=ids).loss
    assert not sage_calls and torch.equal(loss, ref_loss)
    loss.backward()
    with torch.no_grad():
        model(ids)
    assert len(sage_calls) == layers
    enable_hf(model, impl="reference")
    model(ids, labels=ids).loss.backward()
    assert len(sage_calls) == 2 * layers
    disable_hf(model)


def test_hf_routes_count_the_path_each_call_took():
    """thrifty.attention.hf.routes: per path, the calls hf_sage_attention made since enable_hf; disable_hf
    clears them (a demo or a user can see whether the quantized path ran at all)."""
    from thrifty.attention.hf import routes

    model = _tiny_hf_llama("sdpa").train()
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, 128, (2, 40))
    enable_hf(model)
    assert routes(model) == {}
    model(ids, labels=ids).loss.backward()  # training: transformers' SDPA
    with torch.no_grad():
        model(ids)  # the quantized path (the reference on the CPU)
        model(ids[:, :8])  # 8 query rows: SDPA
    assert routes(model) == {"sdpa": 2 * layers, "sage": layers}
    enable_hf(model)
    assert routes(model) == {}
    disable_hf(model)
    assert routes(model) == {}


def _decode_logits(model, ids, steps):
    from transformers import DynamicCache

    cache, out = DynamicCache(), []
    with torch.no_grad():
        tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(steps):  # the same tokens for both models: compare the logits of each step
            logits = model(tok, past_key_values=cache, use_cache=True).logits[:, -1].float()
            out.append(logits)
            tok = (tok + 1) % 128
    return torch.stack(out)


@pytest.mark.cuda
def test_cuda_hf_decode_steps_take_one_row_flash(monkeypatch):
    """A decode step (one query row, no mask) in a transformers model runs torch's FlashAttention-2 op, not
    SDPA (whose cuDNN choice builds a graph per key length), with grouped KV heads as they are, and gives
    SDPA's logits."""
    from thrifty.attention import hf as hf_module

    model = _tiny_hf_llama("sdpa").eval().to("cuda", torch.bfloat16)
    ids = torch.randint(0, 128, (2, 41), device="cuda")
    ref = _decode_logits(model, ids, 5)
    calls = []
    real = hf_module.one_row_flash
    monkeypatch.setattr(hf_module, "one_row_flash", lambda *a: calls.append(1) or real(*a))
    enable_hf(model)
    out = _decode_logits(model, ids, 5)
    assert len(calls) == 5 * model.config.num_hidden_layers
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()


@pytest.mark.cuda
@pytest.mark.parametrize("D,heads,kv_heads,keys", [(64, 8, 2, 4097), (128, 4, 4, 333), (64, 6, 3, 1)])
def test_cuda_one_row_query_matches_float64(D, heads, kv_heads, keys, monkeypatch):
    """sage_attention on a one-row query (impl="auto": the flash route, asserted) against float64 attention,
    GQA, odd key counts, bhsd and bshd."""
    from thrifty.attention import sage as sage_module

    calls = []
    real = sage_module.one_row_flash
    monkeypatch.setattr(sage_module, "one_row_flash", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(D + keys)
    q = torch.randn(2, heads, 1, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, kv_heads, keys, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, kv_heads, keys, D, device="cuda", dtype=torch.bfloat16)
    ref = exact_attention(q.double(), k.double(), v.double(), causal=True)
    out = sage_attention(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and (out.double() - ref).abs().max() < 2e-2
    out_bshd = sage_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, layout="bshd")
    assert torch.equal(out_bshd.transpose(1, 2), out) and len(calls) == 2
