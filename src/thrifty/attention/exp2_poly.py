"""2^x on the FMA pipe (FlashAttention-4's exp2 emulation): the constants the Gluon kernel uses and a PyTorch
mirror of its exact arithmetic, so the CPU can test what the GPU computes.

x = n + f with n = ⌊x⌋ (a round-down add of 1.5·2^23 puts n in the low bits of a float: one FADD instead of a
conversion, which would run on the same slow pipe as MUFU), f ∈ [0, 1); 2^f by a degree-3 polynomial in Horner
form (3 FMAs); 2^n by adding n to the exponent field of the bit pattern (one shift-add). x is first clamped to
≥ −127: there n = −127 and f = 0, the polynomial gives exactly 1.0 (its constant term), and adding −127 to the
exponent field of 1.0 gives the bit pattern 0, i.e. +0.0. So every x ≤ −127 (−inf included) gives exactly 0
without a select; x in (−127, −126) gives a subnormal below 2^−126 (absolute error < 2^−126; MUFU's
``ex2.approx.ftz`` flushes these to 0, e4m3 P̃ loses both).

Accuracy: the polynomial is FA4's minimax fit of 2^f on [0, 1) with the constant term pinned to 1; its
relative error is ≤ 8.8e-5 (≈ 2^−13.5) for every normal result. P̃ is rounded to e4m3 (3 mantissa bits, a
relative step of 2^−3..2^−4) right after, so 1e-4 moves a rounding only for values within 1e-4 of a rounding
boundary (~1e-3 of them), and the fp32 row sum l that also uses p is off by ≤ 8.8e-5 relative (≤ 1e-4 in the
LSE, whose tolerance is 1e-3). Degree 2 (≈ 1.7e-3) would put the LSE error near that tolerance; degree 4 buys
nothing e4m3 can keep and costs one more FMA per score.
Valid for x ≤ 127 (in the kernel x ≤ log2 448 ≈ 8.8).
"""

from __future__ import annotations

import torch

# 2^f ≈ C0 + C1·f + C2·f² + C3·f³ on [0, 1) (FlashAttention-4, flash_attn/cute/utils.py ex2_emulation).
EXP2_POLY = (1.0, 0.695146143436431884765625, 0.227564394474029541015625, 0.077119089663028717041015625)
EXP2_POLY_MAX_REL_ERR = 8.8e-5  # on normal results; checked by tests/test_attention_exp2_poly.py
EXP2_CLAMP = -127.0  # x ≤ this gives exactly +0.0 (see the module docstring)
ROUND_MAGIC = 12582912.0  # 1.5·2^23: x + it, rounded down, is ⌊x⌋ + it exactly for |x| < 2^22


def exp2_poly(x: torch.Tensor) -> torch.Tensor:
    """The kernel's software 2^x, step for step in float32 (PyTorch has no round-down add: ``floor`` gives the
    same n). Returns float32."""
    x = x.float()
    xc = torch.fmax(x, torch.full_like(x, EXP2_CLAMP))  # as the kernel's max.f32: NaN becomes −127, so 0
    n = torch.floor(xc)
    f = xc - n
    c0, c1, c2, c3 = EXP2_POLY
    p = ((c3 * f + c2) * f + c1) * f + c0
    bits = p.view(torch.int32) + (n.to(torch.int32) << 23)
    return bits.view(torch.float32)


__all__ = ["EXP2_POLY", "EXP2_POLY_MAX_REL_ERR", "EXP2_CLAMP", "ROUND_MAGIC", "exp2_poly"]
