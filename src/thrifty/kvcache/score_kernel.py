"""Landmark scoring per KV head (grouped-query aware), the first stage of a ShadowKV decode step.

One program per (sequence, KV head) walks the chunks twice: pass 1 reads the landmarks, keeps the online max
and sum of ``q . landmark * scale`` for each of the G query heads of the group and parks the logits in an fp32
scratch (G x 4 bytes per chunk); pass 2 reads the logits back (not the landmarks: D x 2 bytes per chunk, 16x
more at D=128, G=4), turns them into softmax probabilities and writes their max over the group.
Non-selectable chunks (outliers, padding) score -1, exactly as
:func:`thrifty.kvcache.reference.landmark_scores`; the top-k that follows is ``torch.topk`` (capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import mma

# finite "minus infinity" for running maxima: exp(-inf - NEG) = 0, never nan. A tl.constexpr: the compiler
# refuses a plain module global inside @triton.jit code (the interpreter accepts one)
NEG = tl.constexpr(-1.0e30)


@triton.jit
def _landmark_score_kernel(q_ptr, lm_ptr, sel_ptr, logit_ptr, out_ptr, C, scale, H,
                           G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)  # b * H + h
    b = pid // H
    h = pid % H
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    q_rows = (b * H + h) * G + g  # query heads of this KV head's group (HF order: head = h * G + g)
    q = tl.load(q_ptr + q_rows[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
    m = tl.full((G_PAD,), NEG, tl.float32)
    l = tl.zeros((G_PAD,), tl.float32)
    base = pid.to(tl.int64) * C
    logits = logit_ptr + pid.to(tl.int64) * G * C + g[:, None] * C  # the G rows of this program's group
    live = g[:, None] < G
    for c0 in range(0, C, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        inb = cc < C
        lm = tl.load(lm_ptr + (base + cc)[:, None] * D + d[None, :], mask=inb[:, None], other=0.0)
        sel = tl.load(sel_ptr + base + cc, mask=inb, other=0) != 0
        s = mma(q, tl.trans(lm), tl.zeros((G_PAD, BLOCK_C), tl.float32)) * scale
        s = tl.where(sel[None, :], s, float("-inf"))
        tl.store(logits + cc[None, :], s, mask=live & inb[None, :])
        m_new = tl.maximum(m, tl.max(s, 1))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m = m_new
    tl.debug_barrier()  # pass 2 reads logits other threads of this program wrote
    inv_l = 1.0 / tl.maximum(l, 1e-30)
    for c0 in range(0, C, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        inb = cc < C
        sel = tl.load(sel_ptr + base + cc, mask=inb, other=0) != 0
        s = tl.load(logits + cc[None, :], mask=live & inb[None, :], other=float("-inf"))
        p = tl.exp(s - m[:, None]) * inv_l[:, None]
        p = tl.where((g < G)[:, None] & (p == p), p, -1.0)  # a NaN query head decides no pick (as the reference)
        best = tl.max(p, 0)
        tl.store(out_ptr + base + cc, tl.where(sel, best, -1.0), mask=inb)


def landmark_scores(q: torch.Tensor, landmarks: torch.Tensor, selectable: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, Hq, 1, D), landmarks (B, H, C, D), selectable (B, H, C) bool -> scores (B, H, C) fp32."""
    B, Hq, _, D = q.shape
    H, C = landmarks.shape[1], landmarks.shape[2]
    G = Hq // H
    G_PAD = max(16, triton.next_power_of_2(G))
    if out is None:
        out = torch.empty(B, H, C, dtype=torch.float32, device=q.device)
    logits = torch.empty(B * H, G, C, dtype=torch.float32, device=q.device)
    _landmark_score_kernel[(B * H,)](
        q.reshape(B * Hq, D).to(landmarks.dtype).contiguous(), landmarks.contiguous(),
        selectable.view(torch.int8), logits, out, C, scale, H, G=G, G_PAD=G_PAD, D=D, BLOCK_C=64)
    return out
