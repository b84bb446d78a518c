"""Pre-kernels of the Triton path: smoothing and quantization of Q, K and V into the layouts the attention
kernel reads without masks or transposes.

* Q → int8 with one fp32 scale per token, inside the attention kernel (:func:`quantize_rows` on its Q tile):
  per-token is free in Triton (the kernel multiplies scores by a per-row vector either way), and doing it
  there saves a launch and a pass over Q.
* K → mean subtracted (smoothing), int8 [B·Hkv, S_pad, D], one scale per ``block_n`` keys (one scalar per
  KV tile in the kernel).
* V → optional mean subtracted, FP8 e4m3 with one scale per channel (or 16-bit, scale 1), stored
  transposed [B·Hkv, D, S_pad]: on Hopper an 8-bit MMA needs its B operand K-major, i.e. tokens contiguous.
  For the Gluon kernel (``v_perm16``) the tokens of each group of 16 are stored in the order the P̃·V
  ``wgmma`` reads P̃ from the Q·Kᵀ accumulator's registers (:func:`v_slot`, SageAttention2's V layout).

Padding rows are written as zeros, so padded keys score 0 before the kernel masks them.
Inputs may be any strided view (B, H, S, D): the (B, S, H, D) layout is a transposed view, never a copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import FastLauncher, cdiv, finite_or_zero, interpreting, launch_with

# The kernels here and in attn_kernel are jitted for the interpreter or the GPU when imported; the launch
# options that must match (PRE_ROUND, FTZ, tile sizes) follow the same import-time choice.
INTERPRET = interpreting()

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
def v_slot(r):
    """Column of token r in a ``v_perm16`` Vᵀ: within each 16 tokens, r = 8h + 2q + b goes to 4q + 2h + b.

    A thread holds the Q·Kᵀ accumulator's columns 8h + 2q + {0, 1} (q = lane % 4, per 8 columns), while an
    8-bit wgmma A operand in registers holds k = 4q + {0..3} (per 16): the Gluon kernel reads its e4m3 P̃ tile
    with those columns relabelled (reshape [.., 2, 4, 2] → permute → reshape, no data movement), so V's
    token r must sit in row (column of Vᵀ) 4q + 2h + b for the products to pair up."""
    return (r & -16) + ((r >> 1) & 3) * 4 + ((r >> 3) & 1) * 2 + (r & 1)


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def quantize_rows(x, QMAX: tl.constexpr):
    """fp32 rows → (int8 values, per-row scale): symmetric, round half away from zero. Used by the attention
    kernel on its Q tile (per-token Q scales cost nothing there, and no pre-pass launch is needed for Q).
    A row holding NaN/±inf gets a NaN/inf scale (the max keeps NaN: ``max.NaN``, same cost), which the
    attention kernel turns into a NaN output row: the NaN rule for Q without any extra work per element."""
    scale = tl.maximum(tl.reduce(tl.abs(x), 1, _max_keep_nan) / QMAX, 1e-12, propagate_nan=tl.PropagateNan.ALL)
    xq = x / scale[:, None]
    return tl.where(xq >= 0, xq + 0.5, xq - 0.5).to(tl.int8), scale


@triton.jit
def _kv_partial_stats_kernel(k_ptr, v_ptr, part_ptr, bad_ptr, H, S, chunk, n_split, plane,
                             k_sb, k_sh, k_ss, k_sd, v_sb, v_sh, v_ss, v_sd,
                             D: tl.constexpr, BLOCK_S: tl.constexpr, SMOOTH_K: tl.constexpr,
                             V_STATS: tl.constexpr):
    """Program (b·h, c): sums of K and V, min and max of V over tokens [c·chunk, (c+1)·chunk), per channel,
    into part[4, B·H, n_split, D]; and bad[B·H, n_split]: the chunk's first key whose K or V row holds a
    NaN/±inf, else S (the NaN rule of ``reference.nonfinite_rows`` at no extra pass: this kernel reads every
    K and V element anyway; an elementwise int32 minimum beside the sums, reduced once). Splitting the tokens keeps enough programs in flight at short lengths
    (one program per head would leave most SMs idle); the quantization kernel adds the partials up.
    The loop accumulates whole (BLOCK_S, D) tiles element-wise and reduces over tokens once at the end: a
    reduction across warps per step (v1 of this kernel) put a shared-memory round trip and a barrier between
    consecutive loads, and the kernel ran at half the copy bandwidth."""
    pid_bh, pid_c = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    cols = tl.arange(0, D)
    lo = pid_c * chunk
    hi = tl.minimum(lo + chunk, S)
    k_sum = tl.zeros((BLOCK_S, D), tl.float32)
    v_sum = tl.zeros((BLOCK_S, D), tl.float32)
    v_min = tl.full((BLOCK_S, D), float("inf"), tl.float32)
    v_max = tl.full((BLOCK_S, D), float("-inf"), tl.float32)
    first_bad = tl.full((BLOCK_S, D), S, tl.int32)
    k_tile = k_ptr + b * k_sb + h * k_sh + cols[None, :] * k_sd
    v_tile = v_ptr + b * v_sb + h * v_sh + cols[None, :] * v_sd
    for start in range(lo, hi, BLOCK_S):
        rows = start + tl.arange(0, BLOCK_S)
        ok = rows[:, None] < hi
        k = tl.load(k_tile + rows[:, None] * k_ss, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(v_tile + rows[:, None] * v_ss, mask=ok, other=0.0).to(tl.float32)
        finite = (tl.abs(k) < float("inf")) & (tl.abs(v) < float("inf"))
        first_bad = tl.minimum(first_bad, tl.where(finite, S, rows[:, None]))
        if SMOOTH_K:
            k_sum += finite_or_zero(k)
        if V_STATS:
            v = finite_or_zero(v)
            v_sum += v
            v_min = tl.minimum(v_min, tl.where(ok, v, float("inf")))
            v_max = tl.maximum(v_max, tl.where(ok, v, float("-inf")))
    tl.store(bad_ptr + pid_bh * n_split + pid_c, tl.min(tl.min(first_bad, axis=1), axis=0))
    out = part_ptr + (pid_bh * n_split + pid_c) * D + cols
    tl.store(out, tl.sum(k_sum, axis=0))
    tl.store(out + plane, tl.sum(v_sum, axis=0))
    tl.store(out + 2 * plane, tl.min(v_min, axis=0))
    tl.store(out + 3 * plane, tl.max(v_max, axis=0))


@triton.jit
def _quantize_kv_kernel(k_ptr, v_ptr, part_ptr, stats_ptr, k_out_ptr, k_scale_ptr, v_out_ptr,
                        H, S, S_pad, n_split, plane, k_sb, k_sh, k_ss, k_sd, v_sb, v_sh, v_ss, v_sd,
                        QMAX: tl.constexpr, V_QMAX: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                        SMOOTH_K: tl.constexpr, SMOOTH_V: tl.constexpr, V_FP8: tl.constexpr,
                        HAS_STATS: tl.constexpr, PRE_ROUND: tl.constexpr, V_PERM16: tl.constexpr,
                        K_PER_TOKEN: tl.constexpr):
    """One program: BLOCK keys of one (b, h). Adds up the partial statistics (a few KB, from L2), then K
    smoothed and int8 with one scale (K_PER_TOKEN: one per key); V scaled per channel, in e4m3 (or 16-bit), written transposed
    [D, S_pad]. Program 0 of each head also writes stats[3, B·H, D] = K mean, V scale, V mean for the
    attention kernel's epilogue and the LSE correction."""
    pid_s, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    rows = pid_s * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    ok = rows[:, None] < S
    k_mean = tl.zeros((D,), tl.float32)
    center = tl.zeros((D,), tl.float32)
    v_scale = tl.full((D,), 1.0, tl.float32)
    if HAS_STATS:
        k_sum = tl.zeros((D,), tl.float32)
        v_sum = tl.zeros((D,), tl.float32)
        v_min = tl.full((D,), float("inf"), tl.float32)
        v_max = tl.full((D,), float("-inf"), tl.float32)
        part = part_ptr + pid_bh * n_split * D + cols
        for c in range(n_split):
            k_sum += tl.load(part + c * D)
            v_sum += tl.load(part + plane + c * D)
            v_min = tl.minimum(v_min, tl.load(part + 2 * plane + c * D))
            v_max = tl.maximum(v_max, tl.load(part + 3 * plane + c * D))
        n = tl.maximum(S, 1).to(tl.float32)
        k_mean = k_sum / n
        if SMOOTH_V:
            center = v_sum / n
        if V_FP8:
            amax = tl.maximum(v_max - center, center - v_min)  # max |v − center| over tokens
            v_scale = tl.maximum(amax / V_QMAX, 1e-12)
    if pid_s == 0:
        tl.store(stats_ptr + pid_bh * D + cols, k_mean)
        tl.store(stats_ptr + (tl.num_programs(1) + pid_bh) * D + cols, v_scale)
        tl.store(stats_ptr + (2 * tl.num_programs(1) + pid_bh) * D + cols, center)

    k = tl.load(k_ptr + b * k_sb + h * k_sh + rows[:, None] * k_ss + cols[None, :] * k_sd, mask=ok, other=0.0)
    k = finite_or_zero(k.to(tl.float32))
    if SMOOTH_K:
        k = tl.where(ok, k - k_mean[None, :], 0.0)
    if K_PER_TOKEN:
        scale = tl.maximum(tl.max(tl.abs(k), axis=1) / QMAX, 1e-12)
        kq = k / scale[:, None]
    else:
        scale = tl.maximum(tl.max(tl.max(tl.abs(k), axis=1), axis=0) / QMAX, 1e-12)
        kq = k / scale
    kq = tl.where(kq >= 0, kq + 0.5, kq - 0.5).to(tl.int8)  # round half away from zero, then truncate
    tl.store(k_out_ptr + (pid_bh * S_pad + rows[:, None]) * D + cols[None, :], kq)
    if K_PER_TOKEN:
        tl.store(k_scale_ptr + pid_bh * S_pad + rows, scale)
    else:
        tl.store(k_scale_ptr + pid_bh * (S_pad // BLOCK) + pid_s, scale)

    v = tl.load(v_ptr + b * v_sb + h * v_sh + rows[:, None] * v_ss + cols[None, :] * v_sd, mask=ok, other=0.0)
    v = finite_or_zero(v.to(tl.float32))
    if SMOOTH_V:
        v = tl.where(ok, v - center[None, :], 0.0)
    if V_FP8:
        v = to_e4m3(v / v_scale[None, :], PRE_ROUND)
    v_rows = v_slot(rows) if V_PERM16 else rows  # a permutation inside each 16 tokens (BLOCK is a multiple)
    tl.store(v_out_ptr + (pid_bh * D + cols[None, :]) * S_pad + v_rows[:, None], v.to(v_out_ptr.dtype.element_ty))


_STATS_LAUNCH = FastLauncher(_kv_partial_stats_kernel)
# Statistics-pass launch shape on the GPU: token rows per step (4 fp32 (rows, D) accumulators live in
# registers), warps, and the number of programs to aim for (token chunks per head follow from it).
STATS_CONFIG = dict(block_s=16, num_warps=4, programs=512)  # H100 sweep: attention_prepass_h100.json
_QUANT_LAUNCH = FastLauncher(_quantize_kv_kernel)


MAX_SPLIT = 16  # partials per head: every quantize program sums them, the attention kernel reads their first_bad


def stats_split(S: int, BH: int, block_s: int, programs: int) -> tuple[int, int]:
    """(steps of ``block_s`` tokens per program, programs per head) for the statistics pass: enough programs
    to fill the SMs, at most 16 partials per head (every quantize program sums them all)."""
    n_blocks = cdiv(max(S, 1), block_s)
    per = cdiv(n_blocks, max(1, min(MAX_SPLIT, programs // BH)))
    return per, cdiv(n_blocks, per)


def _pad(n: int, block: int) -> int:
    return cdiv(max(n, 1), block) * block


def quantize_kv(k: torch.Tensor, v: torch.Tensor, *, qmax: float, block_n: int, smooth_k: bool, fp8_v: bool,
                smooth_v: bool, sig=None, v_perm16: bool = False, k_per_token: bool = False) -> dict:
    """(B, Hkv, S, D) K and V → dict(k8 [B·Hkv, S_pad, D] int8, k_scale [B·Hkv, S_pad/block_n] (``k_per_token``:
    [B·Hkv, S_pad], one scale per key),
    stats [3, B·Hkv, D] fp32 (K mean, V scale, V mean; zeros/ones where unused), vt [B·Hkv, D, S_pad] e4m3
    (or v's dtype; ``v_perm16``: tokens in :func:`v_slot` order within each 16), first_bad [B·Hkv, n_split]
    int32: per token chunk, the first key whose K or V row holds a NaN/±inf, else S; the attention kernel
    takes their minimum; v_perm16). Two launches: partial statistics over token chunks (always run: it also
    finds the non-finite keys), then quantization."""
    if v_perm16 and block_n % 16:
        raise ValueError(f"quantize_kv: v_perm16 permutes tokens within 16, block_n {block_n} is not a multiple")
    B, H, S, D = k.shape
    BH = B * H
    S_pad = _pad(S, block_n)
    dev = k.device
    has_stats = smooth_k or fp8_v or smooth_v
    stats = torch.empty(3, BH, D, dtype=torch.float32, device=dev)
    sc = STATS_CONFIG
    block_s = 16 if INTERPRET else sc["block_s"]
    per, n_split = stats_split(S, BH, block_s, sc["programs"])
    part = torch.empty(4, BH, n_split, D, dtype=torch.float32, device=dev)
    first_bad = torch.empty(BH, n_split, dtype=torch.int32, device=dev)
    launch_with(_STATS_LAUNCH, sig and (sig, sc["block_s"], sc["programs"], sc["num_warps"]), (BH, n_split),
        k, v, part, first_bad, H, S, per * block_s, n_split, BH * n_split * D, *k.stride(), *v.stride(),
        D=D, BLOCK_S=block_s, SMOOTH_K=smooth_k, V_STATS=fp8_v or smooth_v, num_warps=sc["num_warps"], num_stages=3)
    k8 = torch.empty(BH, S_pad, D, dtype=torch.int8, device=dev)
    k_scale = torch.empty(BH, S_pad if k_per_token else S_pad // block_n, dtype=torch.float32, device=dev)
    vt = torch.empty(BH, D, S_pad, dtype=torch.float8_e4m3fn if fp8_v else v.dtype, device=dev)
    launch_with(_QUANT_LAUNCH, sig and (sig, block_n, has_stats, v_perm16, k_per_token), (S_pad // block_n, BH),
        k, v, part, stats, k8, k_scale, vt, H, S, S_pad, n_split, BH * n_split * D, *k.stride(), *v.stride(),
        QMAX=qmax, V_QMAX=FP8_MAX, D=D, BLOCK=block_n, SMOOTH_K=smooth_k, SMOOTH_V=smooth_v, V_FP8=fp8_v,
        HAS_STATS=has_stats, PRE_ROUND=INTERPRET, V_PERM16=v_perm16, K_PER_TOKEN=k_per_token, num_warps=4,
        num_stages=3)
    return dict(k8=k8, k_scale=k_scale, stats=stats, vt=vt, first_bad=first_bad, v_perm16=v_perm16)


def unsmoothed_lse(lse: torch.Tensor, q: torch.Tensor, k_mean: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """The log-sum-exp of the unsmoothed scores from the kernel's (of scores against K − mean(K)): adds
    q·mean(K)·sm_scale back per query row. ``k_mean``: the pre-pass's per-(batch, KV head) mean, (B·H_kv, D)."""
    B, H, _, D = q.shape
    H_kv = k_mean.numel() // (B * D)
    k_mean_q = k_mean.reshape(B, H_kv, 1, D).repeat_interleave(H // H_kv, dim=1)
    return lse + (q.float() @ k_mean_q.transpose(-1, -2)).squeeze(-1) * sm_scale
