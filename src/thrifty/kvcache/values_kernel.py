"""Value fetch: the kernel itself reads the rows of the missed chunks from host memory and writes them into
the reuse buffer's slots (on the GPU the host tensor is pinned and read over the link by the SMs, 2 KiB per
chunk for c=8, D=128 in bf16: no copy engine, no per-chunk memcpy). Under the interpreter the "host" tensor is
an ordinary CPU tensor. fp8 host values (e4m3, one fp32 scale per token and head) are dequantized on the way.
Same grid and miss handling as the key rebuild, which it overlaps on another stream on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rebuild_kernel import block_shape


@triton.jit
def _gather_values_kernel(src_ptr, scale_ptr, ids_ptr, dest_ptr, miss_ptr, out_ptr, T_SRC, H, K, N_TOTAL,
                          SLOT_BASE, C_SIZE: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_T: tl.constexpr,
                          D: tl.constexpr, HAS_SCALE: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.arange(0, BLOCK_T)
    sel = tl.program_id(1) * CHUNKS + t // C_SIZE
    live = (t < CHUNKS * C_SIZE) & (sel < K)
    miss = tl.load(miss_ptr + pid * K + sel, mask=live, other=0) != 0
    if tl.max(miss.to(tl.int32), 0) == 0:
        return
    i = t % C_SIZE
    cid = tl.load(ids_ptr + pid * K + sel, mask=miss, other=0)
    dest = tl.load(dest_ptr + pid * K + sel, mask=miss, other=0)
    src_tok = pid.to(tl.int64) * T_SRC + cid * C_SIZE + i
    d = tl.arange(0, D)
    x = tl.load(src_ptr + src_tok[:, None] * D + d[None, :], mask=miss[:, None], other=0.0).to(tl.float32)
    if HAS_SCALE:
        x = x * tl.load(scale_ptr + src_tok, mask=miss, other=0.0)[:, None]
    row = pid.to(tl.int64) * N_TOTAL + SLOT_BASE + dest * C_SIZE + i
    tl.store(out_ptr + row[:, None] * D + d[None, :], x.to(out_ptr.dtype.element_ty), mask=miss[:, None])


def gather_values(data: torch.Tensor, scale, ids: torch.Tensor, dest: torch.Tensor, miss: torch.Tensor,
                  out: torch.Tensor, slot_base: int, chunk_size: int) -> None:
    """data (B, H, T, D) host values (model dtype or fp8 with ``scale`` (B, H, T) fp32) -> rows of ``out``
    (B, H, N_total, D) at ``slot_base + dest*c``, for the missed selections only."""
    B, H, K = ids.shape
    D = data.shape[-1]
    chunks, block_t = block_shape(chunk_size)
    has_scale = scale is not None
    _gather_values_kernel[(B * H, triton.cdiv(K, chunks))](
        data, scale if has_scale else data, ids, dest, miss.view(torch.int8), out, data.shape[2], H, K,
        out.shape[2], slot_base, C_SIZE=chunk_size, CHUNKS=chunks, BLOCK_T=block_t, D=D, HAS_SCALE=has_scale)
