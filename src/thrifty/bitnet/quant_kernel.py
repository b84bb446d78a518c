"""Fused activation quantizers (Triton): per-token statistic, round, clip and rescale in one pass over the row.

One program quantizes one token: it loads the row once into registers, reduces the statistic (max|x| for INT8,
mean|x| for INT4, the k-th largest |x| for TopK), and writes the fake-quantized row in the input dtype: one read
and one write of the activations, where the plain PyTorch quantizer makes ~6-8 passes (abs, reduce, divide,
round, clamp, multiply, the STE subtract/add). The backward of the straight-through estimator is the identity, so
it needs no kernel at all: :class:`FusedQuantizeSTE` hands the incoming gradient back untouched.

TopK without sorting: the threshold is the k-th largest |x|. Non-negative fp32 values order like their int32 bit
patterns, so the threshold is built bit by bit from the top (31 steps of "are there ≥ k entries with bits ≥
candidate?"): exact, deterministic, on the row already in registers. Entries tied at the threshold are kept in
index order (a prefix sum) until exactly k are kept, as the reference does.

Rounding is half to even, as ``torch.round``: adding and subtracting 1.5·2^23 rounds an fp32 of magnitude < 2^22 to
an integer in the current (nearest-even) mode; the values are clipped to the code range before, so they are small.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .reference import EPS, SQRT7, topk_count

KINDS = {"int8": 0, "int4": 1, "topk_int8": 2}
MAX_ROW = {"int8": 32768, "int4": 32768, "topk_int8": 16384}  # row held in registers; longer rows: reference
ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23


@triton.jit
def _round_half_even(v):
    return (v + ROUND_MAGIC) - ROUND_MAGIC


@triton.jit
def _div_rn(numerator, denominator):
    """Correctly rounded fp32 division (Triton's ``/`` is ``div.full.f32``, 2 ulp): the per-token scale then equals
    the reference's bit for bit, and no code moves across a rounding half because of it."""
    return tl.math.div_rn(tl.full([], numerator, tl.float32), denominator)


@triton.jit
def _quantize_rows_kernel(x_ptr, y_ptr, D, stride_x, stride_y, k_keep, beta_scale,
                          KIND: tl.constexpr, BLOCK_D: tl.constexpr, EPS_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    mag = tl.abs(x)
    # NaN or ±inf: the whole token is NaN, as in the reference (not left to the NaN rules of min/max on the GPU)
    has_nan = tl.sum(((mag != mag) | (mag == float("inf"))).to(tl.int32), axis=0) > 0
    if KIND == 1:  # INT4 absmean: (β/√7)·RoundClip(√7·x/(β+ε), −8, 7)
        beta = tl.math.div_rn(tl.sum(mag, axis=0), tl.sum(inside.to(tl.float32), axis=0)) * beta_scale
        q = _round_half_even(tl.minimum(tl.maximum(x * _div_rn(2.6457513110645907, beta + EPS_), -8.0), 7.0))
        y = q * tl.math.div_rn(beta, tl.full([], 2.6457513110645907, tl.float32))
    else:
        if KIND == 2:  # TopK: keep |x| >= the k-th largest |x|, found on the bit patterns
            bits = tl.where(inside, mag.to(tl.int32, bitcast=True), -1)
            threshold = tl.full([], 0, tl.int32)
            for b in tl.static_range(30, -1, -1):
                candidate = threshold | (1 << b)
                enough = tl.sum((bits >= candidate).to(tl.int32), axis=0) >= k_keep
                threshold = tl.where(enough, candidate, threshold)
            # exactly k kept: all above the threshold, then the tied entries in index order
            tied = bits == threshold
            room = k_keep - tl.sum((bits > threshold).to(tl.int32), axis=0)
            keep = (bits > threshold) | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= room))
            x = tl.where(keep, x, 0.0)
        # INT8 absmax: (γ/127)·RoundClip(127·x/(γ+ε), −128, 127)
        gamma = tl.max(tl.abs(x), axis=0)
        q = _round_half_even(tl.minimum(tl.maximum(x * _div_rn(127.0, gamma + EPS_), -128.0), 127.0))
        y = q * tl.math.div_rn(gamma, tl.full([], 127.0, tl.float32))
    y = tl.where(has_nan, float("nan"), y)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=inside)


def supports(kind: str, dim: int) -> bool:
    """True when the fused kernel handles quantizer ``kind`` on rows of ``dim`` features."""
    return kind in KINDS and dim <= MAX_ROW[kind]


def quantize_rows(x: torch.Tensor, kind: str, *, beta_scale: float = 1.0, topk_ratio: float = 0.5) -> torch.Tensor:
    """Fake-quantizes ``x`` (..., D) per token with the fused kernel; same values as the reference quantizer."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {list(KINDS)}, got {kind!r}")
    D = x.shape[-1]
    if D == 0 or x.numel() == 0:  # nothing to quantize (and reshape(-1, 0) is ambiguous)
        return x.clone()
    if D > MAX_ROW[kind]:
        raise ValueError(f"x: rows of {D} features exceed the fused {kind} kernel's {MAX_ROW[kind]}")
    rows = x.reshape(-1, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], D), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(D)
        _quantize_rows_kernel[(rows.shape[0],)](
            rows, out, D, rows.stride(0), out.stride(0), topk_count(D, topk_ratio), float(beta_scale),
            KIND=KINDS[kind], BLOCK_D=block, EPS_=EPS, num_warps=min(16, max(1, block // 256)))
    return out.view(x.shape)


class FusedQuantizeSTE(torch.autograd.Function):
    """Forward: the fused quantizer. Backward: the straight-through estimator, i.e. the gradient as it came."""

    @staticmethod
    def forward(ctx, x, kind, beta_scale, topk_ratio):
        return quantize_rows(x, kind, beta_scale=beta_scale, topk_ratio=topk_ratio)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


assert math.isclose(SQRT7, 2.6457513110645907)  # the kernel spells √7 as a literal (constexpr arithmetic)
