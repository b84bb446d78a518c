"""Key rebuild: gather the low-rank rows of the selected chunks, multiply by the head's SV, apply RoPE at
the chunks' original positions, and write the keys into the slots of the reuse buffer. One fused kernel.

Grid: (sequence x KV head, blocks of ``CHUNKS`` selections). Only selections marked ``miss`` (not in the
buffer since the last step) are computed; a block without a miss returns at once, so with the paper's ~60%
hit rate most of the work is skipped. The two halves of the head dim are accumulated separately
(``U @ SV[:, :D/2]`` and ``U @ SV[:, D/2:]``) so that RoPE's rotate-half is a register operation:
``y1 = x1 cos - x2 sin``, ``y2 = x2 cos + x1 sin``. cos/sin come from the model's own table (any rope type).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import mma


@triton.jit
def _rebuild_keys_kernel(u_ptr, sv_ptr, cos_ptr, sin_ptr, ids_ptr, dest_ptr, miss_ptr, out_ptr,
                         T_U, R, H, K, N_TOTAL, SLOT_BASE,
                         C_SIZE: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_T: tl.constexpr,
                         HALF: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)  # b * H + h
    b = pid // H
    t = tl.arange(0, BLOCK_T)
    sel = tl.program_id(1) * CHUNKS + t // C_SIZE
    live = (t < CHUNKS * C_SIZE) & (sel < K)
    miss = tl.load(miss_ptr + pid * K + sel, mask=live, other=0) != 0
    if tl.max(miss.to(tl.int32), 0) == 0:
        return
    i = t % C_SIZE
    cid = tl.load(ids_ptr + pid * K + sel, mask=miss, other=0)
    dest = tl.load(dest_ptr + pid * K + sel, mask=miss, other=0)
    pos = cid * C_SIZE + i
    half = tl.arange(0, HALF)
    acc1 = tl.zeros((BLOCK_T, HALF), tl.float32)
    acc2 = tl.zeros((BLOCK_T, HALF), tl.float32)
    u_rows = (b.to(tl.int64) * T_U + pos) * R
    sv_base = pid.to(tl.int64) * R * (2 * HALF)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        rin = rr < R
        u = tl.load(u_ptr + u_rows[:, None] + rr[None, :], mask=miss[:, None] & rin[None, :], other=0.0)
        sv_rows = sv_base + rr[:, None] * (2 * HALF)
        sv1 = tl.load(sv_ptr + sv_rows + half[None, :], mask=rin[:, None], other=0.0)
        sv2 = tl.load(sv_ptr + sv_rows + HALF + half[None, :], mask=rin[:, None], other=0.0)
        acc1 = mma(u, sv1, acc1)
        acc2 = mma(u, sv2, acc2)
    trow = pos.to(tl.int64)[:, None] * (2 * HALF)
    cos1 = tl.load(cos_ptr + trow + half[None, :], mask=miss[:, None], other=0.0)
    cos2 = tl.load(cos_ptr + trow + HALF + half[None, :], mask=miss[:, None], other=0.0)
    sin1 = tl.load(sin_ptr + trow + half[None, :], mask=miss[:, None], other=0.0)
    sin2 = tl.load(sin_ptr + trow + HALF + half[None, :], mask=miss[:, None], other=0.0)
    y1 = acc1 * cos1 - acc2 * sin1
    y2 = acc2 * cos2 + acc1 * sin2
    row = (pid.to(tl.int64) * N_TOTAL + SLOT_BASE + dest * C_SIZE + i) * (2 * HALF)
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + row[:, None] + half[None, :], y1.to(dt), mask=miss[:, None])
    tl.store(out_ptr + row[:, None] + HALF + half[None, :], y2.to(dt), mask=miss[:, None])


def block_shape(chunk_size: int, tokens: int = 32) -> tuple[int, int]:
    """(chunks per program, token rows per program): at least 16 rows (the dot's minimum), a power of two."""
    chunks = max(1, tokens // chunk_size)
    return chunks, max(16, triton.next_power_of_2(chunks * chunk_size))


def rebuild_keys(u: torch.Tensor, sv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ids: torch.Tensor,
                 dest: torch.Tensor, miss: torch.Tensor, out: torch.Tensor, slot_base: int, chunk_size: int) -> None:
    """Writes the keys of the missed selections into ``out`` (B, H, N_total, D) at rows
    ``slot_base + dest*c .. +c``. u (B, T, R), sv (B, H, R, D), cos/sin (>=T, D) fp32, ids/dest (B, H, K) int64,
    miss (B, H, K) bool."""
    B, H, K = ids.shape
    D = sv.shape[-1]
    chunks, block_t = block_shape(chunk_size)
    grid = (B * H, triton.cdiv(K, chunks))
    _rebuild_keys_kernel[grid](u, sv, cos, sin, ids, dest, miss.view(torch.int8), out,
                               u.shape[1], u.shape[2], H, K, out.shape[2], slot_base,
                               C_SIZE=chunk_size, CHUNKS=chunks, BLOCK_T=block_t, HALF=D // 2, BLOCK_R=32)
