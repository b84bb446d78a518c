"""Filling the slots the reuse plan freed: key rebuild and value fetch in one launch, so that the two overlap.

Grid (sequence x KV head, 2 x blocks of ``CHUNKS`` slots); even programs rebuild keys, odd ones fetch values, so
the two kinds interleave in launch order and run side by side on the SMs (the fetch waits on the host link, the
rebuild on tensor cores). ``work[slot]`` (from the select kernel) is the chunk to write into a slot, -1 for a
hit or an unused slot; a block without work returns at once.

* Keys: the chunk's rows of U times the head's SV, as two half-width dots (``U @ SV[:, :D/2]``,
  ``U @ SV[:, D/2:]``) so that RoPE's rotate-half is a register operation (``y1 = x1 cos - x2 sin``,
  ``y2 = x2 cos + x1 sin``) at the chunk's original positions, with the model's own cos/sin table.
* Values: read from host memory by the kernel itself (pinned and mapped: 2 KiB per chunk for c=8, D=128 in
  bf16 over the link, no copy engine, no per-chunk memcpy); fp8 host values (e4m3, one fp32 scale per token
  and head) are dequantized on the way. Under the interpreter the host tensor is an ordinary CPU tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import mma

FILL_TOKENS = 32  # token rows per program (4 chunks of 8)
BLOCK_R = 32  # rank columns per dot of the key rebuild


@triton.jit
def _fill_slots_kernel(work_ptr, u_ptr, sv_ptr, cos_ptr, sin_ptr, kbuf_ptr, src_ptr, scale_ptr, vbuf_ptr,
                       T_U, R, K, N_TOTAL, SEL_BASE, T_SRC, H,
                       C_SIZE: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_T: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_R: tl.constexpr, HAS_SCALE: tl.constexpr):
    pid = tl.program_id(0)  # b * H + h
    role = tl.program_id(1) % 2
    t = tl.arange(0, BLOCK_T)
    slot = (tl.program_id(1) // 2) * CHUNKS + t // C_SIZE
    live = (t < CHUNKS * C_SIZE) & (slot < K)
    cid = tl.load(work_ptr + pid * K + slot, mask=live, other=-1)
    todo = cid >= 0
    if tl.max(todo.to(tl.int32), 0) == 0:
        return
    i = t % C_SIZE
    pos = cid * C_SIZE + i
    half = tl.arange(0, HALF)
    dest = (pid.to(tl.int64) * N_TOTAL + SEL_BASE + slot * C_SIZE + i) * (2 * HALF)
    if role == 0:
        acc1 = tl.zeros((BLOCK_T, HALF), tl.float32)
        acc2 = tl.zeros((BLOCK_T, HALF), tl.float32)
        u_rows = ((pid // H).to(tl.int64) * T_U + pos) * R
        sv_base = pid.to(tl.int64) * R * (2 * HALF)
        for r0 in range(0, R, BLOCK_R):
            rr = r0 + tl.arange(0, BLOCK_R)
            rin = rr < R
            u = tl.load(u_ptr + u_rows[:, None] + rr[None, :], mask=todo[:, None] & rin[None, :], other=0.0)
            sv_rows = sv_base + rr[:, None] * (2 * HALF)
            sv1 = tl.load(sv_ptr + sv_rows + half[None, :], mask=rin[:, None], other=0.0)
            sv2 = tl.load(sv_ptr + sv_rows + HALF + half[None, :], mask=rin[:, None], other=0.0)
            acc1 = mma(u, sv1, acc1)
            acc2 = mma(u, sv2, acc2)
        trow = pos.to(tl.int64)[:, None] * (2 * HALF)
        cos1 = tl.load(cos_ptr + trow + half[None, :], mask=todo[:, None], other=0.0)
        cos2 = tl.load(cos_ptr + trow + HALF + half[None, :], mask=todo[:, None], other=0.0)
        sin1 = tl.load(sin_ptr + trow + half[None, :], mask=todo[:, None], other=0.0)
        sin2 = tl.load(sin_ptr + trow + HALF + half[None, :], mask=todo[:, None], other=0.0)
        dt = kbuf_ptr.dtype.element_ty
        tl.store(kbuf_ptr + dest[:, None] + half[None, :], (acc1 * cos1 - acc2 * sin1).to(dt), mask=todo[:, None])
        tl.store(kbuf_ptr + dest[:, None] + HALF + half[None, :], (acc2 * cos2 + acc1 * sin2).to(dt),
                 mask=todo[:, None])
    else:
        d = tl.arange(0, 2 * HALF)
        src_tok = pid.to(tl.int64) * T_SRC + pos
        x = tl.load(src_ptr + src_tok[:, None] * (2 * HALF) + d[None, :], mask=todo[:, None], other=0.0)
        x = x.to(tl.float32)
        if HAS_SCALE:
            x = x * tl.load(scale_ptr + src_tok, mask=todo, other=0.0)[:, None]
        tl.store(vbuf_ptr + dest[:, None] + d[None, :], x.to(vbuf_ptr.dtype.element_ty), mask=todo[:, None])


def block_shape(chunk_size: int, tokens: int = FILL_TOKENS) -> tuple[int, int]:
    """(chunks per program, token rows per program): at least 16 rows (the dot's minimum), a power of two."""
    chunks = max(1, tokens // chunk_size)
    return chunks, max(16, triton.next_power_of_2(chunks * chunk_size))


def fill_slots(work: torch.Tensor, u: torch.Tensor, sv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               values: torch.Tensor, scale, k_out: torch.Tensor, v_out: torch.Tensor, sel_base: int,
               chunk_size: int) -> None:
    """For every slot with ``work[b, h, slot] = chunk >= 0``: the chunk's rebuilt keys into ``k_out`` and its
    values into ``v_out`` ((B, H, N_total, D), rows ``sel_base + slot*c .. +c``). u (B, T, R), sv (B, H, R, D),
    cos/sin (>= T, D) fp32, values (B, H, T, D) on the host (model dtype, or fp8 with ``scale`` (B, H, T) fp32),
    work (B, H, K) int32."""
    B, H, K = work.shape
    D = sv.shape[-1]
    chunks, block_t = block_shape(chunk_size)
    has_scale = scale is not None
    _fill_slots_kernel[(B * H, 2 * triton.cdiv(K, chunks))](
        work, u, sv, cos, sin, k_out, values, scale if has_scale else values, v_out,
        u.shape[1], u.shape[2], K, k_out.shape[2], sel_base, values.shape[2], H,
        C_SIZE=chunk_size, CHUNKS=chunks, BLOCK_T=block_t, HALF=D // 2, BLOCK_R=BLOCK_R, HAS_SCALE=has_scale)
