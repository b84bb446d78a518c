"""qk_bits=4 is SageAttention2-4b: Q and K in the INT4 range with per-token scales, K smoothed, Q smoothed per
group of SMOOTH_Q_BLOCK (16) queries with ΔS = mean(q_group)·γ(K)ᵀ added back in fp32. The kernel (interpreter on CPU) against the reference and float64;
the public API's 4-bit mode against the reference's spelled-out options."""

import pytest
import torch

from thrifty.attention import SageConfig, accuracy_metrics, exact_attention, sage_attention, sage_attention_reference
from thrifty.attention.reference import K_GRANULARITY_4BIT
from thrifty.attention.sage import SMOOTH_Q_BLOCK
from thrifty.triton_utils import interpreting

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(B, H, Hkv, Sq, Sk, D, seed=0, q_bias=3.0, k_bias=4.0):
    """Q and K with per-channel offsets shared by all tokens, as real Q and K have (what smoothing removes)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Sq, D, generator=g) * 1.5 + q_bias * torch.randn(D, generator=g)
    k = torch.randn(B, Hkv, Sk, D, generator=g) * 1.5 + k_bias * torch.randn(D, generator=g)
    v = torch.randn(B, Hkv, Sk, D, generator=g)
    return [x.to(DEVICE) for x in (q, k, v)]


def cos(a, b):
    return accuracy_metrics(a, b)["cos_sim"]


def test_api_4bit_is_smoothed_q_and_k_with_delta_s():
    q, k, v = _inputs(1, 4, 2, 150, 150, 64)
    out = sage_attention(q.cpu(), k.cpu(), v.cpu(), causal=True, config=SageConfig(qk_bits=4))
    ref = sage_attention_reference(q.cpu(), k.cpu(), v.cpu(), causal=True, qk_format="int4", smooth_q=True,
                                   block_m=SMOOTH_Q_BLOCK, k_granularity=K_GRANULARITY_4BIT)
    assert torch.equal(out, ref)
    exact = exact_attention(q.cpu(), k.cpu(), v.cpu(), causal=True)
    no_q_smoothing = sage_attention(q.cpu(), k.cpu(), v.cpu(), causal=True,
                                    config=SageConfig(qk_bits=4, smooth_q=False))
    assert cos(out, exact) > cos(no_q_smoothing, exact) + 0.01 and cos(out, exact) > 0.98


def test_delta_s_makes_q_smoothing_exact_without_quantization():
    q, k, v = _inputs(2, 4, 2, 77, 90, 64)
    out, lse = sage_attention_reference(q, k, v, causal=True, qk_format="fp32", pv="fp32", smooth_q=True,
                                        block_m=SMOOTH_Q_BLOCK, return_lse=True)
    exact, exact_lse = exact_attention(q, k, v, causal=True, return_lse=True)
    assert (out - exact).abs().max() < 1e-5 and (lse - exact_lse).abs().max() < 1e-4


@pytest.mark.skipif(not (interpreting() or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("B,H,Hkv,Sq,Sk,D,causal,bits", [
    (1, 2, 1, 45, 70, 64, True, 4),     # GQA, odd lengths, causal with fewer queries than keys
    (2, 4, 2, 37, 53, 128, False, 4),   # head_dim 128, a ragged last query block
    (1, 2, 2, 70, 33, 64, True, 4),     # more queries than keys: first rows see nothing
    (1, 2, 1, 50, 50, 128, True, 8),    # Q smoothing in 8-bit mode too
])
def test_kernel_smooth_q_matches_reference_and_float64(B, H, Hkv, Sq, Sk, D, causal, bits):
    from thrifty.attention.attn_kernel import kernel_config, sage_forward_triton
    cfg = kernel_config(D, torch.device(DEVICE))
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, seed=Sq)
    fmt = "int4" if bits == 4 else "int8"
    out, lse = sage_forward_triton(q, k, v, causal=causal, sm_scale=D ** -0.5, qk_bits=bits, smooth_q=True,
                                   return_lse=True, config=dict(fold=False))
    ref, ref_lse = sage_attention_reference(q, k, v, causal=causal, qk_format=fmt, smooth_q=True, return_lse=True,
                                            block_m=SMOOTH_Q_BLOCK, block_n=cfg["block_n"],
                                            k_granularity=K_GRANULARITY_4BIT if bits == 4 else "block")
    if interpreting():
        # ΔS and the group means are summed in another order: fp32 rounding, which can move one P̃ element of a
        # row across an e4m3 rounding boundary (seen: 1 row of 90 at 2e-3; a flip moves that weight by one e4m3
        # step, up to 1/8 of it). Every other row agrees to fp32 rounding.
        row_err = (out - ref).abs().amax(-1)
        assert (row_err >= 1e-3).sum() <= max(1, row_err.numel() // 50) and row_err.max() < 1e-2
    else:
        assert cos(out, ref) > 0.9999
    finite = ref_lse.isfinite()
    assert torch.equal(finite, lse.isfinite()) and (lse - ref_lse)[finite].abs().max() < 1e-3
    exact = exact_attention(q, k, v, causal=causal)  # float64
    plain = sage_forward_triton(q, k, v, causal=causal, sm_scale=D ** -0.5, qk_bits=bits, smooth_q=False)
    rows = exact.abs().sum(-1) > 0
    assert cos(out[rows], exact[rows]) >= cos(plain[rows], exact[rows]) - 1e-4
    assert cos(out, exact) > (0.97 if bits == 4 else 0.999)


@pytest.mark.skipif(not (interpreting() or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1")
def test_api_4bit_runs_the_kernel_with_smoothing(monkeypatch):
    from thrifty.attention import attn_kernel
    seen = []
    real = attn_kernel.sage_forward_triton
    monkeypatch.setattr(attn_kernel, "sage_forward_triton", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    q, k, v = _inputs(1, 2, 2, 40, 40, 64)
    sage_attention(q, k, v, causal=True, impl="triton", config=SageConfig(qk_bits=4))
    assert seen and seen[0]["smooth_q"] is True and seen[0]["qk_bits"] == 4
