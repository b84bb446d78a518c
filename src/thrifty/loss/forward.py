"""Forward kernel: per valid row, log-sum-exp of the logits over the vocabulary, the target logit and (for
label smoothing) the sum of logits, computed tile by tile (BLOCK_N rows x BLOCK_V vocabulary entries, the dot
over D in BLOCK_D steps, fp32 accumulation); the N x V logits are never written.

The grid is (row blocks, vocabulary splits): each program reduces its share of V with an online max/sum and
writes one partial (max, sum, target logit, logit sum) per row; a tiny torch step merges the splits. Splitting V
keeps the GPU full when few rows are valid, and merging partials avoids apple's spin locks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import interpreting, mma, sm_count

NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity": exp(NEG_BIG - NEG_BIG) must not be NaN


@triton.jit
def _tanh(x):
    # tl has no tanh in 3.6; this form saturates correctly at +-1 (exp overflow gives 1 - 0)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def dot(a, b, acc):
    """mma for 16-bit inputs; fp32 inputs get an exact fp32 dot (as torch's default matmul precision), not tf32."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return mma(a, b, acc)


@triton.jit
def logit_tile(E, C, BIAS, e_rows, row_mask, vocab, col_mask, D, stride_e, stride_c, softcap,
               HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """fp32 logits (after bias and softcap) of rows ``e_rows`` against vocabulary entries ``vocab``."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + offs_d
        a = tl.load(E + e_rows[:, None] * stride_e + d[None, :], mask=row_mask[:, None] & (d[None, :] < D), other=0.0)
        b = tl.load(C + vocab[None, :] * stride_c + d[:, None], mask=col_mask[None, :] & (d[:, None] < D), other=0.0)
        acc = dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(BIAS + vocab, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_SOFTCAP:
        acc = softcap * _tanh(acc / softcap)
    return acc


@triton.jit
def _lse_forward_kernel(E, C, BIAS, ROWS, TGT, OUT, NV, V, D, stride_e, stride_c, v_per_split, softcap,
                        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    r = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = r < NV
    e_rows = tl.load(ROWS + r, mask=row_mask, other=0).to(tl.int64)  # int64: row * stride may pass 2**31
    tgt = tl.load(TGT + r, mask=row_mask, other=-1)
    m = tl.full((BLOCK_N,), NEG_BIG, tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    z_t = tl.zeros((BLOCK_N,), tl.float32)
    z_sum = tl.zeros((BLOCK_N,), tl.float32)
    v_start = pid_s * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < v_end
        z = logit_tile(E, C, BIAS, e_rows, row_mask, cols.to(tl.int64), col_mask, D, stride_e, stride_c, softcap,
                       HAS_BIAS, HAS_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_D)
        z_t += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        z_sum += tl.sum(tl.where(col_mask[None, :], z, 0.0), axis=1)
        z = tl.where(col_mask[None, :], z, NEG_BIG)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m = m_new
    out = OUT + pid_s * 4 * NV + r
    tl.store(out, m, mask=row_mask)
    tl.store(out + NV, s, mask=row_mask)
    tl.store(out + 2 * NV, z_t, mask=row_mask)
    tl.store(out + 3 * NV, z_sum, mask=row_mask)


# GPU: autotuned over the D step and pipeline depth (BLOCK_N x BLOCK_V stays 128 x 256: the host splits V by it)
_TUNED_CONFIGS = [triton.Config(dict(BLOCK_D=bd), num_warps=8, num_stages=st)
                  for bd, st in ((64, 3), (64, 4), (128, 2), (32, 5))]
_lse_forward_tuned = None if interpreting() else triton.autotune(_TUNED_CONFIGS, key=["D", "V"])(_lse_forward_kernel)


# fp32 inputs: their tiles take twice the shared memory of 16-bit ones (applied over forward_config on the GPU)
FP32_TILES = dict(BLOCK_V=128, num_stages=2)


def forward_config(interp: bool):
    if interp:
        return dict(BLOCK_N=16, BLOCK_V=32, BLOCK_D=16, num_warps=4, num_stages=1)
    return dict(BLOCK_N=128, BLOCK_V=256, BLOCK_D=64, num_warps=8, num_stages=3)


def lse_forward(e2d, c, bias, rows, targets, softcap, config=None):
    """Returns (lse, target logit, logit sum), each fp32 of shape (Nv,)."""
    nv, V, D = rows.numel(), c.shape[0], c.shape[1]
    cfg = dict(config or forward_config(interpreting()))
    if e2d.dtype == torch.float32 and not interpreting() and config is None:
        cfg.update(FP32_TILES)
    bn, bv = cfg["BLOCK_N"], cfg["BLOCK_V"]
    n_blocks = triton.cdiv(nv, bn)
    # enough programs for ~4 waves on the GPU, each with at least a few vocabulary tiles
    splits = max(1, min(triton.cdiv(4 * sm_count(e2d.device), max(n_blocks, 1)), triton.cdiv(V, 4 * bv)))
    v_per_split = triton.cdiv(triton.cdiv(V, splits), bv) * bv
    splits = triton.cdiv(V, v_per_split)
    out = torch.empty(splits, 4, nv, dtype=torch.float32, device=e2d.device)
    args = (e2d, c, c if bias is None else bias, rows, targets, out, nv, V, D, e2d.stride(0), c.stride(0),
            v_per_split, float(softcap or 1.0))
    flags = dict(HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None)
    if nv and config is None and _lse_forward_tuned is not None and e2d.dtype != torch.float32:
        _lse_forward_tuned[(n_blocks, splits)](*args, **flags, BLOCK_N=bn, BLOCK_V=bv)
    elif nv:
        _lse_forward_kernel[(n_blocks, splits)](*args, **flags, **cfg)
    return merge_partials(out)


# ---------------------------------------------------------------------------------------------------------------
# GEMM forward (training): the logits of a vocabulary chunk by cuBLAS (bf16/fp16 x -> fp32 out, tensor cores at
# cuBLAS speed) into a scratch that costs no memory -- the bytes of the dC buffer the backward must allocate
# anyway, allocated here and handed over -- then one memory-bound pass per row for the same statistics. At
# N=8192 the fused kernel above ran at 0.61-0.66 of the bf16 matmul ceiling; GEMM + pass measured 1.20x (256k
# vocabulary) and 1.31x (128k) faster on the H200 (NOTES.md "GEMM forward").

GEMM_ALIGN = 64  # chunk widths in columns: fp32 rows start 256-byte aligned


def gemm_min_cols(interp: bool) -> int:
    """Narrowest chunk the GEMM forward takes; below it the fused kernel is used (narrow chunks mean many small
    GEMMs and launches). The interpreter takes any width, so the CPU tests reach the multi-chunk path."""
    return GEMM_ALIGN if interp else 4096


def gemm_min_d(interp: bool) -> int:
    """Smallest hidden size the GEMM forward takes. Per logit the GEMM path adds an fp32 write and read (8 bytes,
    ~1.7 ps at 4.8 TB/s) and saves the fused kernel's tensor-core shortfall (~0.5 * 2D / 800 TFLOP/s): it pays
    from D ~ 1300 on, and measured (H200, 275b4a0, loss+grad against the fused forward in one run): 0.71-0.99x at
    D = 576, 0.95-0.98x at 896, 0.98-1.03x at 2048, 1.04-1.07x at 2304 and 4096."""
    return 1 if interp else 2048


def gemm_chunk_cols(scratch_bytes: int, nv: int, V: int) -> int:
    """Vocabulary columns per chunk of fp32 logits for ``nv`` rows in ``scratch_bytes``: all of V when it fits,
    else a multiple of GEMM_ALIGN; 0 when not even GEMM_ALIGN columns fit."""
    cols = scratch_bytes // max(4 * nv, 1)
    return V if cols >= V else cols // GEMM_ALIGN * GEMM_ALIGN


@triton.jit
def _row_stats_kernel(X, BIAS, TGT, OUT, cols, col0, NV, softcap,
                      HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    """One row of a chunk's fp32 logits (bias and softcap applied here): its max, sum of exp(z - max), target
    logit and sum of logits, as _lse_forward_kernel's partials."""
    row = tl.program_id(0)
    base = X + row.to(tl.int64) * cols
    tgt = tl.load(TGT + row) - col0
    m = tl.full((BLOCK,), NEG_BIG, tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    z_t = tl.zeros((BLOCK,), tl.float32)
    z_sum = tl.zeros((BLOCK,), tl.float32)
    for c0 in range(0, cols, BLOCK):
        j = c0 + tl.arange(0, BLOCK)
        inside = j < cols
        z = tl.load(base + j, mask=inside, other=0.0)
        if HAS_BIAS:
            z += tl.load(BIAS + col0 + j, mask=inside, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = softcap * _tanh(z / softcap)
        z_t += tl.where(j == tgt, z, 0.0)  # tgt outside [0, cols) matches no column of this chunk
        z_sum += tl.where(inside, z, 0.0)
        z = tl.where(inside, z, NEG_BIG)
        m_new = tl.maximum(m, z)
        s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
    m_row = tl.max(m, axis=0)
    out = OUT + row
    tl.store(out, m_row)
    tl.store(out + NV, tl.sum(s * tl.exp(m - m_row), axis=0))
    tl.store(out + 2 * NV, tl.sum(z_t, axis=0))
    tl.store(out + 3 * NV, tl.sum(z_sum, axis=0))


def _logits_into(x, e_valid, c_chunk):
    """x (nv x cur fp32) = e_valid @ c_chunk.T with fp32 accumulation and output."""
    if e_valid.dtype == torch.float32:
        torch.mm(e_valid, c_chunk.T, out=x)
    elif x.is_cuda:
        torch.mm(e_valid, c_chunk.T, out_dtype=torch.float32, out=x)
    else:  # the CPU has no 16-bit x 16-bit -> fp32 GEMM: the products are exact in fp32 either way
        torch.mm(e_valid.float(), c_chunk.float().T, out=x)


def lse_forward_gemm(e2d, c, bias, rows, targets, softcap, scratch: torch.Tensor):
    """lse_forward's result through GEMM chunks whose fp32 logits live in ``scratch`` (contiguous, any dtype;
    its bytes are overwritten). The caller checks gemm_min_d and gemm_chunk_cols(scratch bytes, ...) >= gemm_min_cols
    first."""
    nv, V = rows.numel(), c.shape[0]
    flat = scratch.view(-1).view(torch.uint8)
    cols = gemm_chunk_cols(flat.numel(), nv, V)
    x_all = flat[:flat.numel() // 4 * 4].view(torch.float32)
    e_valid = e2d if nv == e2d.shape[0] else e2d.index_select(0, rows)
    n_chunks = triton.cdiv(V, cols)
    out = torch.empty(n_chunks, 4, nv, dtype=torch.float32, device=e2d.device)
    block = 2048 if not interpreting() else 32
    for k in range(n_chunks):
        start = k * cols
        cur = min(cols, V - start)
        x = x_all[:nv * cur].view(nv, cur)
        _logits_into(x, e_valid, c[start:start + cur])
        _row_stats_kernel[(nv,)](x, c if bias is None else bias, targets, out[k], cur, start, nv,
                                 float(softcap or 1.0), HAS_BIAS=bias is not None,
                                 HAS_SOFTCAP=softcap is not None, BLOCK=block, num_warps=8 if block > 256 else 4)
    return merge_partials(out)


def merge_partials(out):
    """(lse, target logit, logit sum) from per-split partials (splits, 4, nv): max, sum of exp, z_t, z_sum."""
    m, s, z_t, z_sum = out.unbind(1)
    m_max = m.max(0).values
    lse = m_max + torch.log((s * torch.exp(m - m_max)).sum(0))
    return lse, z_t.sum(0), z_sum.sum(0)
