"""Arithmetic shared by the BitNet Triton kernels (``quant_kernel``, ``topk_kernel``, ``packed_kernel``): rounding
as ``torch.round`` and PyTorch's casts do it, so the kernels match ``reference.py`` bit for bit; the activation
quantizer's sub-norm, scales and codes (one copy for the training kernel, the codes kernel and the decode GEMV);
block sizes in plain Python."""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_utils import interpreting

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


# ------------------------------------------------------------------------------ the activation quantizer's math
# One copy for the training input kernel (quant_kernel._quantize_rows_kernel), the packed layer's codes kernel and
# the fused decode GEMV's prologue (packed_kernel): the sub-norm, the per-token multiplier and step of INT8 absmax
# / INT4-range absmean, and the rounding to codes. Every product that an add follows is spelled ``mul_rn`` (the
# compiled kernels would otherwise contract it into one FMA: one rounding where PyTorch rounds twice).

COMPILED = tl.constexpr(not interpreting())  # compiled (not interpreted) kernels: fixed at import, as the kernels
SQRT7_ = tl.constexpr(2.6457513110645907)
INT8_, INT4_ = tl.constexpr(0), tl.constexpr(1)  # the KIND codes of quant_kernel.KINDS (2, TopK, is INT8 of the kept)


@triton.jit
def mul_rn(a, b, COMPILED: tl.constexpr):
    """``a·b`` rounded to fp32 on its own when an add follows (as PyTorch computes it): a plain product followed by
    an add compiles to one FMA (Triton's enable_fp_fusion), ``mul.rn.f32`` is never contracted. PTX rather than
    libdevice's mul_rn, which Triton builds with flush-to-zero (PyTorch keeps subnormals). NumPy never contracts."""
    if COMPILED:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def cast_to(v, dtype: tl.constexpr, COMPILED: tl.constexpr):
    """fp32 ``v`` rounded to ``dtype`` to nearest even: the GPU's cvt.rn, or :func:`cast_rn` under the interpreter
    (same bits; NaN stays NaN in both)."""
    if COMPILED:
        return v.to(dtype)
    else:
        return cast_rn(v, dtype)


@triton.jit
def subnorm_rstd(sum_sq, D, norm_eps):
    """1/RMS of a row from Σx² (fp32): 1/√(Σx²/D + eps), each step correctly rounded."""
    return div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(sum_sq, as_float(D)) + norm_eps))


@triton.jit
def subnorm(x, x_dtype: tl.constexpr, rstd, w, COMPILED: tl.constexpr):
    """BitLinear's sub-norm of fp32 ``x`` (values of an ``x_dtype`` tensor): ``w·(x·rstd)`` with each product cast
    to ``x_dtype`` (RMSNorm(x).to(x.dtype)), returned in fp32."""
    return cast_to(cast_to(x * rstd, x_dtype, COMPILED).to(tl.float32) * w, x_dtype, COMPILED).to(tl.float32)


@triton.jit
def quant_scales(top, abs_sum, D, beta_scale, KIND: tl.constexpr, EPS_: tl.constexpr, COMPILED: tl.constexpr):
    """(multiplier, step) of a token: code = RoundClip(x·multiplier), value = code·step. ``top``: max |x| as int32
    bits (INT8; TopK's γ is the whole row's); ``abs_sum``: Σ|x| (INT4 range, β = beta_scale·mean|x|)."""
    if KIND == INT4_:
        # mean·beta_scale rounded on its own: ``beta + EPS_`` below would otherwise compile to one FMA
        beta = mul_rn(tl.math.div_rn(abs_sum, as_float(D)), beta_scale, COMPILED)
        return div_rn(SQRT7_, beta + EPS_), tl.math.div_rn(beta, tl.full([], SQRT7_, tl.float32))
    else:
        gamma = top.to(tl.float32, bitcast=True)
        return div_rn(127.0, gamma + EPS_), tl.math.div_rn(gamma, tl.full([], 127.0, tl.float32))


@triton.jit
def quant_round(x, multiplier, KIND: tl.constexpr):
    """RoundClip(x·multiplier) in fp32 (an integer value): [−8, 7] for the INT4 range, else [−128, 127]."""
    if KIND == INT4_:
        return round_half_even(tl.minimum(tl.maximum(x * multiplier, -8.0), 7.0))
    else:
        return round_half_even(tl.minimum(tl.maximum(x * multiplier, -128.0), 127.0))


@triton.jit
def quant_code(x, multiplier, KIND: tl.constexpr, COMPILED: tl.constexpr):
    """:func:`quant_round` as int32. Compiled: clamp, then one ``cvt.rni`` (round to nearest even, as the 1.5·2^23
    trick; a NaN cannot reach it, ``max.f32``/``min.f32`` return the other operand). Interpreted: the spelled-out
    rounding, NaN mapped to 0 (a token holding one has a NaN scale: its codes are never used)."""
    if COMPILED:
        if KIND == INT4_:
            v = tl.minimum(tl.maximum(x * multiplier, -8.0), 7.0)
        else:
            v = tl.minimum(tl.maximum(x * multiplier, -128.0), 127.0)
        return tl.inline_asm_elementwise("cvt.rni.s32.f32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=True,
                                         pack=1)
    else:
        q = quant_round(x, multiplier, KIND)
        return tl.where(q == q, q, 0.0).to(tl.int32)


def pow2(n: int) -> int:
    """``triton.next_power_of_2`` in plain Python: Triton 3.6's is a constexpr_function, ~10 µs per host call."""
    return 1 << (n - 1).bit_length() if n > 1 else 1
