"""Landmark scoring, top-K selection and the reuse plan: the first stage of a ShadowKV decode step, three kernels.

1. ``_landmark_logits_kernel``, grid (sequence x KV head, splits of the chunk axis): ``q . landmark * scale``
   for the G query heads of the group (one tensor-core dot, rows padded to 16), the logits parked in an fp32
   scratch (G x 4 bytes per chunk), and per split the running max and sum of the softmax. Enough splits to put
   ~4 programs on every SM even at batch 1: the landmarks (C x D x 2 bytes per head) are the bytes that matter.
   Program 0 of each head also zeroes the head's score histogram for kernel 2.
2. ``_score_hist_kernel``, the same grid: merges the split statistics, turns its chunks' logits into softmax
   probabilities and writes their max over the group: the score of a chunk (-1 for chunks that cannot be
   selected: outliers, padding), exactly :func:`thrifty.kvcache.reference.landmark_scores`. Each score also
   goes into a histogram of ``bins`` (an atomic add): the first level of the top-K, spread over every program.
3. ``_select_kernel``, one program per (sequence, KV head):
   * appends the new token's key/value to the generated rows of the attention buffer (row ``gen_base +
     n_generated``, a device counter) and marks it valid;
   * level 1: the histogram says which bin holds the K-th largest score; one pass over the scores marks every
     chunk of a higher bin and lists the chunks of that bin (the candidates, typically ~1% of C);
   * level 2: the exact K-th largest among the candidates by a radix select (4 passes of 8 bits with
     ``tl.histogram`` over the order-preserving integer image of the fp32 scores, no sort). Ties at the
     threshold go to the lowest chunk ids (``torch.topk`` leaves them unspecified);
   * the reuse plan: a chunk still selected keeps its slot (nothing moves), each newly selected chunk takes a
     slot whose chunk left the selection; ``work[slot]`` = the chunk to rebuild/fetch there, or -1. The maps
     ``slot_ids`` (slot -> chunk) and ``slot_of`` (chunk -> slot) are updated in place, so that a CUDA graph
     replay sees the previous step's plan. A slot whose chunk is not selectable (a sequence with fewer
     selectable chunks than K) is marked invalid and never filled.

Why two levels: a radix select inside one program per head walked all C chunks 6 times (scores, 4 passes,
marks) with 8 programs on the GPU at batch 1 (138 us per layer at 122K on the H200). Now the C-sized work is the
histogram, spread over ~4 programs per SM, plus one pass in the per-head program; the radix passes only see the
candidates.

Bins: ``(key(ref) - key(score)) >> shift``, clamped to [0, bins - 2], with ``ref`` the largest score any chunk of
the head can have (1/sum of the softmax); negative scores (-1) get the last bin. A bin is a function of the key
that never increases with it, so every chunk of a lower bin scores higher than every chunk of a higher one, and
chunks with equal scores share a bin: the selection is exact whatever ``ref`` holds. ``ref`` only sets the
resolution: with shift 18, 32 bins per octave over 64 octaves below the largest score.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..triton_utils import mma

# finite "minus infinity" for running maxima: exp(-inf - NEG) = 0, never nan. A tl.constexpr: the compiler
# refuses a plain module global inside @triton.jit code (the interpreter accepts one)
NEG = tl.constexpr(-1.0e30)
ZERO_KEY = tl.constexpr(2147483648)  # _score_key(+0.0): keys below it are negative scores
PROGRAMS_PER_SM = 4
SCORE_WARPS = 4
SELECT_WARPS = 8


@dataclass(frozen=True)
class SelectTuning:
    """Block sizes of the select stage. The defaults are what the GPU runs; tests shrink them to cover the
    multi-block and coarse-bin paths at small sizes."""
    logit_block: int = 64  # chunks per iteration of the logits kernel (64 x 128 bf16 = 16 KB of landmarks)
    score_block: int = 256  # chunks per iteration of the score kernel
    select_block: int = 4096  # chunks (or candidates) per iteration of the select kernel
    hist_bins: int = 2048  # bins of the first level (8 KB of int32 per head)
    hist_shift: int = 18  # key bits per bin: an octave is 2^23, so 32 bins per octave

    def __post_init__(self):
        for name in ("logit_block", "score_block", "select_block", "hist_bins"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"SelectTuning.{name} must be a power of two >= 16, got {v}")
        if not 0 <= self.hist_shift <= 31:
            raise ValueError(f"SelectTuning.hist_shift must be in [0, 31], got {self.hist_shift}")


TUNING = SelectTuning()


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int | None) -> int:
    """Streaming multiprocessors of the device (132 on the H100 SXM; the CPU/interpreter assumes that)."""
    if device_index is None or not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def target_programs(device: torch.device) -> int:
    return PROGRAMS_PER_SM * sm_count(device.index if device.type == "cuda" else None)


def logit_splits(rows: int, C: int, device: torch.device, block: int = TUNING.logit_block) -> tuple[int, int]:
    """(splits, chunks per split) of the logits and score kernels: ~4 programs per SM, whole blocks per split."""
    blocks = triton.cdiv(C, block)
    splits = max(1, min(blocks, triton.cdiv(target_programs(device), rows)))
    span = triton.cdiv(blocks, splits) * block
    return triton.cdiv(C, span), span


@triton.jit
def _landmark_logits_kernel(q_ptr, lm_ptr, sel_ptr, logit_ptr, part_m_ptr, part_l_ptr, hist_ptr, C, SPAN, SPLITS,
                            scale, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_C: tl.constexpr,
                            NB: tl.constexpr):
    pid = tl.program_id(0)  # b * H + h
    sp = tl.program_id(1)
    if sp == 0:  # the score kernel adds into it; the previous user (the last select kernel) has finished
        tl.store(hist_ptr + pid.to(tl.int64) * NB + tl.arange(0, NB), 0)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    live = g < G
    q = tl.load(q_ptr + (pid * G + g)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)  # HF order
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
        s = mma(q, tl.trans(lm), tl.zeros((G_PAD, BLOCK_C), tl.float32)) * scale
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
    """fp32 -> int64 in [0, 2^32) with the same order (for the radix select)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return key.to(tl.int64) + 2147483648


@triton.jit
def _key_bin(key, ref, NB: tl.constexpr, SHIFT: tl.constexpr):
    """First-level bin of a score key, 0 = highest. Never increases with the key (for any ``ref``)."""
    below = tl.minimum(tl.maximum((ref - key) >> SHIFT, 0), NB - 2)
    return tl.where(key < ZERO_KEY, NB - 1, below).to(tl.int32)


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
    if sp == 0:  # every program computes the same ref; the select kernel needs it to rebuild the bins
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
def _candidate_keys(cand_ptr, score_ptr, base, c0, n, BLOCK: tl.constexpr):
    """(chunk ids, keys, in range) of candidates c0 .. c0 + BLOCK."""
    j = c0 + tl.arange(0, BLOCK)
    inb = j < n
    cid = tl.load(cand_ptr + base + j, mask=inb, other=0)
    return cid, _score_key(tl.load(score_ptr + base + cid, mask=inb, other=0.0)), inb


@triton.jit
def _kth_key(cand_ptr, score_ptr, base, n, need, BLOCK: tl.constexpr):
    """Radix select over the ``n`` candidates: (the key of the need-th largest, how many candidates equal to
    it are taken). 4 passes of 8 bits, each a histogram of the keys that match the digits found so far."""
    prefix = (need * 0).to(tl.int64)
    bins = tl.arange(0, 256)
    for i in tl.static_range(4):
        shift = 24 - 8 * i
        hist = tl.zeros((256,), tl.int32)
        for c0 in range(0, n, BLOCK):
            _, u, match = _candidate_keys(cand_ptr, score_ptr, base, c0, n, BLOCK)
            if i > 0:
                match = match & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
            hist += tl.histogram(((u >> shift) & 255).to(tl.int32), 256, mask=match)
        at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # matched keys with this digit or a larger one
        digit = tl.max(tl.where(at_least >= need, bins, -1), 0)
        need -= tl.sum(tl.where(bins > digit, hist, 0), 0)
        prefix = prefix | (digit.to(tl.int64) << shift)
    return prefix, need


@triton.jit
def _select_kernel(score_ptr, hist_ptr, ref_ptr, sel_ptr, mark_ptr, miss_ptr, cand_ptr, slot_ids_ptr,
                   slot_of_ptr, work_ptr, valid_ptr, knew_ptr, vnew_ptr, kbuf_ptr, vbuf_ptr, ngen_ptr,
                   C, K, N_TOTAL, SEL_BASE, GEN_BASE,
                   K_PAD: tl.constexpr, C_SIZE: tl.constexpr, C_PAD: tl.constexpr, D: tl.constexpr,
                   NB: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # b * H + h
    row = pid.to(tl.int64)
    base = row * C
    _append_token(knew_ptr, vnew_ptr, kbuf_ptr, vbuf_ptr, valid_ptr, ngen_ptr, row, N_TOTAL, GEN_BASE, D)

    # level 1: the bin of the K-th largest score (the histogram of the score kernel; its total is C >= K)
    bins = tl.arange(0, NB)
    hist = tl.load(hist_ptr + row * NB + bins)
    top = tl.min(tl.where(tl.cumsum(hist, 0) >= K, bins, NB - 1), 0)
    need = K - tl.sum(tl.where(bins < top, hist, 0), 0)  # >= 1: how many of bin `top` are taken
    ref = tl.load(ref_ptr + row)

    # one pass: higher bins are taken (marked; the misses listed), bin `top` is listed as candidates
    n_miss = pid * 0
    n_cand = pid * 0
    lo_key = (pid * 0).to(tl.int64) + 4294967296  # above every key
    hi_key = (pid * 0).to(tl.int64) - 1
    for c0 in range(0, C, BLOCK):
        cc = c0 + tl.arange(0, BLOCK)
        inb = cc < C
        u = _score_key(tl.load(score_ptr + base + cc, mask=inb, other=0.0))
        b = _key_bin(u, ref, NB, SHIFT)
        sure = inb & (b < top)
        cand = inb & (b == top)
        tl.store(mark_ptr + base + cc, sure.to(tl.int8), mask=inb)
        miss = sure & (tl.load(slot_of_ptr + base + cc, mask=sure, other=0) < 0)
        n_miss = _append(miss_ptr + row * K, n_miss, cc, miss)
        n_cand = _append(cand_ptr + base, n_cand, cc, cand)
        lo_key = tl.minimum(lo_key, tl.min(tl.where(cand, u, 4294967296), 0))
        hi_key = tl.maximum(hi_key, tl.max(tl.where(cand, u, -1), 0))
    tl.debug_barrier()  # the passes below read lists and marks other threads wrote

    # level 2: the exact threshold among the candidates; all equal (e.g. every -1 of a short sequence): no passes
    alike = lo_key == hi_key
    thr, need_eq = _kth_key(cand_ptr, score_ptr, base, tl.where(alike, 0, n_cand), need, BLOCK)
    thr = tl.where(alike, lo_key, thr)
    need_eq = tl.where(alike, need, need_eq)
    n_eq = pid * 0
    for c0 in range(0, n_cand, BLOCK):
        cid, u, inb = _candidate_keys(cand_ptr, score_ptr, base, c0, n_cand, BLOCK)
        eq = (inb & (u == thr)).to(tl.int32)
        take = (inb & (u > thr)) | ((eq != 0) & (tl.cumsum(eq, 0) - eq + n_eq < need_eq))  # ties: lowest ids
        n_eq += tl.sum(eq, 0)
        tl.store(mark_ptr + base + cid, take.to(tl.int8), mask=take)
        miss = take & (tl.load(slot_of_ptr + base + cid, mask=take, other=0) < 0)
        n_miss = _append(miss_ptr + row * K, n_miss, cid, miss)
    tl.debug_barrier()

    # reuse plan: kept chunks stay in their slots, misses take the freed slots in order
    slot = tl.arange(0, K_PAD)
    in_k = slot < K
    old = tl.load(slot_ids_ptr + row * K + slot, mask=in_k, other=-1)
    had = in_k & (old >= 0)
    kept = had & (tl.load(mark_ptr + base + old, mask=had, other=0) != 0)
    free = in_k & ~kept
    fi = free.to(tl.int32)
    rank = tl.cumsum(fi, 0) - fi
    new = tl.load(miss_ptr + row * K + rank, mask=free & (rank < n_miss), other=-1)
    cur = tl.where(free, new, old)
    tl.store(slot_of_ptr + base + old, -1, mask=free & had)  # chunks that left (disjoint from the new ones)
    tl.store(slot_of_ptr + base + cur, slot, mask=free & (cur >= 0))
    tl.store(slot_ids_ptr + row * K + slot, cur, mask=in_k)
    ok = (cur >= 0) & (tl.load(sel_ptr + base + cur, mask=in_k & (cur >= 0), other=0) != 0)
    tl.store(work_ptr + row * K + slot, tl.where(free & ok, cur, -1), mask=in_k)
    i = tl.arange(0, C_PAD)
    rows = row * N_TOTAL + SEL_BASE + slot[:, None] * C_SIZE + i[None, :]
    flag = tl.where(ok[:, None] & (i < C_SIZE)[None, :], 1, 0).to(tl.int8)
    tl.store(valid_ptr + rows, flag, mask=in_k[:, None] & (i < C_SIZE)[None, :])


def g_pads(G: int) -> tuple[int, int]:
    """(rows of the logits dot: >= 16, the tensor-core minimum; G as a power of two for the score kernel)."""
    return max(16, triton.next_power_of_2(G)), triton.next_power_of_2(G)


def score_and_select(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, landmarks: torch.Tensor,
                     selectable: torch.Tensor, scale: float, fl) -> None:
    """One decode step's scoring, selection and reuse plan into the layer buffers ``fl``
    (:class:`thrifty.kvcache.decode.FastLayer`), and the new token (k_new/v_new (B, H, 1, D)) appended to them.
    q (B, Hq, 1, D), landmarks (B, H, C, D), selectable (B, H, C) bool. Fills ``fl.scratch.scores``, ``fl.work``, the
    slot maps and the validity bytes."""
    B, Hq, _, D = q.shape
    H, C = landmarks.shape[1], landmarks.shape[2]
    G = Hq // H
    G_PAD, G_P2 = g_pads(G)
    K = fl.slot_ids.shape[-1]
    sc = fl.scratch
    tu = sc.tuning
    splits, span = sc.logit_splits
    sel = selectable.view(torch.int8)
    _landmark_logits_kernel[(B * H, splits)](
        q.reshape(B * Hq, D).to(landmarks.dtype), landmarks, sel, sc.logits, sc.part_m, sc.part_l, sc.hist, C,
        span, splits, scale, G=G, G_PAD=G_PAD, D=D, BLOCK_C=tu.logit_block, NB=tu.hist_bins)
    _score_hist_kernel[(B * H, splits)](
        sc.logits, sc.part_m, sc.part_l, sel, sc.scores, sc.hist, sc.key_ref, C, span, splits, G=G, G_PAD=G_PAD,
        G_P2=G_P2, S_PAD=triton.next_power_of_2(splits), NB=tu.hist_bins, SHIFT=tu.hist_shift,
        BLOCK=tu.score_block, num_warps=SCORE_WARPS)
    c = fl.chunk_size
    _select_kernel[(B * H,)](
        sc.scores, sc.hist, sc.key_ref, sel, sc.mark, sc.miss_list, sc.candidates, fl.slot_ids, fl.slot_of,
        fl.work, fl.valid.view(torch.int8), k_new.reshape(B * H, D), v_new.reshape(B * H, D), fl.k, fl.v,
        fl.n_generated, C, K, fl.k.shape[2], fl.sel_base, fl.gen_base,
        K_PAD=triton.next_power_of_2(K), C_SIZE=c, C_PAD=triton.next_power_of_2(c), D=D, NB=tu.hist_bins,
        SHIFT=tu.hist_shift, BLOCK=tu.select_block, num_warps=SELECT_WARPS)
