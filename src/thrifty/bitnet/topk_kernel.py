"""TopK + INT8 of 16-bit rows (bf16 / fp16, BitNet a4.8's attention-output input): two keys per 32-bit word.

The threshold is the k-th largest |x|. A 16-bit float's |x| orders like its 15-bit pattern, so two keys share one
int32 word ("pair": the row's entries 2i and 2i+1 in its low and high half). With bit 15 of each half set (a
guard), ``pair − (c·0x10001)`` leaves bit 15 of a half set exactly when that key is ≥ c, and no borrow crosses
the halves; ``(· >> 15) & 0x10001`` turns the two answers into two 16-bit counters that one integer add
accumulates. So a bisection step, "are there ≥ k keys ≥ candidate?", costs a subtract, a shift, an and and an
add per *two* entries, and the sum over the row (one warp: one REDUX, no barrier) of both counters at once. The
first 7 steps (key bits 14..8) run on the keys' high bytes, four per word with the sign bit as the guard: half
the cost again. 15 steps find the threshold on the row held in registers; memory is read and written once.

Ties: the entries equal to the threshold are kept in index order until exactly k are kept (``reference.
topk_mask``). Their ranks come from one prefix sum of the packed "tied" flags (both halves' running counts in
one word); it runs only for rows with more ties than room, which at bf16's 8-bit precision is most rows of a
few thousand features.

Layout: one warp per row up to 2048 features (32 words per lane), more warps beyond (a cross-warp sum per step);
two rows per one-warp program below 512 features (independent rows' reductions overlap). The width is a
constexpr: words that are padding in every lane (1536 features = 768 words in a 1024-word block) fold away.

Then INT8 absmax of what is kept, as ``quant_kernel`` (γ = max|x| is the top key: the largest entry is always
kept). fp32 inputs keep ``quant_kernel``'s search on 31-bit keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from ..triton_utils import FastLauncher, interpreting
from .kernel_math import as_float, cast_rn, div_rn, pow2, round_half_even

GUARDS = tl.constexpr(0x80008000)  # bit 15 of both halves
COUNTERS = tl.constexpr(0x00010001)  # bit 0 of both halves
KEY_BITS = 15  # |x| of a bf16 or fp16: the pattern without the sign
WORDS_PER_LANE = 32  # words a lane holds: 2048 features per warp (64, 4096 features, spilled ~250 B on sm_90)
# quads a lane holds in one column of a 64-quad-per-warp tiling: summing those first stays in the thread
LANE_QUAD_ROWS = tl.constexpr(WORDS_PER_LANE // 4)
ROWS_PER_WARP_FEATURES = 1024  # a one-warp program takes rows until it holds this many features
# (bad-key limit, the 16-bit dtype): a key >= the limit is ±inf or NaN, which makes the whole row NaN
BAD_KEY = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


@triton.jit
def _pair_keys(x_bits):
    """(ROWS, PAIRS, 2) int16 entries -> (ROWS, PAIRS) uint32 words: entry 2i in the low half, 2i+1 in the high."""
    lo, hi = tl.split(x_bits)
    return ((lo.to(tl.int32) & 0xFFFF) | (hi.to(tl.int32) << 16)).to(tl.uint32, bitcast=True)


@triton.jit
def _halves_at_least(guarded, c):
    """Per word, ``COUNTERS``-packed flags: bit 0 = low key >= c, bit 16 = high key >= c (c: one per row)."""
    return ((guarded - (c * 0x10001)[:, None]) >> 15) & COUNTERS


@triton.jit
def _total(packed):
    """Row sums of packed counters: both halves' counts added (each half's sum < 2^16: at most 8192 pairs)."""
    s = tl.sum(packed, axis=1)
    return ((s & 0xFFFF) + (s >> 16)).to(tl.int32)


@triton.jit
def _high_bytes(words):
    """The keys' high bytes (bits 14..8, and the sign bit as a guard: set), four per word, in any order: the 7-bit
    keys of the first bisection steps. Word pairs (2j, 2j + 1) give quad j."""
    a, b = tl.split(tl.reshape(words, (words.shape[0], words.shape[1] // 2, 2)))
    return ((a >> 8) & 0x00FF00FF) | (b & 0xFF00FF00) | 0x80808080


@triton.jit
def _byte_total(packed):
    """Row sums of byte counters (flags at bit 0 of each byte, one word per quad): first groups of at most
    ``LANE_QUAD_ROWS`` words (a lane's own, so in-thread adds; no byte passes 255) as bytes, then the partial
    sums as 16-bit counters."""
    groups: tl.constexpr = max(1, min(packed.shape[1] // 64, LANE_QUAD_ROWS))
    s = tl.sum(tl.reshape(packed, (packed.shape[0], groups, packed.shape[1] // groups)), axis=1)
    return _total((s & 0x00FF00FF) + ((s >> 8) & 0x00FF00FF))


@triton.jit
def _threshold(guarded, words, k_keep, D, KEY_BITS: tl.constexpr):
    """(the k-th largest key of each row, how many keys are >= it): bisection on the key bits, high to low; the
    7 high bits on four keys per word (a step costs half as much), the 8 low ones on two."""
    threshold = tl.zeros([guarded.shape[0]], dtype=tl.uint32)
    count = tl.zeros([guarded.shape[0]], dtype=tl.int32) + D  # every key is >= 0
    high = _high_bytes(words)
    for b in tl.static_range(KEY_BITS - 9, -1, -1):
        candidate = threshold | (1 << b)
        n = _byte_total(((high - (candidate * 0x01010101)[:, None]) >> 7) & 0x01010101)
        enough = n >= k_keep
        threshold = tl.where(enough, candidate, threshold)
        count = tl.where(enough, n, count)
    threshold = threshold << 8
    for b in tl.static_range(7, -1, -1):
        candidate = threshold | (1 << b)
        n = _total(_halves_at_least(guarded, candidate))
        enough = n >= k_keep
        threshold = tl.where(enough, candidate, threshold)
        count = tl.where(enough, n, count)
    return threshold, count


@triton.jit
def _keep_flags(guarded, threshold, count, k_keep):
    """``COUNTERS``-packed keep flags: keys above the threshold, then the tied ones in index order until k."""
    keep = _halves_at_least(guarded, threshold)
    if tl.max((count > k_keep).to(tl.int32), axis=0) > 0:  # some row has more keys at the threshold than room
        above = _halves_at_least(guarded, threshold + 1)
        tied = keep ^ above
        before = tl.cumsum(tied, axis=1) - tied  # tied keys in the words before, per half
        room = (k_keep - _total(above)).to(tl.uint32)  # >= 1: fewer than k keys are above the threshold
        # bit 31 of (tied keys before the low key − room) is set while there is room for the low key; for the high
        # key, count the low one too (both counts <= 8192: no wrap-around doubt)
        over = (before & 0xFFFF) + (before >> 16) - room[:, None]
        fits = (over >> 31) | (((over + (tied & 1)) >> 15) & 0x10000)
        keep = above | (tied & fits)
    return keep


@triton.jit
def _unpack(words, half: tl.constexpr, DTYPE: tl.constexpr):
    """fp32 values of the low (``half`` 0) or high 16-bit entries of ``words``."""
    bits = (words >> (16 * half)) & 0xFFFF
    if DTYPE == tl.bfloat16:
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _cast_to(v, dtype: tl.constexpr, COMPILED: tl.constexpr):
    """``v`` rounded to ``dtype`` to nearest even: the GPU's cvt.rn, or the interpreter-safe spelled-out one."""
    if COMPILED:
        return v.to(dtype)
    else:
        return cast_rn(v, dtype)


@triton.jit
def _mul_rn(a, b, COMPILED: tl.constexpr):
    """``a·b`` rounded to fp32 on its own: LLVM would contract a plain product followed by an add into one FMA
    (one rounding instead of the reference's two); ``mul.rn`` is never contracted. NumPy never contracts."""
    if COMPILED:
        return libdevice.mul_rn(a, b)
    else:
        return a * b


@triton.jit
def _int8_of(words, half: tl.constexpr, scale, step, DTYPE: tl.constexpr, COMPILED: tl.constexpr):
    """INT8 absmax of one half's entries: step·RoundClip(x·scale, −128, 127), scale = 127/(γ+ε)."""
    x = _unpack(words, half, DTYPE)
    # no clamp to [−128, 127]: |x| <= γ, so |x·scale| <= 127·(1 + 2^-23) rounds to at most 127
    return round_half_even(_mul_rn(x, scale[:, None], COMPILED)) * step[:, None]


@triton.jit
def _normed(x_in, w_ptr, rstd_ptr, rows, row_ok, cols, inside, D, norm_eps, COMPILED: tl.constexpr):
    """BitLinear's sub-norm in the input dtype (weight · (x / RMS(x)), each product cast as RMSNorm + .to(x.dtype)
    casts it); 1/RMS per row stored for the backward."""
    x = x_in.to(tl.float32)
    rstd = div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(tl.sum(x * x, axis=1), as_float(D)) + norm_eps))
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    normed = _cast_to(x * rstd[:, None], x_in.dtype, COMPILED).to(tl.float32) * w[None, :]
    return tl.where(inside, _cast_to(normed, x_in.dtype, COMPILED), 0.0)


@triton.jit
def _topk_int8_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, stride_x, stride_y, k_keep, norm_eps,
                      D: tl.constexpr, HAS_NORM: tl.constexpr, ROWS: tl.constexpr, PAIRS: tl.constexpr,
                      KEY_BITS: tl.constexpr, BAD: tl.constexpr, EPS_: tl.constexpr, COMPILED: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    rows = rows.to(tl.int64)
    # rows are loaded and stored as plain contiguous vectors (16-byte accesses), viewed as (PAIRS, 2) in registers
    cols = tl.arange(0, 2 * PAIRS)
    inside = (cols < D)[None, :] & row_ok[:, None]
    x_in = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=inside, other=0.0)
    if HAS_NORM:
        x_in = _normed(x_in, w_ptr, rstd_ptr, rows, row_ok, cols, inside, D, norm_eps, COMPILED)
    words = _pair_keys(tl.reshape(x_in.to(tl.int16, bitcast=True), (ROWS, PAIRS, 2)))
    keys = words & 0x7FFF7FFF
    top = tl.max(tl.maximum(keys & 0xFFFF, keys >> 16), axis=1)  # γ's key; padding is key 0
    guarded = words | GUARDS  # padding: key 0, below every candidate (>= 1)
    threshold, count = _threshold(guarded, words, k_keep, D, KEY_BITS)
    keep = _keep_flags(guarded, threshold, count, k_keep)
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    gamma = _unpack(top, 0, dtype)
    scale = div_rn(127.0, gamma + EPS_)
    # a row holding ±inf or NaN comes out all NaN: its step is NaN (q·NaN is NaN, also for q = 0)
    step = tl.where(top >= BAD, float("nan"), tl.math.div_rn(gamma, tl.full([], 127.0, tl.float32)))
    out_ty: tl.constexpr = y_ptr.dtype.element_ty
    kept = words & (keep * 0xFFFF)  # the entries not kept become +0 (flag bits 0 and 16 -> halves of ones)
    y = tl.join(_cast_to(_int8_of(kept, 0, scale, step, dtype, COMPILED), out_ty, COMPILED),
                _cast_to(_int8_of(kept, 1, scale, step, dtype, COMPILED), out_ty, COMPILED))
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], tl.reshape(y, (ROWS, 2 * PAIRS)), mask=inside)


_LAUNCH = FastLauncher(_topk_int8_kernel)
COMPILED = not interpreting()  # fixed at import, as the kernel's compile mode


def launch_config(D: int) -> dict:
    """(rows per program, words per row block, warps) for rows of ``D`` features: ≤ ``WORDS_PER_LANE`` words per
    lane (one warp per row up to 2048 features), rows grouped up to ~1024 features per one-warp program."""
    pairs = pow2(max(2, (D + 1) // 2))  # >= 2: a quad of high bytes takes two words
    warps = max(1, pairs // (32 * WORDS_PER_LANE))
    rows = max(1, ROWS_PER_WARP_FEATURES // (2 * pairs)) if warps == 1 else 1
    return {"ROWS": rows, "PAIRS": pairs, "num_warps": warps}


def launch(rows, out, norm_weight, rstd, k_keep: int, norm_eps: float, eps: float) -> None:
    """TopK + INT8 of the (n, D) 16-bit ``rows`` (unit column stride) into ``out``; with ``norm_weight``, of the
    sub-normed rows, 1/RMS per row into ``rstd``."""
    n, D = rows.shape
    cfg = launch_config(D)
    _LAUNCH(((n + cfg["ROWS"] - 1) // cfg["ROWS"],), rows, norm_weight if norm_weight is not None else rows, out,
            rstd if rstd is not None else out, n, rows.stride(0), out.stride(0), k_keep, float(norm_eps), D=D,
            HAS_NORM=norm_weight is not None, ROWS=cfg["ROWS"], PAIRS=cfg["PAIRS"], KEY_BITS=KEY_BITS,
            BAD=BAD_KEY[rows.dtype], EPS_=eps, COMPILED=COMPILED, num_warps=cfg["num_warps"], num_stages=3)
