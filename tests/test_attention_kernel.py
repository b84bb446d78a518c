"""The Triton SageAttention kernel against the reference (same tile sizes, so the same quantization groups).

On CPU the kernel runs in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1): sizes stay
small. The ``cuda`` tests run on the GPU box at real sizes."""

import pytest
import torch

from thrifty.attention import SageConfig, accuracy_metrics, exact_attention, sage_attention, sage_attention_reference
from thrifty.attention.reference import K_GRANULARITY_4BIT, SMOOTH_Q_BLOCK
from thrifty.triton_utils import interpreting

pytestmark = pytest.mark.skipif(not (interpreting() or torch.cuda.is_available()),
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _blocks(D):
    from thrifty.attention.attn_kernel import kernel_config
    cfg = kernel_config(D, torch.device(DEVICE))
    return dict(block_m=cfg["block_m"], block_n=cfg["block_n"])


def _inputs(B, H, Hkv, Sq, Sk, D, dtype=torch.float32, seed=0, k_bias=4.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Sq, D, generator=g) * 1.5
    k = torch.randn(B, Hkv, Sk, D, generator=g) * 1.5 + k_bias * torch.randn(D, generator=g)
    v = torch.randn(B, Hkv, Sk, D, generator=g)
    return [x.to(DEVICE, dtype) for x in (q, k, v)]


CASES = [  # B, H, Hkv, Sq, Sk, causal
    (1, 2, 2, 64, 64, False),
    (1, 2, 2, 64, 64, True),
    (2, 4, 2, 37, 53, False),  # GQA, odd lengths, q_len != kv_len
    (1, 4, 1, 21, 70, True),   # causal with fewer queries than keys: queries are the last positions
    (1, 2, 1, 45, 19, True),   # more queries than keys: the first rows see nothing
]


# The kernel's arithmetic step for step as the reference's (the interpreter's default; on the GPU the default
# folds P_SCALE into the exponent, which moves a few p̃ by one e4m3 step: compared by cosine instead).
PLAIN = dict(fold=False)


def _assert_matches_reference(out, ref, atol):
    """Under the interpreter the plain path is the reference's arithmetic (exact exp2): ``atol``. On the GPU
    exp2 is ex2.approx, which moves a p̃ that sits on an e4m3 rounding boundary by one step (2^-4 of that
    weight): measured 3e-4..3e-3 on these inputs, so there the whole tensor is compared by cosine and a
    one-step bound."""
    if interpreting():
        assert (out - ref).abs().max() < atol
    else:
        assert accuracy_metrics(out, ref)["cos_sim"] > 0.99999
        assert (out - ref).abs().max() < 1e-2


def _kernel(q, k, v, causal, return_lse=False, **opts):
    from thrifty.attention.sage import _validate
    from thrifty.attention.attn_kernel import sage_forward_triton
    qk_bits, pv = opts.pop("qk_bits", 8), opts.pop("pv", "fp8")
    SageConfig(qk_bits=qk_bits, pv=pv)  # values sage_attention takes
    _validate(q, k, v, "triton", "bhsd", None)
    return sage_forward_triton(q, k, v, causal=causal, sm_scale=q.shape[-1] ** -0.5, qk_bits=qk_bits, pv=pv,
                               return_lse=return_lse, config=PLAIN, **opts)


@pytest.mark.parametrize("B,H,Hkv,Sq,Sk,causal", CASES)
def test_kernel_matches_reference_int8_fp8(B, H, Hkv, Sq, Sk, causal):
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, 64)
    out, lse = _kernel(q, k, v, causal, return_lse=True)
    ref, ref_lse = sage_attention_reference(q, k, v, causal=causal, return_lse=True, **_blocks(64))
    _assert_matches_reference(out, ref, 1e-4)
    finite = ref_lse.isfinite()
    assert torch.equal(finite, lse.isfinite()) and (lse - ref_lse)[finite].abs().max() < 1e-4
    exact = exact_attention(q, k, v, causal=causal)
    assert accuracy_metrics(out, exact)["cos_sim"] > 0.999
    default, default_lse = sage_attention(q, k, v, causal=causal, impl="triton", return_lse=True)
    assert accuracy_metrics(default, ref)["cos_sim"] > 0.99999
    # GPU default (folded exponent, ex2.approx): measured 1.5e-4 on LSEs of ~5; exact path in the interpreter
    assert (default_lse - ref_lse)[finite].abs().max() < (1e-4 if interpreting() else 1e-3)


@pytest.mark.parametrize("opts", [dict(qk_bits=4), dict(pv="fp16"), dict(smooth_v=True), dict(smooth_k=False)])
def test_kernel_modes(opts):
    q, k, v = _inputs(1, 2, 1, 40, 40, 64)
    out = _kernel(q, k, v, True, **dict(opts))
    default = sage_attention(q, k, v, causal=True, impl="triton", config=SageConfig(**opts))
    ref_opts = dict(opts)
    if "qk_bits" in ref_opts:  # 4 bits: one K scale per key
        ref_opts["qk_format"] = "int4" if ref_opts.pop("qk_bits") == 4 else "int8"
        ref_opts["k_granularity"] = K_GRANULARITY_4BIT
    ref = sage_attention_reference(q, k, v, causal=True, **ref_opts, **_blocks(64))
    _assert_matches_reference(out, ref, 1e-3)
    if opts.get("qk_bits") == 4:  # SageConfig(qk_bits=4) is SageAttention2-4b: Q smoothed too (ΔS)
        ref = sage_attention_reference(q, k, v, causal=True, smooth_q=True, **ref_opts,
                                       **dict(_blocks(64), block_m=SMOOTH_Q_BLOCK))
    assert accuracy_metrics(default, ref)["cos_sim"] > 0.99999


def test_kernel_bf16_and_bshd_layout():
    q, k, v = _inputs(1, 2, 2, 33, 33, 64, dtype=torch.bfloat16)
    out = sage_attention(*(x.transpose(1, 2) for x in (q, k, v)), impl="triton", layout="bshd")
    assert out.dtype == torch.bfloat16 and out.shape == (1, 33, 2, 64)
    ref = sage_attention_reference(q, k, v, **_blocks(64))
    assert (out.transpose(1, 2).float() - ref.float()).abs().max() < 2e-2  # bf16 output rounding


def test_unsupported_head_dim_falls_back_to_sdpa_with_warning():
    q, k, v = _inputs(1, 2, 2, 16, 16, 48)
    with pytest.warns(UserWarning, match="head_dim 48"):
        out = sage_attention(q, k, v, impl="triton")
    assert (out - exact_attention(q, k, v)).abs().max() < 1e-4


def test_smooth_q_runs_in_the_kernel_too():
    """Q smoothing (ΔS added back) was reference-only; since issue #20 the kernel has it (tests in
    test_attention_4bit.py): impl="triton" with smooth_q runs the kernel and matches the reference."""
    q, k, v = _inputs(1, 2, 2, 40, 40, 64)
    out = sage_attention(q, k, v, impl="triton", config=SageConfig(smooth_q=True))
    ref = sage_attention_reference(q, k, v, smooth_q=True, **dict(_blocks(64), block_m=SMOOTH_Q_BLOCK))
    assert accuracy_metrics(out, ref)["cos_sim"] > 0.99999
    # honoured, not silently ignored: the result is the smoothed one, not the 8-bit default's
    plain = sage_attention(q, k, v, impl="triton", config=SageConfig(smooth_q=False))
    plain_ref = sage_attention_reference(q, k, v, smooth_q=False, **_blocks(64))
    assert not torch.equal(out, plain)
    assert (out - ref).abs().max() < (out - plain_ref).abs().max()


# ------------------------------------------------------------------------------------------------ GPU only
@pytest.mark.cuda
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_kernel_real_sizes(D, causal):
    q, k, v = _inputs(2, 8, 2, 1000, 1000, D, dtype=torch.bfloat16)
    out = sage_attention(q, k, v, causal=causal)
    ref = sage_attention_reference(q, k, v, causal=causal, **_blocks(D))
    assert accuracy_metrics(out, ref)["cos_sim"] > 0.99999
    exact = exact_attention(q, k, v, causal=causal, dtype=torch.float32)
    assert accuracy_metrics(out, exact)["cos_sim"] > 0.999


@pytest.mark.cuda
def test_cuda_kernel_odd_lengths_and_lse():
    q, k, v = _inputs(1, 8, 4, 333, 1111, 128, dtype=torch.float16)
    out, lse = sage_attention(q, k, v, causal=True, return_lse=True)
    exact, exact_lse = exact_attention(q, k, v, causal=True, return_lse=True)
    assert accuracy_metrics(out, exact)["cos_sim"] > 0.999 and (lse - exact_lse).abs().max() < 0.1


@pytest.mark.skipif(not interpreting(), reason="exact to 1e-4 only where exp2 is exact (interpreter); "
                    "on the GPU ex2.approx moves a few p̃ by one e4m3 step: see test_cuda_default_and_plain_paths")
@pytest.mark.parametrize("cfg", [dict(fast_cvt=False, reverse=False), dict(fast_cvt=True, reverse=True)])
def test_inner_loop_variants_match_reference(cfg):
    """The int32→fp32 conversion (I2F or magic number) and the causal grid order change no result."""
    from thrifty.attention.attn_kernel import sage_forward_triton
    q, k, v = _inputs(1, 2, 1, 50, 50, 64)
    out = sage_forward_triton(q, k, v, causal=True, sm_scale=0.125, config=cfg)
    ref = sage_attention_reference(q, k, v, causal=True, sm_scale=0.125, **_blocks(64))
    assert (out - ref).abs().max() < 1e-4


def test_folded_exponent_matches_reference():
    """fold: P_SCALE·2^(s·c − m) from one FFMA (bias rounded once per row): p differs from the reference's
    2^(s·c − m)·P_SCALE by an ulp, which can move a p̃ to the next e4m3 value; same function otherwise."""
    from thrifty.attention.attn_kernel import sage_forward_triton
    q, k, v = _inputs(1, 2, 1, 50, 50, 64)
    out = sage_forward_triton(q, k, v, causal=True, sm_scale=0.125, config=dict(fold=True))
    ref = sage_attention_reference(q, k, v, causal=True, sm_scale=0.125, **_blocks(64))
    assert accuracy_metrics(out, ref)["cos_sim"] > 0.99999
    assert accuracy_metrics(out, exact_attention(q, k, v, causal=True, sm_scale=0.125))["cos_sim"] > 0.999


@pytest.mark.cuda
@pytest.mark.parametrize("D", [64, 128])
def test_cuda_default_and_plain_paths_match_reference(D):
    """The GPU default (folded exponent, ex2.approx.ftz inline PTX) and the plain-tl path the interpreter
    runs, both against the reference at real sizes (odd length, GQA, causal)."""
    from thrifty.attention.attn_kernel import sage_forward_triton
    q, k, v = _inputs(1, 8, 2, 1333, 1333, D, dtype=torch.bfloat16)
    ref = sage_attention_reference(q, k, v, causal=True, **_blocks(D))
    for cfg in (dict(), dict(fold=False, ftz=False), dict(fold=False, ftz=False, fast_cvt=False, reverse=False)):
        out = sage_forward_triton(q, k, v, causal=True, sm_scale=D ** -0.5, config=cfg)
        assert accuracy_metrics(out, ref)["cos_sim"] > 0.99999, cfg


@pytest.mark.cuda
def test_cuda_fast_launch_matches_triton_launch(monkeypatch):
    """FastLauncher's cached direct launches (second and later calls) give the same result, bit for bit, as
    Triton's own launch path (THRIFTY_FAST_LAUNCH=0), for new data and a bshd view."""
    from thrifty.attention import attn_kernel, quant_kernel
    from thrifty.attention.attn_kernel import sage_forward_triton
    from thrifty.triton_utils import fast_launch_enabled
    assert fast_launch_enabled(), "fast launches are off on the GPU without THRIFTY_FAST_LAUNCH=0 or a hook"
    launchers = (attn_kernel._FWD_LAUNCH, quant_kernel._STATS_LAUNCH, quant_kernel._QUANT_LAUNCH)
    for launcher in launchers:
        launcher.cache.clear()
    for layout in ("bhsd", "bshd"):
        for seed in range(3):
            q, k, v = _inputs(2, 4, 2, 300, 300, 64, dtype=torch.bfloat16, seed=seed)
            if layout == "bshd":
                q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
            sage_forward_triton(q, k, v, causal=True, sm_scale=0.125)
            out = sage_forward_triton(q, k, v, causal=True, sm_scale=0.125)
            monkeypatch.setenv("THRIFTY_FAST_LAUNCH", "0")
            slow = sage_forward_triton(q, k, v, causal=True, sm_scale=0.125)
            monkeypatch.delenv("THRIFTY_FAST_LAUNCH")
            assert torch.equal(out, slow) and out.stride() == q.stride()
    for launcher in launchers:
        assert launcher.cache, "the direct-launch path was never taken"


@pytest.mark.parametrize("programs", [512, 2])  # one step per program / every step of a head in one program
@pytest.mark.parametrize("S", [77, 16, 5])
def test_kv_statistics_against_float64(monkeypatch, programs, S):
    """The pre-pass's K mean, V mean and per-channel V scale (over ragged token chunks) vs float64."""
    from thrifty.attention import quant_kernel
    monkeypatch.setitem(quant_kernel.STATS_CONFIG, "programs", programs)
    _, k, v = _inputs(2, 1, 3, 1, S, 64, seed=S)
    kv = quant_kernel.quantize_kv(k, v, qmax=127.0, block_n=16, smooth_k=True, fp8_v=True, smooth_v=True)
    k64, v64 = k.double().flatten(0, 1), v.double().flatten(0, 1)
    center = v64.mean(1)
    amax = (v64 - center[:, None]).abs().amax(1)
    for got, want in ((kv["stats"][0], k64.mean(1)), (kv["stats"][2], center), (kv["stats"][1], amax / 448.0)):
        assert torch.allclose(got.double().cpu(), want.cpu(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ NaN rule
NAN_CASES = [  # B, H, Hkv, Sq, Sk, causal, qk_bits, return_lse
    (1, 2, 2, 40, 40, True, 8, True),
    (2, 4, 2, 37, 53, False, 8, False),  # GQA, odd lengths
    (1, 4, 1, 21, 70, True, 4, True),    # queries are the last positions; 4-bit (Q smoothing in the kernel)
    (1, 2, 1, 45, 19, True, 8, False),   # more queries than keys
]


@pytest.mark.parametrize("B,H,Hkv,Sq,Sk,causal,qk_bits,return_lse", NAN_CASES)
def test_kernel_nan_rows_are_exactly_the_rule_without_a_host_guard(monkeypatch, B, H, Hkv, Sq, Sk, causal,
                                                                    qk_bits, return_lse):
    """The kernels find the non-finite rows themselves (K/V in the quantization pass, Q in the attention
    kernel): NaN exactly where reference.nonfinite_rows says, and the other rows equal to a run on inputs with
    those elements zeroed. The host guard must not run on this path (it cost up to 3x at short lengths)."""
    from thrifty.attention import sage
    from thrifty.kv.reference import nonfinite_rows

    monkeypatch.setattr(sage, "nonfinite_rows", lambda *a: pytest.fail("host NaN guard ran on the kernel path"))
    g = torch.Generator().manual_seed(Sq * 31 + Sk)
    for trial in range(2):
        q, k, v = _inputs(B, H, Hkv, Sq, Sk, 64, seed=trial)
        clean = [x.clone() for x in (q, k, v)]
        for x in (q, k, v):  # a few NaN/±inf at random places
            for _ in range(2):
                idx = tuple(int(torch.randint(n, (1,), generator=g)) for n in x.shape)
                x[idx] = (float("nan"), float("inf"), float("-inf"))[int(torch.randint(3, (1,), generator=g))]
        for x, c in zip((q, k, v), clean):
            c[~torch.isfinite(x)] = 0.0
        kw = dict(causal=causal, impl="triton", config=SageConfig(qk_bits=qk_bits), return_lse=return_lse)
        got, want = sage_attention(q, k, v, **kw), sage_attention(*clean, **kw)
        out, lse = got if return_lse else (got, None)
        ref_out = want[0] if return_lse else want
        bad = nonfinite_rows(q.cpu(), k.cpu(), v.cpu(), causal).to(out.device)
        assert torch.equal(out.isnan().all(-1), bad) and not out[~bad].isnan().any()
        assert torch.equal(out[~bad], ref_out[~bad])
        if return_lse:
            assert torch.equal(lse.isnan(), bad) and torch.equal(lse[~bad], want[1][~bad])


def test_prefill_goes_to_gluon_only_where_measured_faster():
    from thrifty.attention.routing import (GLUON_HEAD_DIMS, GLUON_MIN_QUERIES, GLUON_MIN_QUERIES_CAUSAL,
                                           prefill_goes_to_gluon)

    for D in GLUON_HEAD_DIMS:  # head_dim 64 on its 128x128 tiles, 128 in the ping-pong order when causal
        for causal, least in ((False, GLUON_MIN_QUERIES[D]), (True, GLUON_MIN_QUERIES_CAUSAL[D])):
            assert prefill_goes_to_gluon(D, least, causal, (9, 0))
            assert prefill_goes_to_gluon(D, 4 * least, causal, (9, 0))
            assert not prefill_goes_to_gluon(D, least - 1, causal, (9, 0))  # the Triton kernel wins at 2K (-4K)
            assert not prefill_goes_to_gluon(D, 4 * least, causal, (8, 0))  # no Hopper, no Gluon kernel
            assert not prefill_goes_to_gluon(D, 4 * least, causal, (10, 0))
    for causal in (False, True):  # no Gluon kernel (nor a threshold) for other head dims
        assert not prefill_goes_to_gluon(96, 1 << 20, causal, (9, 0))
    assert GLUON_MIN_QUERIES_CAUSAL[64] > GLUON_MIN_QUERIES[64]  # causal at head_dim 64: the kernel alone ties at 8K


@pytest.mark.cuda
def test_cuda_auto_prefill_runs_gluon_where_routed(monkeypatch):
    """impl="auto" on sm_90: a long head_dim-128 or head_dim-64 prefill runs the Gluon kernel (and agrees with the
    Triton kernel); a short one runs the Triton kernel."""
    from thrifty.attention import attn_kernel, gluon_kernel
    from thrifty.attention.routing import GLUON_MIN_QUERIES_CAUSAL

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is sm_90 only")
    calls = []
    real_gluon, real_triton = gluon_kernel.sage_forward_gluon, attn_kernel.sage_forward_triton
    monkeypatch.setattr(gluon_kernel, "sage_forward_gluon", lambda *a, **kw: calls.append("gluon") or real_gluon(*a, **kw))
    monkeypatch.setattr(attn_kernel, "sage_forward_triton", lambda *a, **kw: calls.append("triton") or real_triton(*a, **kw))
    torch.manual_seed(0)
    S = max(GLUON_MIN_QUERIES_CAUSAL.values()) + 37  # odd length, routed at both head dims
    q = torch.randn(1, 4, S, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = sage_attention(q, k, v, causal=True)
    assert calls == ["gluon"]
    ref = sage_attention(q, k, v, causal=True, impl="triton")
    assert accuracy_metrics(out, ref)["cos_sim"] > 0.99999
    calls.clear()
    q64, k64, v64 = (x[..., :64].contiguous() for x in (q, k, v))
    out64 = sage_attention(q64, k64, v64, causal=True)
    assert calls == ["gluon"]
    # 128-key tiles sum 128 P̃·V products per fp32 add (the Triton kernel 64 at this head_dim): cos 0.99997+ on the H200
    ref64 = sage_attention(q64, k64, v64, causal=True, impl="triton")
    assert accuracy_metrics(out64, ref64)["cos_sim"] > 0.9999
    calls.clear()
    sage_attention(q[:, :, :2048], k[:, :, :2048], v[:, :, :2048], causal=True)
    sage_attention(q64[:, :, :2048], k64[:, :, :2048], v64[:, :, :2048], causal=True)
    assert calls == ["triton", "triton"]


def test_small_prefill_work_goes_to_sdpa_only_under_auto():
    from thrifty.attention.routing import HF_MIN_PREFILL_WORK, attention_work, small_prefill_goes_to_sdpa

    assert attention_work(1, 1, 3, 3, 1, causal=False) == 9
    assert attention_work(1, 1, 3, 3, 1, causal=True) == 6  # 1 + 2 + 3 keys under the mask
    assert attention_work(1, 1, 2, 5, 1, causal=True) == 4 + 5  # the last 2 of 5 positions
    assert attention_work(2, 8, 4, 4, 64, causal=False) == 2 * 8 * 16 * 64
    smol_8k = (1, 9, 8192, 8192, 64, True)  # SmolLM2-135M at 8K: measured 0.70x SDPA through the kernel
    llama_1b_8k = (1, 32, 8192, 8192, 64, True)  # measured 1.00x
    assert small_prefill_goes_to_sdpa("auto", *smol_8k)
    assert not small_prefill_goes_to_sdpa("auto", *llama_1b_8k)
    assert not small_prefill_goes_to_sdpa("triton", *smol_8k)  # an explicit impl is obeyed
    assert attention_work(*smol_8k) < HF_MIN_PREFILL_WORK <= attention_work(*llama_1b_8k)


@pytest.mark.cuda
def test_cuda_hf_small_prefill_takes_transformers_sdpa(monkeypatch):
    """In a transformers model on CUDA with impl="auto", a prefill call with little attention work runs
    transformers' SDPA (the quantized path's host time would not be hidden); above the work threshold, or with
    an explicit impl, sage_attention runs."""
    from test_attention import _tiny_hf_llama

    from thrifty.attention import enable_hf, hf as hf_module, routing
    from thrifty.attention.hf import routes

    model = _tiny_hf_llama("sdpa").eval().to("cuda", torch.bfloat16)
    ids = torch.randint(0, 128, (2, 100), device="cuda")
    calls = []
    real = hf_module.sage_attention
    monkeypatch.setattr(hf_module, "sage_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    enable_hf(model)
    with torch.no_grad():
        model(ids)
        assert not calls and routes(model) == {"sdpa": model.config.num_hidden_layers}
        monkeypatch.setattr(routing, "HF_MIN_PREFILL_WORK", 0)
        model(ids)
        assert len(calls) == model.config.num_hidden_layers
        monkeypatch.undo()
        monkeypatch.setattr(hf_module, "sage_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
        enable_hf(model, impl="reference")
        model(ids)
        assert len(calls) == 2 * model.config.num_hidden_layers
