"""Arithmetic shared by the BitNet Triton kernels (``quant_kernel``, ``topk_kernel``): rounding as ``torch.round``
and PyTorch's casts do it, so the kernels match ``reference.py`` bit for bit; block sizes in plain Python."""

from __future__ import annotations

import triton
import triton.language as tl

ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23


@triton.jit
def round_half_even(v):
    """Adding and subtracting 1.5·2^23 rounds an fp32 of magnitude < 2^22 to an integer in the current
    (nearest-even) mode, as ``torch.round``."""
    return (v + ROUND_MAGIC) - ROUND_MAGIC


@triton.jit
def div_rn(numerator, denominator):
    """Correctly rounded fp32 division (Triton's ``/`` is ``div.full.f32``, 2 ulp): the per-token scale then equals
    the reference's bit for bit, and no code moves across a rounding half because of it."""
    return tl.math.div_rn(tl.full([], numerator, tl.float32), denominator)


@triton.jit
def cast_rn(v, dtype: tl.constexpr):
    """fp32 ``v`` rounded to ``dtype``, to nearest even. Spelled out for bf16 because the interpreter truncates
    (the GPU's cvt.rn gives the same bits); NaN stays NaN (the integer add would wrap its pattern)."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) & -65536).to(tl.float32, bitcast=True)
        return tl.where(v != v, v, rounded).to(tl.bfloat16)
    else:
        return v.to(dtype)


@triton.jit
def as_float(n):
    """An fp32 scalar tensor of ``n`` (also when Triton specialized n == 1 into a constant)."""
    return tl.full([], 0.0, tl.float32) + n


def pow2(n: int) -> int:
    """``triton.next_power_of_2`` in plain Python: Triton 3.6's is a constexpr_function, ~10 µs per host call."""
    return 1 << (n - 1).bit_length() if n > 1 else 1
