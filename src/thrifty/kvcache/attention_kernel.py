"""Decode attention over one static buffer per (sequence, KV head): [outliers + local | selected slots |
generated], with a validity byte per row (padding, unused generated rows, padding picks). Split-K
(flash-decoding): program (b*H + h, split) runs an online softmax over its share of rows for the G query heads
of the group at once (padded to 16 rows for the tensor-core dot), writes (max, sum, partial output) of the G
real rows; a second kernel, one program per query head, merges the splits (a block of splits per load) and
writes the output in the query's dtype. The split count puts ~4 programs on every
SM (batch 1 at 122K: 8 heads x ~2.5K rows -> 8 x 40 splits of 64 rows), so a few thousand selected rows cost
what dense attention over as many rows costs. Invalid rows get weight 0 and their values are zeroed before
the product, so whatever a stale or padding slot holds (NaN included) cannot leak. Every shape is static, so
the step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import mma
from .score_kernel import NEG, target_programs


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, m_ptr, l_ptr, acc_ptr, N, scale, H, SPLITS,
                             SPLIT_LEN, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                             BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)  # b * H + h
    sp = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (pid * G + g)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
    m = tl.full((G_PAD,), NEG, tl.float32)
    l = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    base = pid.to(tl.int64) * N
    lo = sp * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, N)
    for n0 in range(lo, hi, BLOCK_N):
        nn = n0 + tl.arange(0, BLOCK_N)
        inb = nn < hi
        ok = (tl.load(valid_ptr + base + nn, mask=inb, other=0) != 0) & inb
        k = tl.load(k_ptr + (base + nn)[:, None] * D + d[None, :], mask=inb[:, None], other=0.0)
        v = tl.load(v_ptr + (base + nn)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        s = mma(q, tl.trans(k), tl.zeros((G_PAD, BLOCK_N), tl.float32)) * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None])
        m = m_new
    out = (pid * SPLITS + sp) * G_PAD + g
    live = g < G  # the padding rows of the dot are not stored: the merge reads G rows per split
    tl.store(m_ptr + out, m, mask=live)
    tl.store(l_ptr + out, l, mask=live)
    tl.store(acc_ptr + out[:, None] * D + d[None, :], acc, mask=live[:, None])


@triton.jit
def _merge_splits_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, SPLITS, G: tl.constexpr, G_PAD: tl.constexpr,
                         D: tl.constexpr, S_BLOCK: tl.constexpr):
    """One program per query head: its splits merged S_BLOCK at a time (one load each), not one by one (a
    serial loop of dependent loads: ~0.5 us per split, 20 us at 41 splits)."""
    pid = tl.program_id(0)  # b * H + h
    g = tl.program_id(1)
    s = tl.arange(0, S_BLOCK)
    d = tl.arange(0, D)
    m = tl.full((), NEG, tl.float32)
    l = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for s0 in range(0, SPLITS, S_BLOCK):
        live = s0 + s < SPLITS
        part = (pid * SPLITS + s0 + s) * G_PAD + g
        m_s = tl.load(m_ptr + part, mask=live, other=NEG)
        m_new = tl.maximum(m, tl.max(m_s, 0))
        w = tl.exp(m_s - m_new)  # a split without valid rows has l = acc = 0
        a = tl.exp(m - m_new)
        l = l * a + tl.sum(tl.load(l_ptr + part, mask=live, other=0.0) * w, 0)
        part_acc = tl.load(acc_ptr + part[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
        acc = acc * a + tl.sum(part_acc * w[:, None], 0)
        m = m_new
    tl.store(out_ptr + (pid * G + g) * D + d, (acc / l).to(out_ptr.dtype.element_ty))


MERGE_BLOCK = 64  # splits per load of the merge (64 x D fp32: 32 KB at D = 128)


def attention_splits(rows: int, N: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """(splits, rows per split): ~4 programs per SM over ``rows`` (sequence, KV head) pairs, whole blocks."""
    blocks = triton.cdiv(N, block_n)
    splits = max(1, min(blocks, triton.cdiv(target_programs(device), rows)))
    split_len = triton.cdiv(blocks, splits) * block_n
    return triton.cdiv(N, split_len), split_len


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float,
                     splits: int | None = None, block_n: int = 64, merge_block: int = MERGE_BLOCK) -> torch.Tensor:
    """q (B, Hq, 1, D); k/v (B, H, N, D); valid (B, H, N) bool -> (B, Hq, 1, D) in q's dtype. ``splits``:
    splits of the row axis (default: ~4 programs per SM); ``merge_block``: splits the merge loads at once."""
    B, Hq, _, D = q.shape
    H, N = k.shape[1], k.shape[2]
    G = Hq // H
    G_PAD = max(16, triton.next_power_of_2(G))
    if splits is None:
        splits, split_len = attention_splits(B * H, N, block_n, q.device)
    else:
        split_len = triton.cdiv(triton.cdiv(N, splits), block_n) * block_n
        splits = triton.cdiv(N, split_len)
    dev = q.device
    m = torch.empty(B * H, splits, G_PAD, dtype=torch.float32, device=dev)
    l = torch.empty_like(m)
    acc = torch.empty(B * H, splits, G_PAD, D, dtype=torch.float32, device=dev)
    _decode_attention_kernel[(B * H, splits)](
        q.reshape(B * Hq, D).to(k.dtype), k, v, valid.view(torch.int8), m, l, acc, N, scale, H,
        splits, split_len, G=G, G_PAD=G_PAD, D=D, BLOCK_N=block_n)
    out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=dev)
    _merge_splits_kernel[(B * H, G)](m, l, acc, out, splits, G=G, G_PAD=G_PAD, D=D, 
                                     S_BLOCK=min(merge_block, triton.next_power_of_2(splits)))
    return out
