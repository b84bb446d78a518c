"""The FMA-pipe 2^x of the Gluon kernel (``attention/exp2_poly.py``, FlashAttention-4's emulation), on the CPU:
accuracy against float64 2^x over the whole range the kernel feeds it, exact zeros below −127, and that the
kernel takes its coefficients from that one definition."""

import math

import torch

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
    import pytest
    G = pytest.importorskip("thrifty.attention.gluon_kernel")
    assert tuple(c.value for c in G.EXP2_C) == E.EXP2_POLY
    assert G.EXP2_CLAMP_C.value == E.EXP2_CLAMP
