"""Pre-kernels of the Triton path: smoothing and quantization of Q, K and V into the layouts the attention
kernel reads without masks or transposes.

* Q → int8 [B·H, S_pad, D], one fp32 scale per token (per-token is free in Triton: the kernel multiplies
  scores by a per-row vector either way), with ``sm_scale·log2e`` folded into the scale so that
  dequantization and the softmax scale are one multiply.
* K → mean subtracted (smoothing), int8 [B·Hkv, S_pad, D], one scale per ``block_n`` keys (one scalar per
  KV tile in the kernel).
* V → optional mean subtracted, FP8 e4m3 with one scale per channel (or 16-bit, scale 1), stored
  transposed [B·Hkv, D, S_pad]: on Hopper an 8-bit MMA needs its B operand K-major, i.e. tokens contiguous.

Padding rows are written as zeros, so padded keys score 0 before the kernel masks them.
Inputs may be any strided view (B, H, S, D): the (B, S, H, D) layout is a transposed view, never a copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import interpreting

LOG2E = 1.4426950408889634
FP8_MAX = 448.0


@triton.jit
def to_e4m3(x, PRE_ROUND: tl.constexpr):
    """fp32 → fp8 e4m3. The interpreter's conversion drops the carry when rounding up crosses a power of two
    (124.2 → 64 instead of 128), so under the interpreter ``x`` is first rounded in fp32 to 3 mantissa bits
    (round to nearest even) and the conversion is then exact. On the GPU the hardware converts (RTNE)."""
    if PRE_ROUND:
        xi = x.to(tl.int32, bitcast=True)
        xi = (xi + 0x7FFFF + ((xi >> 20) & 1)) & -1048576  # -1048576 == 0xFFF00000: keep 3 mantissa bits
        x = xi.to(tl.float32, bitcast=True)
    return x.to(tl.float8e4nv)


@triton.jit
def _quantize_rows_kernel(x_ptr, mean_ptr, out_ptr, scale_ptr,
                          H, S, S_pad, stride_b, stride_h, stride_s, stride_d, extra_scale,
                          QMAX: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                          PER_ROW: tl.constexpr, HAS_MEAN: tl.constexpr):
    """One program quantizes BLOCK rows of one (b, h): symmetric, scale per row or per block."""
    pid_s, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    rows = pid_s * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    in_range = rows[:, None] < S
    x = tl.load(x_ptr + b * stride_b + h * stride_h + rows[:, None] * stride_s + cols[None, :] * stride_d,
                mask=in_range, other=0.0).to(tl.float32)
    if HAS_MEAN:
        x = tl.where(in_range, x - tl.load(mean_ptr + pid_bh * D + cols)[None, :], 0.0)
    if PER_ROW:
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.maximum(amax / QMAX, 1e-12)
        xq = x / scale[:, None]
        tl.store(scale_ptr + pid_bh * S_pad + rows, scale * extra_scale)
    else:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        scale = tl.maximum(amax / QMAX, 1e-12)
        xq = x / scale
        tl.store(scale_ptr + pid_bh * tl.cdiv(S_pad, BLOCK) + pid_s, scale * extra_scale)
    xq = tl.where(xq >= 0, xq + 0.5, xq - 0.5).to(tl.int8)  # round half away from zero, then truncate
    tl.store(out_ptr + (pid_bh * S_pad + rows[:, None]) * D + cols[None, :], xq)


@triton.jit
def _kv_stats_kernel(k_ptr, v_ptr, k_mean_ptr, v_mean_ptr, v_scale_ptr, H, S,
                     k_sb, k_sh, k_ss, k_sd, v_sb, v_sh, v_ss, v_sd,
                     D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                     SMOOTH_K: tl.constexpr, SMOOTH_V: tl.constexpr, V_QMAX: tl.constexpr):
    """Per (b, h, channel block): K's mean over tokens, V's mean and its per-channel scale, in one pass."""
    pid_bh, pid_d = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    k_sum = tl.zeros((BLOCK_D,), tl.float32)
    v_sum = tl.zeros((BLOCK_D,), tl.float32)
    v_min = tl.full((BLOCK_D,), float("inf"), tl.float32)
    v_max = tl.full((BLOCK_D,), float("-inf"), tl.float32)
    for start in range(0, S, BLOCK_S):
        rows = start + tl.arange(0, BLOCK_S)
        ok = rows[:, None] < S
        if SMOOTH_K:
            k = tl.load(k_ptr + b * k_sb + h * k_sh + rows[:, None] * k_ss + cols[None, :] * k_sd, mask=ok, other=0.0)
            k_sum += tl.sum(k.to(tl.float32), axis=0)
        v = tl.load(v_ptr + b * v_sb + h * v_sh + rows[:, None] * v_ss + cols[None, :] * v_sd, mask=ok, other=0.0)
        v = v.to(tl.float32)
        v_sum += tl.sum(v, axis=0)
        v_min = tl.minimum(v_min, tl.min(tl.where(ok, v, float("inf")), axis=0))
        v_max = tl.maximum(v_max, tl.max(tl.where(ok, v, float("-inf")), axis=0))
    n = tl.maximum(S, 1).to(tl.float32)
    if SMOOTH_K:
        tl.store(k_mean_ptr + pid_bh * D + cols, k_sum / n)
    center = v_sum / n if SMOOTH_V else tl.zeros((BLOCK_D,), tl.float32)
    if SMOOTH_V:
        tl.store(v_mean_ptr + pid_bh * D + cols, center)
    amax = tl.maximum(v_max - center, center - v_min)  # max |v − center| over tokens
    tl.store(v_scale_ptr + pid_bh * D + cols, tl.maximum(amax / V_QMAX, 1e-12))


@triton.jit
def _quantize_kv_kernel(k_ptr, v_ptr, k_mean_ptr, v_mean_ptr, v_scale_ptr, k_out_ptr, k_scale_ptr, v_out_ptr,
                        H, S, S_pad, k_sb, k_sh, k_ss, k_sd, v_sb, v_sh, v_ss, v_sd, QMAX: tl.constexpr,
                        D: tl.constexpr, BLOCK: tl.constexpr, SMOOTH_K: tl.constexpr, SMOOTH_V: tl.constexpr,
                        V_FP8: tl.constexpr, PRE_ROUND: tl.constexpr):
    """One program: BLOCK keys of one (b, h): K smoothed and int8 with one scale; V scaled per channel, in
    e4m3 (or 16-bit), written transposed [D, S_pad]."""
    pid_s, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    rows = pid_s * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    ok = rows[:, None] < S
    k = tl.load(k_ptr + b * k_sb + h * k_sh + rows[:, None] * k_ss + cols[None, :] * k_sd, mask=ok, other=0.0)
    k = k.to(tl.float32)
    if SMOOTH_K:
        k = tl.where(ok, k - tl.load(k_mean_ptr + pid_bh * D + cols)[None, :], 0.0)
    scale = tl.maximum(tl.max(tl.max(tl.abs(k), axis=1), axis=0) / QMAX, 1e-12)
    kq = k / scale
    kq = tl.where(kq >= 0, kq + 0.5, kq - 0.5).to(tl.int8)  # round half away from zero, then truncate
    tl.store(k_out_ptr + (pid_bh * S_pad + rows[:, None]) * D + cols[None, :], kq)
    tl.store(k_scale_ptr + pid_bh * (S_pad // BLOCK) + pid_s, scale)

    v = tl.load(v_ptr + b * v_sb + h * v_sh + rows[:, None] * v_ss + cols[None, :] * v_sd, mask=ok, other=0.0)
    v = v.to(tl.float32)
    if SMOOTH_V:
        v = tl.where(ok, v - tl.load(v_mean_ptr + pid_bh * D + cols)[None, :], 0.0)
    if V_FP8:
        v = to_e4m3(v / tl.load(v_scale_ptr + pid_bh * D + cols)[None, :], PRE_ROUND)
    tl.store(v_out_ptr + (pid_bh * D + cols[None, :]) * S_pad + rows[:, None], v.to(v_out_ptr.dtype.element_ty))


def _pad(n: int, block: int) -> int:
    return triton.cdiv(max(n, 1), block) * block


def quantize_q(q: torch.Tensor, *, sm_scale: float, qmax: float, block_m: int):
    """(B, H, S, D) → int8 [B·H, S_pad, D] and fp32 per-token scales [B·H, S_pad] (× sm_scale·log2e)."""
    B, H, S, D = q.shape
    S_pad = _pad(S, block_m)
    out = torch.empty(B * H, S_pad, D, dtype=torch.int8, device=q.device)
    scale = torch.empty(B * H, S_pad, dtype=torch.float32, device=q.device)
    _quantize_rows_kernel[(S_pad // block_m, B * H)](
        q, q, out, scale, H, S, S_pad, *q.stride(), sm_scale * LOG2E,
        QMAX=qmax, D=D, BLOCK=block_m, PER_ROW=True, HAS_MEAN=False)
    return out, scale


def quantize_kv(k: torch.Tensor, v: torch.Tensor, *, qmax: float, block_n: int, smooth_k: bool, fp8_v: bool,
                smooth_v: bool) -> dict:
    """(B, Hkv, S, D) K and V → dict(k8 [B·Hkv, S_pad, D] int8, k_scale [B·Hkv, S_pad/block_n],
    k_mean [B, Hkv, 1, D] fp32 or None, vt [B·Hkv, D, S_pad] e4m3 (or v's dtype), v_scale [B·Hkv, D],
    v_mean [B·Hkv, D] or None). Two launches: statistics over tokens, then quantization."""
    B, H, S, D = k.shape
    S_pad = _pad(S, block_n)
    dev = k.device
    k_mean = torch.empty(B * H, D, dtype=torch.float32, device=dev) if smooth_k else None
    v_mean = torch.empty(B * H, D, dtype=torch.float32, device=dev) if smooth_v else None
    if fp8_v or smooth_v:
        v_scale = torch.empty(B * H, D, dtype=torch.float32, device=dev)
        block_d = min(D, 16)
        _kv_stats_kernel[(B * H, D // block_d)](
            k, v, k_mean if smooth_k else v_scale, v_mean if smooth_v else v_scale, v_scale, H, S,
            *k.stride(), *v.stride(), D=D, BLOCK_S=128, BLOCK_D=block_d, SMOOTH_K=smooth_k, SMOOTH_V=smooth_v,
            V_QMAX=FP8_MAX if fp8_v else 1.0)
        if not fp8_v:  # 16-bit V keeps scale 1 (the stats pass ran for the V mean only)
            v_scale.fill_(1.0)
    else:
        v_scale = torch.ones(B * H, D, dtype=torch.float32, device=dev)
        if smooth_k:
            k_mean.copy_(k.mean(dim=2, dtype=torch.float32).reshape(B * H, D))
    k8 = torch.empty(B * H, S_pad, D, dtype=torch.int8, device=dev)
    k_scale = torch.empty(B * H, S_pad // block_n, dtype=torch.float32, device=dev)
    vt = torch.empty(B * H, D, S_pad, dtype=torch.float8_e4m3fn if fp8_v else v.dtype, device=dev)
    _quantize_kv_kernel[(S_pad // block_n, B * H)](
        k, v, k_mean if smooth_k else v_scale, v_mean if smooth_v else v_scale, v_scale, k8, k_scale, vt,
        H, S, S_pad, *k.stride(), *v.stride(), QMAX=qmax, D=D, BLOCK=block_n, SMOOTH_K=smooth_k,
        SMOOTH_V=smooth_v, V_FP8=fp8_v, PRE_ROUND=interpreting())
    return dict(k8=k8, k_scale=k_scale, k_mean=k_mean.reshape(B, H, 1, D) if smooth_k else None, vt=vt,
                v_scale=v_scale, v_mean=v_mean)
