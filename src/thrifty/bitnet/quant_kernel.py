"""Fused BitLinear kernels (Triton): the input path (sub-norm + quantizer, one pass) and the ternary weight.

**Input** (:func:`quantize_rows`, :class:`FusedQuantizeSTE`): one program per token loads the row once into
registers, applies the optional sub-layer RMSNorm with its weight (exactly as ``BitLinear`` computes it: the
normalized row cast to the input dtype, times the weight, cast to the input dtype again), reduces the statistic
(max|x| for INT8, mean|x| for INT4, the k-th largest |x| for TopK), and writes the fake-quantized row directly
in the dtype the matmul consumes (bf16 under autocast, which is the value autocast's cast would give). One read,
one write; the per-token 1/RMS is kept for the backward. Backward: the straight-through estimator is the
identity, so without a norm the incoming gradient goes back as it came; with a norm one kernel computes the
RMSNorm backward (one read of x and of the gradient, one write of dx, per-program partial sums of dw).

**TopK without sorting**: the threshold is the k-th largest |x|. Non-negative floats order like their bit
patterns. bf16 and fp16 rows (what autocast feeds the a4.8 attention-output input) go to :mod:`.topk_kernel`:
two 15-bit keys per int32 word, a bisection step costs four integer ops per two entries (see there). fp32 rows
stay here: the search runs on the 31-bit keys, 31 steps, each one "are there ≥ k keys ≥ candidate?" over the row
in registers (a compare, an add and one row reduction; no memory traffic). Entries tied at the threshold are
kept in index order (a prefix sum) until exactly k are kept, as the reference does; the prefix sum runs only for
rows that have such ties. γ is max|x| of the whole row: the largest entry is always kept.

**Weight** (:func:`ternary_weight`): ``α = ‖W‖₁ / n`` per (sub-)matrix (one reduction), then one kernel reads
the fp32 latent weight and writes ``α·RoundClip(W/(α+ε), −1, 1)`` in the matmul dtype.

Rounding is half to even, as ``torch.round``: adding and subtracting 1.5·2^23 rounds an fp32 of magnitude < 2^22 to
an integer in the current (nearest-even) mode; the values are clipped to the code range before, so they are small.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from ..triton_utils import FastLauncher
from . import topk_kernel
from .kernel_math import as_float as _as_float, cast_rn as _cast, div_rn as _div_rn
from .kernel_math import COMPILED, pow2, quant_round, quant_scales, round_half_even as _round_half_even
from .kernel_math import subnorm, subnorm_rstd
from .reference import EPS, SQRT7, topk_count

KINDS = {"int8": 0, "int4": 1, "topk_int8": 2}
MAX_ROW = {"int8": 32768, "int4": 32768, "topk_int8": 16384}  # row held in registers; longer rows: reference
# (KEY_SHIFT, KEY_BITS) of the |x| keys TopK searches: the fp32 bit pattern without the low bits a 16-bit input
# leaves zero, and without the sign
KEYS = {torch.float32: (0, 31), torch.bfloat16: (16, 15), torch.float16: (13, 18)}
NORM_BACKWARD_ROWS = 32  # rows per program of the norm backward: dw partials are 1/32 of the rows
WEIGHT_BLOCK = 4096
FP32_INF_BITS = tl.constexpr(0x7F800000)


def _num_warps(block: int) -> int:
    """16 fp32 elements per thread: rows up to 512 stay in one warp (reductions are shuffles, no barrier)."""
    return max(1, min(16, block // 512))


@triton.jit
def _topk_keep(keys, inside, k_keep, D, KEY_BITS: tl.constexpr):
    """Mask of exactly ``k_keep`` entries: the keys above the k-th largest, then the tied ones in index order."""
    keys = tl.where(inside, keys, -1)
    threshold = tl.full([], 0, tl.int32)
    count = D  # how many keys are >= threshold (all of them at 0)
    for b in tl.static_range(KEY_BITS - 1, -1, -1):
        candidate = threshold | (1 << b)
        n = tl.sum((keys >= candidate).to(tl.int32), axis=0)
        enough = n >= k_keep
        threshold = tl.where(enough, candidate, threshold)
        count = tl.where(enough, n, count)
    keep = keys >= threshold
    if count > k_keep:  # more entries tied at the threshold than there is room for: the first ones
        tied = keys == threshold
        room = k_keep - (count - tl.sum(tied.to(tl.int32), axis=0))
        keep = (keys > threshold) | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= room))
    return keep


@triton.jit
def _quantize_rows_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, D, stride_x, stride_y, k_keep, beta_scale, norm_eps,
                          KIND: tl.constexpr, HAS_NORM: tl.constexpr, KEY_SHIFT: tl.constexpr,
                          KEY_BITS: tl.constexpr, BLOCK_D: tl.constexpr, EPS_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    x_in = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    x = x_in.to(tl.float32)
    if HAS_NORM:  # BitLinear's sub-norm: weight · (x / RMS(x)) in the input dtype, as RMSNorm + .to(x.dtype)
        rstd = subnorm_rstd(tl.sum(x * x, axis=0), D, norm_eps)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        x = subnorm(x, x_in.dtype, rstd, w, COMPILED)
        tl.store(rstd_ptr + row, rstd)
    # |x| as bits: NaN and ±inf are the patterns >= inf's, so one max finds γ and the bad tokens together
    bits = tl.where(inside, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
    top = tl.max(bits, axis=0)
    if KIND == 1:  # INT4 absmean: (β/√7)·RoundClip(√7·x/(β+ε), −8, 7)
        multiplier, step = quant_scales(top, tl.sum(bits.to(tl.float32, bitcast=True), axis=0), D, beta_scale,
                                        KIND, EPS_, COMPILED)
    else:
        if KIND == 2:  # TopK: zero all but the k largest |x|
            x = tl.where(_topk_keep(bits >> KEY_SHIFT, inside, k_keep, D, KEY_BITS), x, 0.0)
        # INT8 absmax: (γ/127)·RoundClip(127·x/(γ+ε), −128, 127)
        multiplier, step = quant_scales(top, 0.0, D, beta_scale, KIND, EPS_, COMPILED)
    y = quant_round(x, multiplier, KIND) * step
    y = tl.where(top >= FP32_INF_BITS, float("nan"), y)
    tl.store(y_ptr + row * stride_y + cols, _cast(y, y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _norm_backward_kernel(x_ptr, g_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, D, stride_x, stride_g,
                          stride_dx, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """RMSNorm backward for ``ROWS`` rows: dx = r·(g·w − x̂·mean(g·w·x̂)), x̂ = x·r; dw summed over the rows."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        valid = row < n_rows
        mask = inside & valid
        row64 = row.to(tl.int64)
        x_in = tl.load(x_ptr + row64 * stride_x + cols, mask=mask, other=0.0)
        g = tl.load(g_ptr + row64 * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row64, mask=valid, other=0.0)
        xhat = x_in.to(tl.float32) * rstd
        dw += g * _cast(xhat, x_in.dtype).to(tl.float32)  # the weight multiplied the normalized row in the input dtype
        gw = g * w
        c = tl.math.div_rn(tl.sum(gw * xhat, axis=0), _as_float(D))
        tl.store(dx_ptr + row64 * stride_dx + cols, _cast(rstd * (gw - xhat * c), dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_part_ptr + pid.to(tl.int64) * D + cols, dw, mask=inside)


@triton.jit
def _ternary_kernel(w_ptr, l1_ptr, out_ptr, n, BLOCK: tl.constexpr, EPS_: tl.constexpr):
    """α = ‖W‖₁ / n (the division here, correctly rounded as PyTorch's ``l1 / n``: one launch less per weight),
    then α·RoundClip(W/(α+ε), −1, 1)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    w = tl.load(w_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    alpha = tl.math.div_rn(tl.load(l1_ptr), _as_float(n))
    q = _round_half_even(tl.minimum(tl.maximum(w * _div_rn(1.0, alpha + EPS_), -1.0), 1.0))
    tl.store(out_ptr + offs, _cast(alpha * q, out_ptr.dtype.element_ty), mask=inside)


# --------------------------------------------------------------------------------------------- launchers

# Direct launches of the compiled kernels (thrifty.triton_utils.FastLauncher): Triton's own launch path binds
# and specializes every argument on each call (~30 µs measured on the H100 box), and a BitNet training step
# makes ~80 of these launches (30m preset: 24 input quantizers, 42 ternary weights, 12 norm backwards).
# num_stages=3 is Triton's default on CUDA: the compiled kernels are the ones Triton's path built.
_QUANTIZE_LAUNCH = FastLauncher(_quantize_rows_kernel)
_NORM_BACKWARD_LAUNCH = FastLauncher(_norm_backward_kernel)
_TERNARY_LAUNCH = FastLauncher(_ternary_kernel)


def _cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` in plain Python (also a constexpr_function in Triton 3.6)."""
    return -(-a // b)


def supports(kind: str, dim: int) -> bool:
    """True when the fused kernel handles quantizer ``kind`` on rows of ``dim`` features."""
    return kind in KINDS and dim <= MAX_ROW[kind]


def _check(x: torch.Tensor, kind: str, norm_weight: Optional[torch.Tensor]) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {list(KINDS)}, got {kind!r}")
    if x.dtype not in KEYS:
        raise TypeError(f"x: expected a float32, bfloat16 or float16 tensor, got {x.dtype}")
    if x.shape[-1] > MAX_ROW[kind]:
        raise ValueError(f"x: rows of {x.shape[-1]} features exceed the fused {kind} kernel's {MAX_ROW[kind]}")
    if norm_weight is not None and tuple(norm_weight.shape) != (x.shape[-1],):
        raise ValueError(f"norm_weight: expected shape ({x.shape[-1]},), got {tuple(norm_weight.shape)}")


def _launch(x, kind, beta_scale, topk_ratio, norm_weight, norm_eps, out_dtype):
    """(quantized rows in ``out_dtype`` with x's shape, per-row 1/RMS or None)."""
    D = x.shape[-1]
    rows = x.reshape(math.prod(x.shape[:-1]), D)  # not (-1, D): ambiguous when D == 0
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], D), dtype=out_dtype, device=x.device)
    rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device) if norm_weight is not None else None
    if rows.shape[0] and D and kind == "topk_int8" and x.dtype in topk_kernel.BAD_KEY:  # 16-bit rows
        topk_kernel.launch(rows, out, norm_weight, rstd, topk_count(D, topk_ratio), norm_eps, EPS)
    elif rows.shape[0] and D:
        block = pow2(D)
        shift, key_bits = KEYS[x.dtype]
        _QUANTIZE_LAUNCH(
            (rows.shape[0],), rows, norm_weight if norm_weight is not None else rows, out,
            rstd if rstd is not None else out, D, rows.stride(0), out.stride(0), topk_count(D, topk_ratio),
            float(beta_scale), float(norm_eps), KIND=KINDS[kind], HAS_NORM=norm_weight is not None,
            KEY_SHIFT=shift, KEY_BITS=key_bits, BLOCK_D=block, EPS_=EPS, num_warps=_num_warps(block),
            num_stages=3)
    return out.view(x.shape), rstd


def quantize_rows(x: torch.Tensor, kind: str, *, beta_scale: float = 1.0, topk_ratio: float = 0.5,
                  norm_weight: Optional[torch.Tensor] = None, norm_eps: float = 1e-5,
                  out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Fake-quantizes ``x`` (..., D) per token with the fused kernel (values of the reference quantizer); with
    ``norm_weight``, of ``RMSNorm(x)`` first. ``out_dtype`` (default x's) is the dtype written."""
    _check(x, kind, norm_weight)
    return _launch(x, kind, beta_scale, topk_ratio, norm_weight, norm_eps, out_dtype or x.dtype)[0]


def norm_backward(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad: torch.Tensor):
    """(dx, dweight) of ``weight · RMSNorm(x)`` given the forward's per-row 1/RMS and the output gradient."""
    D = x.shape[-1]
    xr = x.reshape(math.prod(x.shape[:-1]), D).contiguous()
    g = grad.reshape(xr.shape).contiguous()
    dx = torch.empty_like(xr)
    n = xr.shape[0]
    programs = _cdiv(n, NORM_BACKWARD_ROWS)
    parts = torch.empty((max(programs, 1), D), dtype=torch.float32, device=x.device)
    if programs:
        block = pow2(D)
        _NORM_BACKWARD_LAUNCH((programs,), xr, g, weight, rstd, dx, parts, n, D, xr.stride(0), g.stride(0),
                              dx.stride(0), ROWS=NORM_BACKWARD_ROWS, BLOCK_D=block, num_warps=_num_warps(block),
                              num_stages=3)
    else:
        parts.zero_()
    return dx.view(x.shape), parts.sum(0).to(weight.dtype)


class FusedQuantizeSTE(torch.autograd.Function):
    """Forward: sub-norm (optional) and quantizer in one kernel. Backward: the straight-through estimator (the
    gradient as it came), through the RMSNorm's backward when there is a norm."""

    @staticmethod
    def forward(ctx, x, norm_weight, kind, beta_scale, topk_ratio, norm_eps, out_dtype):
        _check(x, kind, norm_weight)
        y, rstd = _launch(x, kind, beta_scale, topk_ratio, norm_weight, norm_eps, out_dtype or x.dtype)
        ctx.x_dtype = x.dtype
        if norm_weight is not None:
            ctx.save_for_backward(x, norm_weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        if not ctx.saved_tensors:
            return grad.to(ctx.x_dtype), None, None, None, None, None, None
        x, weight, rstd = ctx.saved_tensors
        dx, dw = norm_backward(x, weight, rstd, grad)
        return dx, (dw if ctx.needs_input_grad[1] else None), None, None, None, None, None


def ternary_weight(w: torch.Tensor, splits: Optional[Sequence[int]] = None,
                   out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Absmean ternary fake-quantization of a (out, in) weight (the reference's values, α summed in another
    order), written in ``out_dtype`` (default w's): one reduction (‖W‖₁) and one kernel per (sub-)matrix."""
    w = w.contiguous()
    out = torch.empty(w.shape, dtype=out_dtype or w.dtype, device=w.device)
    if not splits:  # the common case, one matrix: no split views, no slicing of the output
        if w.numel():
            l1 = torch.linalg.vector_norm(w, 1, dtype=torch.float32)
            _TERNARY_LAUNCH((_cdiv(w.numel(), WEIGHT_BLOCK),), w, l1, out, w.numel(), BLOCK=WEIGHT_BLOCK,
                            EPS_=EPS, num_warps=8, num_stages=3)
        return out
    row = 0
    for part in w.split(list(splits), dim=0):
        n = part.numel()
        if n:
            l1 = torch.linalg.vector_norm(part, 1, dtype=torch.float32)
            _TERNARY_LAUNCH((_cdiv(n, WEIGHT_BLOCK),), part, l1, out[row:row + part.shape[0]], n,
                            BLOCK=WEIGHT_BLOCK, EPS_=EPS, num_warps=8, num_stages=3)
        row += part.shape[0]
    return out


class TernaryWeightSTE(torch.autograd.Function):
    """Forward: :func:`ternary_weight`. Backward: the straight-through estimator, in the latent weight's dtype."""

    @staticmethod
    def forward(ctx, w, splits, out_dtype):
        ctx.w_dtype = w.dtype
        return ternary_weight(w.detach(), splits, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.w_dtype), None, None


assert math.isclose(SQRT7, 2.6457513110645907)  # the kernel spells √7 as a literal (constexpr arithmetic)
