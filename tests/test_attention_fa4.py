"""FlashAttention-4's two options of the Gluon kernel, on the CPU: the FMA-pipe 2^x (``attention/exp2_poly.py``)
against float64 2^x over the whole range the kernel feeds it, exact zeros below −127, and that the kernel takes
its coefficients from that one definition; the reference's emulation of conditional rescaling and of the
polynomial columns (what the GPU tests compare the kernel with); ``gluon_config`` validation."""

import math

import pytest
import torch

from thrifty.attention import accuracy_metrics, exact_attention, sage_attention, sage_attention_reference
from thrifty.attention import exp2_poly as E


def test_exp2_poly_relative_error_on_normal_results():
    x = torch.cat([torch.linspace(-126.0, 12.0, 400_001), torch.arange(-126, 13).float(),  # integers: f = 0
                   torch.arange(-126, 12).float() + 1 - 2.0 ** -20])  # f just below 1
    got = E.exp2_poly(x).double()
    want = torch.exp2(x.double())
    rel = ((got - want) / want).abs().max().item()
    assert rel <= E.EXP2_POLY_MAX_REL_ERR, rel
    assert rel > 1e-6  # it is the polynomial, not exp2


def test_exp2_poly_underflow_is_zero_not_garbage():
    x = torch.tensor([-127.0, -127.5, -128.0, -149.0, -150.0, -1e4, -3e38, float("-inf"), float("nan")])
    got = E.exp2_poly(x)
    assert torch.equal(got, torch.zeros_like(got)) and not torch.signbit(got).any()
    # (−127, −126): a subnormal below 2^−126, never negative, never larger
    tail = E.exp2_poly(torch.linspace(-127.0, -126.0, 10_001)[1:-1])
    assert (tail >= 0).all() and (tail < 2.0 ** -126).all()
    # over [−150, 0] as a whole: relative error where 2^x is normal, absolute < 2^−126 below
    x = torch.linspace(-150.0, 0.0, 300_001)
    got, want = E.exp2_poly(x).double(), torch.exp2(x.double())
    normal = x >= -126
    assert (((got - want) / want).abs()[normal]).max() <= E.EXP2_POLY_MAX_REL_ERR
    assert ((got - want).abs()[~normal]).max() < 2.0 ** -126


def test_exp2_poly_is_monotone_enough_for_a_row_max():
    """p stays ≤ 448 at x = log2 448 (the largest exponent the kernel feeds it): no e4m3 saturation."""
    x = torch.tensor([math.log2(448.0)])
    assert E.exp2_poly(x).item() <= 448.0 * (1 + E.EXP2_POLY_MAX_REL_ERR)
    assert E.exp2_poly(torch.tensor([0.0])).item() == 1.0


def test_gluon_kernel_uses_the_same_coefficients():
    G = pytest.importorskip("thrifty.attention.gluon_kernel")
    assert tuple(c.value for c in G.EXP2_C) == E.EXP2_POLY
    assert G.EXP2_CLAMP_C.value == E.EXP2_CLAMP


def _inputs(Sq, Sk, D, seed=0, Hkv=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, Sq, D, generator=g) * 1.5
    k = torch.randn(1, Hkv, Sk, D, generator=g) * 1.5 + 4.0 * torch.randn(D, generator=g)
    v = torch.randn(1, Hkv, Sk, D, generator=g)
    return q, k, v


def _slow_growth(D, Sq=300, Sk=2500, seed=1):
    """As tests/test_attention_gluon.py: one channel of q at 4, that channel of k a ramp (≈ 8 log2 units)."""
    q, k, v = _inputs(Sq, Sk, D, seed)
    q[..., 0] = 4.0
    k[..., 0] = torch.arange(Sk) * (8.0 / (4.0 * D ** -0.5 * 1.4426950408889634) / Sk)
    return q, k, v


def _cos(a, b):
    return accuracy_metrics(a.float(), b.float())["cos_sim"]


@pytest.mark.parametrize("causal", [False, True])
def test_reference_threshold_zero_is_exact(causal):
    """τ = 0 skips only tiles where no row's max grew: bit-identical to rescaling every tile."""
    q, k, v = _inputs(333, 1111, 64)
    base, lse = sage_attention_reference(q, k, v, causal=causal, block_n=64, return_lse=True)
    out, lse0 = sage_attention_reference(q, k, v, causal=causal, block_n=64, rescale_threshold=0.0, return_lse=True)
    assert torch.equal(out, base) and torch.equal(lse, lse0)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_stale_max_on_a_slowly_growing_max(causal):
    """The slow-growth inputs make τ = 3 keep stale maxima (the result differs from rescaling every tile) and a
    growth past τ still rescales (P̃ stays ≤ 448: no e4m3 saturation, so fp32 attention is matched)."""
    from thrifty.attention.reference import _stale_max
    q, k, v = _slow_growth(64)
    kw = dict(causal=causal, block_n=64, block_m=64)
    always = sage_attention_reference(q, k, v, **kw)
    stale, lse3 = sage_attention_reference(q, k, v, rescale_threshold=3.0, return_lse=True, **kw)
    assert not torch.equal(stale, always)
    exact = exact_attention(q, k, v, causal=causal, dtype=torch.float32)
    assert _cos(stale, exact) > 0.999 and _cos(always, exact) > 0.999
    _, lse = sage_attention_reference(q, k, v, return_lse=True, **kw)
    assert (lse3 - lse).abs().max() < 1e-3
    # _stale_max: one decision per group of rows
    m = torch.tensor([0.0, 0.0, 0.0, 0.0]).view(1, 1, 4, 1)
    m_new = torch.tensor([1.0, 3.5, 0.5, 2.0]).view(1, 1, 4, 1)
    got = _stale_max(m, m_new, 3.0, 2).flatten().tolist()
    assert got == [1.0, 3.5, 0.0, 0.0]


@pytest.mark.parametrize("causal", [False, True])
def test_reference_polynomial_columns(causal):
    """exp2_poly_cols: within the polynomial's error of torch.exp2 (cos > 0.99999, the GPU tests' tolerance),
    and large score ranges (q ×40: exponents far below −127) stay finite."""
    q, k, v = _inputs(257, 777, 128)
    kw = dict(causal=causal, block_n=128)
    for scale in (1.0, 40.0):
        base = sage_attention_reference(q * scale, k, v, **kw)
        for cols in (16, 32, 128):
            out = sage_attention_reference(q * scale, k, v, exp2_poly_cols=cols, **kw)
            assert torch.isfinite(out).all()
            assert _cos(out, base) > 0.99999, (scale, cols)


@pytest.mark.parametrize("config, error, match", [
    (dict(exp2_poly=0.3), ValueError, "exp2_poly"),
    (dict(exp2_poly=-0.125), ValueError, "exp2_poly"),
    (dict(exp2_poly="1/4"), TypeError, "exp2_poly"),
    (dict(exp2_poly=True), TypeError, "exp2_poly"),
    (dict(rescale_threshold=9.0), ValueError, "rescale_threshold"),
    (dict(rescale_threshold=-1), ValueError, "rescale_threshold"),
    (dict(rescale_threshold=float("nan")), ValueError, "rescale_threshold"),
    (dict(rescale_threshold="3"), TypeError, "rescale_threshold"),
    (dict(exp2_poli=0.25), ValueError, "exp2_poli"),
    ([("exp2_poly", 0.25)], TypeError, "gluon_config"),
])
def test_gluon_config_is_checked_by_name(config, error, match):
    pytest.importorskip("triton.experimental.gluon")
    x = torch.zeros(1, 1, 32, 64)
    with pytest.raises(error, match=match):
        sage_attention(x, x, x, impl="gluon", gluon_config=config)


def test_gluon_config_needs_impl_gluon_and_accepts_good_values():
    G = pytest.importorskip("thrifty.attention.gluon_kernel")
    x = torch.zeros(1, 1, 32, 64)
    with pytest.raises(ValueError, match="gluon_config.*impl='gluon'"):
        sage_attention(x, x, x, impl="reference", gluon_config=dict(exp2_poly=0.25))
    cfg = G.resolve_config(64, dict(exp2_poly=0.25, rescale_threshold=3))
    fa4 = G.fa4_constexprs(cfg)
    assert fa4["POLY_COLS"] == 16 and fa4["RESCALE"] and fa4["P_SCALE"] == 56.0
    assert fa4["LOG2_P_SCALE"] == pytest.approx(math.log2(56.0))
    default = G.fa4_constexprs(G.resolve_config(128))
    assert default == dict(LOG2_P_SCALE=G.LOG2_FP8_MAX, P_SCALE=448.0, POLY_COLS=0, RESCALE=False,
                           RESCALE_THRESHOLD=0.0)
    assert G.fa4_constexprs(G.resolve_config(128, dict(exp2_poly=0.125)))["POLY_COLS"] == 16
