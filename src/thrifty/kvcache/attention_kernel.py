"""Decode attention over one static buffer per (sequence, KV head): [outliers + local | selected slots |
generated], with a validity byte per row (padding, unused generated rows, padding picks). Split-K
(flash-decoding): program (b*H + h, split) runs an online softmax over its share of rows for the G query heads
of the group at once (padded to 16 rows for the tensor-core dot), writes (max, sum, partial output); a torch
epilogue merges the splits. Every shape is static, so the step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import mma
from .score_kernel import NEG


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
        v = tl.load(v_ptr + (base + nn)[:, None] * D + d[None, :], mask=inb[:, None], other=0.0)
        s = mma(q, tl.trans(k), tl.zeros((G_PAD, BLOCK_N), tl.float32)) * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None])
        m = m_new
    out = (pid * SPLITS + sp) * G_PAD + g
    tl.store(m_ptr + out, m)
    tl.store(l_ptr + out, l)
    tl.store(acc_ptr + out[:, None] * D + d[None, :], acc)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float,
                     splits: int = 8, block_n: int = 64) -> torch.Tensor:
    """q (B, Hq, 1, D); k/v (B, H, N, D); valid (B, H, N) bool -> (B, Hq, 1, D) in q's dtype."""
    B, Hq, _, D = q.shape
    H, N = k.shape[1], k.shape[2]
    G = Hq // H
    G_PAD = max(16, triton.next_power_of_2(G))
    split_len = triton.cdiv(triton.cdiv(N, splits), block_n) * block_n
    splits = triton.cdiv(N, split_len)
    dev = q.device
    m = torch.empty(B * H, splits, G_PAD, dtype=torch.float32, device=dev)
    l = torch.empty_like(m)
    acc = torch.empty(B * H, splits, G_PAD, D, dtype=torch.float32, device=dev)
    _decode_attention_kernel[(B * H, splits)](
        q.reshape(B * Hq, D).to(k.dtype).contiguous(), k, v, valid.view(torch.int8), m, l, acc, N, scale, H,
        splits, split_len, G=G, G_PAD=G_PAD, D=D, BLOCK_N=block_n)
    # merge the splits: weights exp(m_s - max_s m)
    w = torch.exp(m - m.amax(1, keepdim=True))
    out = (acc * w[..., None]).sum(1) / (l * w).sum(1)[..., None]
    return out[:, :G].reshape(B, Hq, 1, D).to(q.dtype)
