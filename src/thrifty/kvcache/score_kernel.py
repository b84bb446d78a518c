"""Landmark scoring, top-K selection and the reuse plan: the first stage of a ShadowKV decode step, two kernels.

1. ``_landmark_logits_kernel``, grid (sequence x KV head, splits of the chunk axis): ``q . landmark * scale``
   for the G query heads of the group (one tensor-core dot, rows padded to 16), the logits parked in an fp32
   scratch (G x 4 bytes per chunk), and per split the running max and sum of the softmax. Enough splits to put
   ~4 programs on every SM even at batch 1: the landmarks (C x D x 2 bytes per head) are the bytes that matter.
2. ``_select_kernel``, one program per (sequence, KV head):
   * appends the new token's key/value to the generated rows of the attention buffer (row ``gen_base +
     n_generated``, a device counter) and marks it valid;
   * merges the split statistics, turns the logits into softmax probabilities and writes their max over the
     group: the score of a chunk (-1 for chunks that cannot be selected: outliers, padding), exactly
     :func:`thrifty.kvcache.reference.landmark_scores`;
   * finds the K-th largest score by a radix select: 4 passes of 8 bits with ``tl.histogram`` over the
     order-preserving integer image of the fp32 scores (no sort). Ties at the threshold go to the lowest chunk
     ids (``torch.topk`` leaves them unspecified);
   * the reuse plan: a chunk still selected keeps its slot (nothing moves), each newly selected chunk takes a
     slot whose chunk left the selection; ``work[slot]`` = the chunk to rebuild/fetch there, or -1. The maps
     ``slot_ids`` (slot -> chunk) and ``slot_of`` (chunk -> slot) are updated in place, so that a CUDA graph
     replay sees the previous step's plan. A slot whose chunk is not selectable (a sequence with fewer
     selectable chunks than K) is marked invalid and never filled.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..triton_utils import mma

# finite "minus infinity" for running maxima: exp(-inf - NEG) = 0, never nan. A tl.constexpr: the compiler
# refuses a plain module global inside @triton.jit code (the interpreter accepts one)
NEG = tl.constexpr(-1.0e30)
LOGIT_BLOCK = 64  # chunks per iteration of the logits kernel (64 x 128 bf16 = 16 KB of landmarks)
SELECT_BLOCK = 1024  # chunks per iteration of the select kernel
SELECT_WARPS = 4
PROGRAMS_PER_SM = 4


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int | None) -> int:
    """Streaming multiprocessors of the device (132 on the H100 SXM; the CPU/interpreter assumes that)."""
    if device_index is None or not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def target_programs(device: torch.device) -> int:
    return PROGRAMS_PER_SM * sm_count(device.index if device.type == "cuda" else None)


def logit_splits(rows: int, C: int, device: torch.device) -> tuple[int, int]:
    """(splits, chunks per split) of the logits kernel: ~4 programs per SM, whole blocks per split."""
    blocks = triton.cdiv(C, LOGIT_BLOCK)
    splits = max(1, min(blocks, triton.cdiv(target_programs(device), rows)))
    span = triton.cdiv(blocks, splits) * LOGIT_BLOCK
    return triton.cdiv(C, span), span


@triton.jit
def _landmark_logits_kernel(q_ptr, lm_ptr, sel_ptr, logit_ptr, part_m_ptr, part_l_ptr, C, SPAN, SPLITS, scale,
                            G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)  # b * H + h
    sp = tl.program_id(1)
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
def _select_kernel(logit_ptr, part_m_ptr, part_l_ptr, sel_ptr, score_ptr, mark_ptr, miss_ptr, slot_ids_ptr,
                   slot_of_ptr, work_ptr, valid_ptr, knew_ptr, vnew_ptr, kbuf_ptr, vbuf_ptr, ngen_ptr,
                   C, SPLITS, K, N_TOTAL, SEL_BASE, GEN_BASE,
                   G: tl.constexpr, G_PAD: tl.constexpr, S_PAD: tl.constexpr, K_PAD: tl.constexpr,
                   C_SIZE: tl.constexpr, C_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # b * H + h
    row = pid.to(tl.int64)
    base = row * C

    # the new token goes to row GEN_BASE + n_generated
    d = tl.arange(0, D)
    gen_row = row * N_TOTAL + GEN_BASE + tl.load(ngen_ptr)
    tl.store(kbuf_ptr + gen_row * D + d, tl.load(knew_ptr + row * D + d).to(kbuf_ptr.dtype.element_ty))
    tl.store(vbuf_ptr + gen_row * D + d, tl.load(vnew_ptr + row * D + d).to(vbuf_ptr.dtype.element_ty))
    tl.store(valid_ptr + gen_row, 1)

    # softmax statistics of each query head, merged over the splits of the logits kernel
    s_ = tl.arange(0, S_PAD)
    g = tl.arange(0, G_PAD)
    part = (row * SPLITS + s_)[:, None] * G_PAD + g[None, :]
    pm = tl.load(part_m_ptr + part, mask=(s_ < SPLITS)[:, None], other=NEG)
    pl = tl.load(part_l_ptr + part, mask=(s_ < SPLITS)[:, None], other=0.0)
    m = tl.max(pm, 0)
    inv_l = 1.0 / tl.maximum(tl.sum(pl * tl.exp(pm - m[None, :]), 0), 1e-30)

    # scores: the max over the group of the probabilities; -1 where a chunk cannot be selected
    live = g < G
    logits = logit_ptr + row * G * C + g[:, None] * C
    for c0 in range(0, C, BLOCK):
        cc = c0 + tl.arange(0, BLOCK)
        inb = cc < C
        x = tl.load(logits + cc[None, :], mask=live[:, None] & inb[None, :], other=float("-inf"))
        p = tl.exp(x - m[:, None]) * inv_l[:, None]
        p = tl.where(live[:, None] & (p == p), p, -1.0)  # a NaN query head decides no pick (as the reference)
        sel = tl.load(sel_ptr + base + cc, mask=inb, other=0) != 0
        tl.store(score_ptr + base + cc, tl.where(sel, tl.max(p, 0), -1.0), mask=inb)
    tl.debug_barrier()  # the passes below read scores other threads wrote

    # radix select of the K-th largest key, 8 bits per pass
    need = K
    prefix = (pid * 0).to(tl.int64)
    bins = tl.arange(0, 256)
    for i in tl.static_range(4):
        shift = 24 - 8 * i
        hist = tl.zeros((256,), tl.int32)
        for c0 in range(0, C, BLOCK):
            cc = c0 + tl.arange(0, BLOCK)
            inb = cc < C
            u = _score_key(tl.load(score_ptr + base + cc, mask=inb, other=0.0))
            match = inb
            if i > 0:
                match = match & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
            hist += tl.histogram(((u >> shift) & 255).to(tl.int32), 256, mask=match)
        at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # matched keys with this digit or a larger one
        digit = tl.max(tl.where(at_least >= need, bins, -1), 0)
        need -= tl.sum(tl.where(bins > digit, hist, 0), 0)
        prefix = prefix | (digit.to(tl.int64) << shift)

    # the selection (keys above the threshold, then the first `need` equal to it) and the misses
    n_eq = pid * 0
    n_miss = pid * 0
    for c0 in range(0, C, BLOCK):
        cc = c0 + tl.arange(0, BLOCK)
        inb = cc < C
        u = _score_key(tl.load(score_ptr + base + cc, mask=inb, other=0.0))
        eq = (inb & (u == prefix)).to(tl.int32)
        take = (inb & (u > prefix)) | ((eq != 0) & (tl.cumsum(eq, 0) - eq + n_eq < need))
        n_eq += tl.sum(eq, 0)
        tl.store(mark_ptr + base + cc, take.to(tl.int8), mask=inb)
        miss = (take & (tl.load(slot_of_ptr + base + cc, mask=inb, other=-1) < 0)).to(tl.int32)
        tl.store(miss_ptr + row * K + tl.cumsum(miss, 0) - miss + n_miss, cc, mask=miss != 0)
        n_miss += tl.sum(miss, 0)
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


def score_and_select(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, landmarks: torch.Tensor,
                     selectable: torch.Tensor, scale: float, fl) -> None:
    """One decode step's scoring, selection and reuse plan into the layer buffers ``fl``
    (:class:`thrifty.kvcache.decode.FastLayer`), and the new token (k_new/v_new (B, H, 1, D)) appended to them.
    q (B, Hq, 1, D), landmarks (B, H, C, D), selectable (B, H, C) bool. Fills ``fl.scratch.scores``, ``fl.work``, the
    slot maps and the validity bytes."""
    B, Hq, _, D = q.shape
    H, C = landmarks.shape[1], landmarks.shape[2]
    G = Hq // H
    G_PAD = max(16, triton.next_power_of_2(G))
    K = fl.slot_ids.shape[-1]
    sc = fl.scratch
    splits, span = sc.logit_splits
    _landmark_logits_kernel[(B * H, splits)](
        q.reshape(B * Hq, D).to(landmarks.dtype), landmarks, selectable.view(torch.int8), sc.logits, sc.part_m,
        sc.part_l, C, span, splits, scale, G=G, G_PAD=G_PAD, D=D, BLOCK_C=LOGIT_BLOCK)
    c = fl.chunk_size
    _select_kernel[(B * H,)](
        sc.logits, sc.part_m, sc.part_l, selectable.view(torch.int8), sc.scores, sc.mark, sc.miss_list,
        fl.slot_ids, fl.slot_of, fl.work, fl.valid.view(torch.int8), k_new.reshape(B * H, D), v_new.reshape(B * H, D), fl.k, fl.v,
        fl.n_generated, C, splits, K, fl.k.shape[2], fl.sel_base, fl.gen_base,
        G=G, G_PAD=G_PAD, S_PAD=triton.next_power_of_2(splits), K_PAD=triton.next_power_of_2(K), C_SIZE=c,
        C_PAD=triton.next_power_of_2(c), D=D, BLOCK=SELECT_BLOCK, num_warps=SELECT_WARPS)
