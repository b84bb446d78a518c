"""Landmark scoring, top-K selection and the reuse plan: the first stage of a ShadowKV decode step, three kernels
on one grid (sequence x KV head, splits of the chunk axis; ~4 programs per SM even at batch 1) and a short tail
kernel, one program per head.

1. ``_landmark_logits_kernel``: ``q . landmark * scale`` for the G query heads of the group (one tensor-core dot,
   rows padded to 16), the logits parked in an fp32 scratch (G x 4 bytes per chunk), and per split the running
   max and sum of the softmax. The landmarks (C x D x 2 bytes per head) are the bytes that matter. Program 0 of
   each head also zeroes the head's score histogram for kernel 2.
2. ``_score_hist_kernel``: merges the split statistics, turns its chunks' logits into softmax probabilities and
   writes their max over the group: the score of a chunk (-1 for chunks that cannot be selected: outliers,
   padding), exactly :func:`thrifty.kvcache.reference.landmark_scores`. Each score also goes into a histogram of
   ``bins`` (an atomic add): the first level of the top-K.
3. ``_mark_kernel``: every program reads the head's histogram (8 KB) and finds the bin ``top`` that holds the
   K-th largest score and how many of that bin are taken (``need``). Over its own chunks it marks those of the
   higher bins (taken for sure), lists the sure ones that are misses (no slot yet) and the chunks of bin ``top``
   (the candidates: ~1% of C on random data) in its own segment of a scratch, in chunk order, with their counts.
   Program 0 of a head also appends the new token's key/value to the generated rows of the attention buffer (row
   ``gen_base + n_generated``, a device counter).
4. ``_select_tail_kernel``, one program per head: the head's **tail** (``_tail``), which never walks C:
   * concatenates the segments into one chunk-ordered miss list and one candidate list (the offsets are the
     prefix sums of the per-program counts);
   * takes the ``need`` best candidates: up to ``SelectTuning.rank_block`` of them by each one's rank among
     them (a pairwise comparison in registers; batch 1 sees ~10-40), more by a radix select for the need-th
     largest key (passes of 9 bits with ``tl.histogram`` over the keys relative to the smallest; passes above the
     keys' spread are skipped, all of them when the candidates are all equal, e.g. the -1 padding picks of a
     short sequence). Ties go to the lowest chunk ids either way (``torch.topk`` leaves them unspecified); taken
     candidates are marked and their misses appended to the miss list;
   * the reuse plan: a chunk still selected keeps its slot (nothing moves), each newly selected chunk takes a
     slot whose chunk left the selection, in slot order, the misses in chunk order (sure ones first);
     ``work[slot]`` = the chunk to rebuild/fetch there, or -1. The maps ``slot_ids`` (slot -> chunk) and
     ``slot_of`` (chunk -> slot) are updated in place, so that a CUDA graph replay sees the previous step's plan.
     A slot whose new chunk is not selectable (a sequence with fewer selectable chunks than K) is marked invalid
     and never filled; a kept slot keeps its validity byte (selectability does not change).

Why: v2 ran the whole top-K in one program per head (8 programs on the GPU at batch 1, 6 walks over C: 138 us per
layer at 122K on the H200); v3 moved the histogram onto the wide grid but still walked C once per head, with
compaction, in that one program (83 us). Now every C-sized pass runs on ~4 programs per SM; the per-head tail
touches only the per-program counts, the ~K misses, the ~1% candidates and the K slots.

The tail ran inside the mark kernel's last-arriving program per head until the radix passes left it (one launch
fewer); measured since then, its own launch is 4-5 us per layer faster (H200, 510d149, NOTES.md).

Bins: ``(key(ref) - key(score)) >> shift``, clamped to [0, bins - 2], with ``ref`` the largest score any chunk of
the head can have (1/sum of the softmax); negative scores (-1) get the last bin. A bin is a function of the key
that never increases with it, so every chunk of a lower bin scores higher than every chunk of a higher one, and
chunks with equal scores share a bin: the selection is exact whatever ``ref`` holds. ``ref`` only sets the
resolution: with shift 18, 32 bins per octave over 64 octaves below the largest score. Keys are int32: the
order-preserving image of the fp32 score (negative floats flip their magnitude bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..triton_utils import mma, sm_count

# finite "minus infinity" for running maxima: exp(-inf - NEG) = 0, never nan. A tl.constexpr: the compiler
# refuses a plain module global inside @triton.jit code (the interpreter accepts one)
NEG = tl.constexpr(-1.0e30)
KEY_MAX = tl.constexpr(2147483647)
KEY_MIN = tl.constexpr(-2147483648)
PROGRAMS_PER_SM = 4
SCORE_WARPS = 4
MARK_WARPS = 4
TAIL_WARPS = 8


@dataclass(frozen=True)
class SelectTuning:
    """Block sizes of the select stage. The defaults are what the GPU runs; tests shrink them to cover the
    multi-block and coarse-bin paths at small sizes."""
    logit_block: int = 64  # chunks per iteration of the logits kernel (64 x 128 bf16 = 16 KB of landmarks)
    score_block: int = 256  # chunks per iteration of the score and mark kernels
    select_block: int = 1024  # candidates per iteration of the tail
    hist_bins: int = 2048  # bins of the first level (8 KB of int32 per head)
    hist_shift: int = 18  # key bits per bin: an octave is 2^23, so 32 bins per octave
    tail_tile: int = 1024  # elements of the tail's (splits x entries) tiles when it concatenates the segments
    rank_block: int = 128  # up to this many candidates are ranked pairwise; more go through the radix select

    def __post_init__(self):
        for name in ("logit_block", "score_block", "select_block", "hist_bins", "tail_tile"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"SelectTuning.{name} must be a power of two >= 16, got {v}")
        if self.rank_block < 1 or self.rank_block & (self.rank_block - 1):
            raise ValueError(f"SelectTuning.rank_block must be a power of two >= 1, got {self.rank_block}")
        if not 0 <= self.hist_shift <= 31:
            raise ValueError(f"SelectTuning.hist_shift must be in [0, 31], got {self.hist_shift}")

    def tail_cols(self, s_pad: int) -> int:
        """Entries per split in one tile of the tail's concatenation (the tile is s_pad x this)."""
        return max(1, self.tail_tile // s_pad)


TUNING = SelectTuning()


def target_programs(device: torch.device) -> int:
    return PROGRAMS_PER_SM * sm_count(device)


def logit_splits(rows: int, C: int, device: torch.device, block: int = TUNING.logit_block) -> tuple[int, int]:
    """(splits, chunks per split) of the logits, score and mark kernels: ~4 programs per SM, whole blocks per
    split."""
    blocks = triton.cdiv(C, block)
    splits = max(1, min(blocks, triton.cdiv(target_programs(device), rows)))
    span = triton.cdiv(blocks, splits) * block
    return triton.cdiv(C, span), span


@triton.jit
def _landmark_logits_kernel(q_ptr, lm_ptr, rad_ptr, sel_ptr, logit_ptr, part_m_ptr, part_l_ptr, hist_ptr, C, SPAN,
                            SPLITS, scale, rad_w, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                            BLOCK_C: tl.constexpr, NB: tl.constexpr, RADIUS: tl.constexpr):
    """``RADIUS``: the logit is (q.landmark + rad_w |q| r) * scale, r the chunk's fp32 radius (one per chunk)."""
    pid = tl.program_id(0)  # b * H + h
    sp = tl.program_id(1)
    if sp == 0:  # kernel 2 adds into it; its previous users (the last step's mark and tail kernels) have finished
        tl.store(hist_ptr + pid.to(tl.int64) * NB + tl.arange(0, NB), 0)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    live = g < G
    q = tl.load(q_ptr + (pid * G + g)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)  # HF order
    if RADIUS:
        qf = q.to(tl.float32)
        q_norm = tl.sqrt(tl.sum(qf * qf, 1)) * rad_w  # (G_PAD,)
    m = tl.full((G_PAD,), NEG, tl.float32)
    l = tl.zeros((G_PAD,), tl.float32)
    base = pid.to(tl.int64) * C
    logits = logit_ptr + pid.to(tl.int64) * G * C + g[:, None] * C
    lo = sp * SPAN
    hi = tl.minimum(lo + SPAN, C)
    for c0 in range(lo, hi, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        inb = cc < hi
        lm = tl.load(lm_ptr + (base + cc)[:, None] * D + d[None, :], mask=inb[:, None], other=0.0)
        sel = tl.load(sel_ptr + base + cc, mask=inb, other=0) != 0
        s = mma(q, tl.trans(lm), tl.zeros((G_PAD, BLOCK_C), tl.float32))
        if RADIUS:
            r = tl.load(rad_ptr + base + cc, mask=inb, other=0.0)
            s = s + q_norm[:, None] * r[None, :]
        s = s * scale
        s = tl.where(sel[None, :], s, float("-inf"))
        tl.store(logits + cc[None, :], s, mask=live[:, None] & inb[None, :])
        m_new = tl.maximum(m, tl.max(s, 1))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m = m_new
    out = (pid * SPLITS + sp) * G_PAD + g
    tl.store(part_m_ptr + out, m)
    tl.store(part_l_ptr + out, l)


@triton.jit
def _score_key(x):
    """fp32 -> int32 with the same order (negative floats flip their magnitude bits; -1.0 -> a negative key)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _key_bin(key, ref, NB: tl.constexpr, SHIFT: tl.constexpr):
    """First-level bin of a score key, 0 = highest. Never increases with the key (for any ``ref`` >= 0); every
    negative key (the -1 scores) in the last bin. ``ref - key`` stays in int32: both are in [0, 2^31)."""
    below = tl.minimum(tl.maximum((ref - tl.maximum(key, 0)) >> SHIFT, 0), NB - 2)
    return tl.where(key < 0, NB - 1, below).to(tl.int32)


@triton.jit
def _softmax_stats(part_m_ptr, part_l_ptr, row, SPLITS, G_PAD: tl.constexpr, G_P2: tl.constexpr,
                   S_PAD: tl.constexpr):
    """(max, 1/sum) of each query head's softmax, merged over the splits of the logits kernel."""
    s_ = tl.arange(0, S_PAD)
    g = tl.arange(0, G_P2)
    part = (row * SPLITS + s_)[:, None] * G_PAD + g[None, :]
    pm = tl.load(part_m_ptr + part, mask=(s_ < SPLITS)[:, None], other=NEG)
    pl = tl.load(part_l_ptr + part, mask=(s_ < SPLITS)[:, None], other=0.0)
    m = tl.max(pm, 0)
    inv_l = 1.0 / tl.maximum(tl.sum(pl * tl.exp(pm - m[None, :]), 0), 1e-30)
    return m, inv_l


@triton.jit
def _score_hist_kernel(logit_ptr, part_m_ptr, part_l_ptr, sel_ptr, score_ptr, hist_ptr, ref_ptr, C, SPAN, SPLITS,
                       G: tl.constexpr, G_PAD: tl.constexpr, G_P2: tl.constexpr, S_PAD: tl.constexpr,
                       NB: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # b * H + h
    sp = tl.program_id(1)
    row = pid.to(tl.int64)
    m, inv_l = _softmax_stats(part_m_ptr, part_l_ptr, row, SPLITS, G_PAD, G_P2, S_PAD)
    g = tl.arange(0, G_P2)
    live = g < G
    # no chunk scores above max_g 1/sum_g (its exp() is at most 1): the bins count down from there
    ref = _score_key(tl.max(tl.where(live & (inv_l == inv_l), inv_l, 0.0), 0))
    if sp == 0:  # every program computes the same ref; the mark kernel needs it to rebuild the bins
        tl.store(ref_ptr + row, ref)
    base = row * C
    logits = logit_ptr + row * G * C + g[:, None] * C
    lo = sp * SPAN
    hi = tl.minimum(lo + SPAN, C)
    for c0 in range(lo, hi, BLOCK):
        cc = c0 + tl.arange(0, BLOCK)
        inb = cc < hi
        x = tl.load(logits + cc[None, :], mask=live[:, None] & inb[None, :], other=float("-inf"))
        p = tl.exp(x - m[:, None]) * inv_l[:, None]
        p = tl.where(live[:, None] & (p == p), p, -1.0)  # a NaN query head decides no pick (as the reference)
        sel = tl.load(sel_ptr + base + cc, mask=inb, other=0) != 0
        score = tl.where(sel, tl.max(p, 0), -1.0)
        tl.store(score_ptr + base + cc, score, mask=inb)
        b = _key_bin(_score_key(score), ref, NB, SHIFT)
        tl.atomic_add(hist_ptr + row * NB + b, 1, mask=inb, sem="relaxed")  # order-free: the kernel end syncs


@triton.jit
def _append(list_ptr, count, values, keep):
    """Writes ``values[keep]`` at ``list_ptr[count:]`` in order; returns the new count."""
    k = keep.to(tl.int32)
    tl.store(list_ptr + count + tl.cumsum(k, 0) - k, values, mask=keep)
    return count + tl.sum(k, 0)


@triton.jit
def _append_token(knew_ptr, vnew_ptr, kbuf_ptr, vbuf_ptr, valid_ptr, ngen_ptr, row, N_TOTAL, GEN_BASE,
                  D: tl.constexpr):
    """The new token's key/value into row GEN_BASE + n_generated of the buffer, marked valid."""
    d = tl.arange(0, D)
    gen_row = row * N_TOTAL + GEN_BASE + tl.load(ngen_ptr)
    tl.store(kbuf_ptr + gen_row * D + d, tl.load(knew_ptr + row * D + d).to(kbuf_ptr.dtype.element_ty))
    tl.store(vbuf_ptr + gen_row * D + d, tl.load(vnew_ptr + row * D + d).to(vbuf_ptr.dtype.element_ty))
    tl.store(valid_ptr + gen_row, 1)


@triton.jit
def _threshold_bin(hist_ptr, row, K, NB: tl.constexpr):
    """(the bin holding the K-th largest score, how many of that bin are taken: >= 1). The histogram's total is
    C >= K."""
    bins = tl.arange(0, NB)
    hist = tl.load(hist_ptr + row * NB + bins)
    top = tl.min(tl.where(tl.cumsum(hist, 0) >= K, bins, NB - 1), 0)
    need = K - tl.sum(tl.where(bins < top, hist, 0), 0)
    return top, need


@triton.jit
def _mark_kernel(score_ptr, hist_ptr, ref_ptr, sel_ptr, mark_ptr, mseg_ptr, cseg_ptr, kseg_ptr, count_ptr,
                 valid_ptr, knew_ptr, vnew_ptr, kbuf_ptr, vbuf_ptr, ngen_ptr, slot_of_ptr, C, K, SPAN, SPLITS,
                 N_TOTAL, GEN_BASE, D: tl.constexpr, NB: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # b * H + h
    sp = tl.program_id(1)
    row = pid.to(tl.int64)
    if sp == 0:
        _append_token(knew_ptr, vnew_ptr, kbuf_ptr, vbuf_ptr, valid_ptr, ngen_ptr, row, N_TOTAL, GEN_BASE, D)
    top, need = _threshold_bin(hist_ptr, row, K, NB)
    ref = tl.load(ref_ptr + row)
    base = row * C
    seg = (row * SPLITS + sp) * SPAN
    lo = sp * SPAN
    hi = tl.minimum(lo + SPAN, C)
    n_miss = pid * 0
    n_cand = pid * 0
    lo_key = pid * 0 + KEY_MAX
    hi_key = pid * 0 + KEY_MIN
    for c0 in range(lo, hi, BLOCK):
        cc = c0 + tl.arange(0, BLOCK)
        inb = cc < hi
        u = _score_key(tl.load(score_ptr + base + cc, mask=inb, other=0.0))
        slot = tl.load(slot_of_ptr + base + cc, mask=inb, other=0)  # not behind the bins: one round trip
        b = _key_bin(u, ref, NB, SHIFT)
        sure = inb & (b < top)  # never a -1 score (bin NB-1 >= top), so always selectable
        cand = inb & (b == top)
        tl.store(mark_ptr + base + cc, sure.to(tl.int8), mask=inb)
        n_miss = _append(mseg_ptr + seg, n_miss, cc * 2 + 1, sure & (slot < 0))  # chunk, selectable
        # only candidates of the -1 bin can be unselectable (or a selectable chunk whose whole group is NaN)
        ok = tl.load(sel_ptr + base + cc, mask=cand & (top == NB - 1), other=1) != 0
        entry = cc * 4 + (slot < 0).to(tl.int32) * 2 + ok.to(tl.int32)  # chunk, miss, selectable
        _append(kseg_ptr + seg, n_cand, u, cand)
        n_cand = _append(cseg_ptr + seg, n_cand, entry, cand)
        lo_key = tl.minimum(lo_key, tl.min(tl.where(cand, u, KEY_MAX), 0))
        hi_key = tl.maximum(hi_key, tl.max(tl.where(cand, u, KEY_MIN), 0))
    cnt = count_ptr + (row * SPLITS + sp) * 4
    tl.store(cnt, n_miss)
    tl.store(cnt + 1, n_cand)
    tl.store(cnt + 2, lo_key)
    tl.store(cnt + 3, hi_key)


@triton.jit
def _select_tail_kernel(hist_ptr, mark_ptr, mseg_ptr, cseg_ptr, kseg_ptr, count_ptr, path_ptr, miss_ptr, cand_ptr,
                        ckey_ptr,
                        slot_ids_ptr, slot_of_ptr, work_ptr, valid_ptr, C, K, SPAN, SPLITS, N_TOTAL, SEL_BASE,
                        K_PAD: tl.constexpr, C_SIZE: tl.constexpr, C_PAD: tl.constexpr, NB: tl.constexpr,
                        S_PAD: tl.constexpr, OB: tl.constexpr, TAIL_BLOCK: tl.constexpr, RANK_BLOCK: tl.constexpr):
    """The tail (module doc), one program per (sequence, KV head)."""
    row = tl.program_id(0).to(tl.int64)
    top, need = _threshold_bin(hist_ptr, row, K, NB)
    _tail(row, top, need, mark_ptr, mseg_ptr, cseg_ptr, kseg_ptr, count_ptr, path_ptr, miss_ptr, cand_ptr, ckey_ptr,
          slot_ids_ptr, slot_of_ptr, work_ptr, valid_ptr, C, K, SPAN, SPLITS, N_TOTAL, SEL_BASE, K_PAD, C_SIZE,
          C_PAD, S_PAD, OB, TAIL_BLOCK, RANK_BLOCK)


@triton.jit
def _concat(src_ptr, dst_ptr, row, counts, starts, SPAN, SPLITS, S_PAD: tl.constexpr, OB: tl.constexpr):
    """Copies the per-program segments (``counts`` entries each, split s at ``(row*SPLITS + s)*SPAN``) to
    ``dst_ptr[starts[s]:]``: one chunk-ordered list. Tiles of S_PAD x OB entries."""
    s = tl.arange(0, S_PAD)
    o = tl.arange(0, OB)
    src = src_ptr + (row * SPLITS + s)[:, None] * SPAN
    for o0 in range(0, tl.max(counts, 0), OB):
        oo = o0 + o[None, :]
        m = (s < SPLITS)[:, None] & (oo < counts[:, None])
        tl.store(dst_ptr + starts[:, None] + oo, tl.load(src + oo, mask=m), mask=m)


@triton.jit
def _take_radix(cand_ptr, ckey_ptr, mark_ptr, misses, n_cand, need, n_sure, lo_key, hi_key, BLOCK: tl.constexpr):
    """Marks the ``need`` best candidates (ties to the lowest chunk ids) and appends their misses after
    ``n_sure``; returns the miss count. The need-th largest key by a radix select on key - lo_key (in [0, 2^31):
    the candidates share a bin, which is either non-negative keys or only -1 scores, then all equal); digits
    above the spread are all 0 and skipped."""
    spread = hi_key - lo_key
    prefix = need * 0
    bins = tl.arange(0, 512)
    j0 = tl.arange(0, BLOCK)
    for i in tl.static_range(4):  # digits of 9 bits: 2 passes within one bin of 2^18 keys
        shift = 27 - 9 * i
        if (spread >> shift) != 0:
            hist = tl.zeros((512,), tl.int32)
            for c0 in range(0, n_cand, BLOCK):
                j = c0 + j0
                match = j < n_cand
                u = tl.load(ckey_ptr + j, mask=match, other=0) - lo_key
                if i > 0:
                    match = match & ((u >> (shift + 9)) == (prefix >> (shift + 9)))
                hist += tl.histogram((u >> shift) & 511, 512, mask=match)
            at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # matched keys with this digit or larger
            digit = tl.max(tl.where(at_least >= need, bins, -1), 0)
            need -= tl.sum(tl.where(bins > digit, hist, 0), 0)
            prefix = prefix | (digit << shift)
    thr = lo_key + prefix  # need: how many candidates equal to thr are taken
    # taken candidates: marked, their misses appended (chunk order); ties at thr to the lowest chunk ids
    n_eq = need * 0
    n_miss = n_sure
    for c0 in range(0, n_cand, BLOCK):
        j = c0 + j0
        inb = j < n_cand
        entry = tl.load(cand_ptr + j, mask=inb, other=0)
        u = tl.load(ckey_ptr + j, mask=inb, other=0)
        eq = (inb & (u == thr)).to(tl.int32)
        take = (inb & (u > thr)) | ((eq != 0) & (tl.cumsum(eq, 0) - eq + n_eq < need))
        n_eq += tl.sum(eq, 0)
        cid = entry >> 2
        tl.store(mark_ptr + cid, 1, mask=take)
        n_miss = _append(misses, n_miss, cid * 2 + (entry & 1), take & ((entry & 2) != 0))
    return n_miss


@triton.jit
def _take_ranked(cand_ptr, ckey_ptr, mark_ptr, misses, n_cand, need, n_sure, RANK_BLOCK: tl.constexpr):
    """As :func:`_take_radix` for at most RANK_BLOCK candidates, by each one's rank among them (a RANK_BLOCK²
    comparison in registers: larger keys first, equal keys in list order = chunk order). Why: the radix passes
    cost ~3 us each whatever the candidate count (a 512-bin ``tl.histogram`` over a 1024-wide tile), and at
    batch 1 a head has ~10-40 candidates (H200, 122K/61K, random state)."""
    j = tl.arange(0, RANK_BLOCK)
    inb = j < n_cand
    entry = tl.load(cand_ptr + j, mask=inb, other=0)
    u = tl.load(ckey_ptr + j, mask=inb, other=0)
    ahead = (u[None, :] > u[:, None]) | ((u[None, :] == u[:, None]) & (j[None, :] < j[:, None]))
    rank = tl.sum((ahead & inb[None, :]).to(tl.int32), 1)
    take = inb & (rank < need)
    cid = entry >> 2
    tl.store(mark_ptr + cid, 1, mask=take)
    return _append(misses, n_sure, cid * 2 + (entry & 1), take & ((entry & 2) != 0))


@triton.jit
def _tail(row, top, need, mark_ptr, mseg_ptr, cseg_ptr, kseg_ptr, count_ptr, path_ptr, miss_ptr, cand_ptr, ckey_ptr,
          slot_ids_ptr, slot_of_ptr, work_ptr, valid_ptr, C, K, SPAN, SPLITS, N_TOTAL, SEL_BASE,
          K_PAD: tl.constexpr, C_SIZE: tl.constexpr, C_PAD: tl.constexpr, S_PAD: tl.constexpr, OB: tl.constexpr,
          BLOCK: tl.constexpr, RANK_BLOCK: tl.constexpr):
    """A head's exact top-K and reuse plan from the per-program lists of the mark kernel (see the module doc)."""
    base = row * C
    s = tl.arange(0, S_PAD)
    live = s < SPLITS
    cnt = count_ptr + (row * SPLITS + s) * 4
    n_m = tl.load(cnt, mask=live, other=0)
    n_c = tl.load(cnt + 1, mask=live, other=0)
    lo_key = tl.min(tl.load(cnt + 2, mask=live, other=KEY_MAX), 0)
    hi_key = tl.max(tl.load(cnt + 3, mask=live, other=KEY_MIN), 0)
    slot = tl.arange(0, K_PAD)
    in_k = slot < K
    old = tl.load(slot_ids_ptr + row * K + slot, mask=in_k, other=-1)
    n_sure = tl.sum(n_m, 0)
    n_cand = tl.sum(n_c, 0)
    misses = miss_ptr + row * K
    # the sure misses' chunk ids, tagged selectable (bit 0), then the candidates' entries and keys
    _concat(mseg_ptr, misses, row, n_m, (tl.cumsum(n_m, 0) - n_m), SPAN, SPLITS, S_PAD, OB)
    _concat(cseg_ptr, cand_ptr + base, row, n_c, tl.cumsum(n_c, 0) - n_c, SPAN, SPLITS, S_PAD, OB)
    _concat(kseg_ptr, ckey_ptr + base, row, n_c, tl.cumsum(n_c, 0) - n_c, SPAN, SPLITS, S_PAD, OB)
    tl.debug_barrier()  # the passes below read what other threads wrote

    if n_cand <= RANK_BLOCK:
        n_miss = _take_ranked(cand_ptr + base, ckey_ptr + base, mark_ptr + base, misses, n_cand, need, n_sure,
                              RANK_BLOCK)
        tl.store(path_ptr + row, 1)
    else:
        n_miss = _take_radix(cand_ptr + base, ckey_ptr + base, mark_ptr + base, misses, n_cand, need, n_sure,
                             lo_key, hi_key, BLOCK)
        tl.store(path_ptr + row, 2)
    tl.debug_barrier()

    # reuse plan: kept chunks stay in their slots, misses take the freed slots in order
    had = in_k & (old >= 0)
    kept = had & (tl.load(mark_ptr + base + old, mask=had, other=0) != 0)
    free = in_k & ~kept
    fi = free.to(tl.int32)
    rank = tl.cumsum(fi, 0) - fi
    ent = tl.load(misses + rank, mask=free & (rank < n_miss), other=-2)  # -2: no chunk (-1), not selectable
    ok = (ent & 1) != 0
    cur = tl.where(free, ent >> 1, old)
    tl.store(slot_of_ptr + base + old, -1, mask=free & had)  # chunks that left (disjoint from the new ones)
    tl.store(slot_of_ptr + base + cur, slot, mask=free & (cur >= 0))
    tl.store(slot_ids_ptr + row * K + slot, cur, mask=in_k)
    tl.store(work_ptr + row * K + slot, tl.where(free & ok, cur, -1), mask=in_k)
    i = tl.arange(0, C_PAD)
    rows = row * N_TOTAL + SEL_BASE + slot[:, None] * C_SIZE + i[None, :]
    flag = tl.where(ok[:, None], 1, 0).to(tl.int8)
    tl.store(valid_ptr + rows, flag, mask=free[:, None] & (i < C_SIZE)[None, :])


def g_pads(G: int) -> tuple[int, int]:
    """(rows of the logits dot: >= 16, the tensor-core minimum; G as a power of two for the score kernel)."""
    return max(16, triton.next_power_of_2(G)), triton.next_power_of_2(G)


STAGES = ("logits", "scores", "select")


def score_and_select(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, landmarks: torch.Tensor,
                     selectable: torch.Tensor, scale: float, fl, stop_after: str = "select", *,
                     radius: torch.Tensor | None = None, radius_weight: float = 0.0) -> None:
    """One decode step's scoring, selection and reuse plan into the layer buffers ``fl``
    (:class:`thrifty.kvcache.decode.FastLayer`), and the new token (k_new/v_new (B, H, 1, D)) appended to them.
    q (B, Hq, 1, D), landmarks (B, H, C, D), selectable (B, H, C) bool; ``radius`` (B, H, C) fp32 and
    ``radius_weight`` λ: the chunk logit is (q.landmark + λ |q| r) * scale (λ = 0: no radius read). Fills
    ``fl.scratch.scores``, ``fl.work``, the slot maps and the validity bytes. ``stop_after`` ("logits", "scores"):
    launch only the first kernels (the benchmark times the kernels one by one; the state is then not a decode
    step's)."""
    if stop_after not in STAGES:
        raise ValueError(f"stop_after must be one of {STAGES}, got {stop_after!r}")
    B, Hq, _, D = q.shape
    H, C = landmarks.shape[1], landmarks.shape[2]
    G = Hq // H
    G_PAD, G_P2 = g_pads(G)
    K = fl.slot_ids.shape[-1]
    sc = fl.scratch
    tu = sc.tuning
    splits, span = sc.logit_splits
    s_pad = triton.next_power_of_2(splits)
    sel = selectable.view(torch.int8)
    use_radius = bool(radius_weight)
    if use_radius and (radius is None or radius.shape != selectable.shape or radius.dtype != torch.float32
                       or not radius.is_contiguous()):
        raise ValueError(f"radius: expected contiguous fp32 of shape {tuple(selectable.shape)} with radius_weight "
                         f"{radius_weight}, got {None if radius is None else (radius.dtype, tuple(radius.shape))}")
    _landmark_logits_kernel[(B * H, splits)](
        q.reshape(B * Hq, D).to(landmarks.dtype), landmarks, radius if use_radius else sc.part_m, sel, sc.logits,
        sc.part_m, sc.part_l, sc.hist, C, span, splits, scale, float(radius_weight), G=G, G_PAD=G_PAD, D=D,
        BLOCK_C=tu.logit_block, NB=tu.hist_bins, RADIUS=use_radius)
    if stop_after == "logits":
        return
    _score_hist_kernel[(B * H, splits)](
        sc.logits, sc.part_m, sc.part_l, sel, sc.scores, sc.hist, sc.key_ref, C, span, splits, G=G, G_PAD=G_PAD,
        G_P2=G_P2, S_PAD=s_pad, NB=tu.hist_bins, SHIFT=tu.hist_shift, BLOCK=tu.score_block, num_warps=SCORE_WARPS)
    if stop_after == "scores":
        return
    c = fl.chunk_size
    plan = dict(K_PAD=triton.next_power_of_2(K), C_SIZE=c, C_PAD=triton.next_power_of_2(c), NB=tu.hist_bins,
                S_PAD=s_pad, OB=tu.tail_cols(s_pad), TAIL_BLOCK=tu.select_block, RANK_BLOCK=tu.rank_block)
    lists = (sc.mark, sc.seg_miss, sc.seg_cand, sc.seg_key, sc.counts, sc.tail_path)
    tail = (sc.miss_list, sc.candidates, sc.cand_keys, fl.slot_ids, fl.slot_of, fl.work, fl.valid.view(torch.int8))
    _mark_kernel[(B * H, splits)](
        sc.scores, sc.hist, sc.key_ref, sel, sc.mark, sc.seg_miss, sc.seg_cand, sc.seg_key, sc.counts,
        fl.valid.view(torch.int8), k_new.reshape(B * H, D), v_new.reshape(B * H, D), fl.k, fl.v, fl.n_generated,
        fl.slot_of, C, K, span, splits, fl.k.shape[2], fl.gen_base, D=D, NB=tu.hist_bins, SHIFT=tu.hist_shift,
        BLOCK=tu.score_block, num_warps=MARK_WARPS)
    _select_tail_kernel[(B * H,)](sc.hist, *lists, *tail, C, K, span, splits, fl.k.shape[2], fl.sel_base,
                                  num_warps=TAIL_WARPS, **plan)
