"""Backward kernels: dE and dC without an N x V buffer and without locked accumulation, with gradient filtering
and vocabulary sorting. See NOTES.md for the arithmetic behind the design.

Why not apple's one fused kernel: with D in the thousands neither a dE row block (BLOCK_N x D fp32) nor a dC
vocabulary block fits in registers, so a fused kernel must add partial products into global dE/dC from every
tile, under locks (apple) -- ~(V/BLOCK_V)*N*D + (N/BLOCK_N)*V*D read-modify-writes, its slow path on peaky logits.
Here the vocabulary (in sorted order) is processed in chunks of ``vc`` entries:

1. ``_grad_tile_kernel`` (grid rows x chunk tiles): recompute each logit tile, form the gradient
   g = w * (p*(1+2*z_loss*lse) - (1-ls)*onehot - ls/V) (times the softcap factor; w = upstream grad per row),
   zero it when every |unscaled g| < ``filter_eps``, write it to an Nv x vc buffer -- by default inside dC's rows
   not yet written (plan_chunks), so it costs no memory -- and append kept tiles to per-row and per-column work
   lists (atomics; only when the sparse GEMMs may run).
2. dC[chunk] = g^T @ E and dE += g @ C[chunk]: when most tiles of the chunk are kept, cuBLAS on the whole
   chunk (filtered tiles are zeros); otherwise ``_dc_kernel`` / ``_de_kernel``, Triton GEMMs that loop over the
   work lists only. Each vocabulary row lives in one chunk, so dC is written once, never accumulated; dE of
   16-bit inputs is summed in fp32 (in dC's free rows, or a separate scratch), fp32 dE in place.

With filtering, the vocabulary is first sorted by mean logit (exactly C @ mean(E) + bias, one GEMV, no atomics):
the tokens that ever get probability mass come first, so whole tiles and chunks elsewhere fall under the filter.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..triton_utils import interpreting
from .forward import dot, logit_tile
from .gluon_tile import gluon_tiles_ok, grad_tiles


@triton.jit
def _grad_tile_kernel(E, C, BIAS, ROWS, TGT, LSE, W, ORDER, G, DBIAS, CNT_DC, LIST_DC, CNT_DE, LIST_DE, CNT_ALL,
                      NV, D, stride_e, stride_c, stride_g, v_chunk_start, vc, n_vb, n_nb,
                      softcap, z_loss, onehot_weight, uniform_weight, filter_eps,
                      HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ORDER: tl.constexpr,
                      FILTER: tl.constexpr, NEED_DBIAS: tl.constexpr, SPLIT: tl.constexpr, LISTS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """One BLOCK_N x BLOCK_V logit tile (wide, for matmul efficiency); filtering and the work lists use
    SPLIT sub-tiles of BLOCK_V // SPLIT columns (narrow, so that more of them fall under the filter)."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    r = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = r < NV
    e_rows = tl.load(ROWS + r, mask=row_mask, other=0).to(tl.int64)
    tgt = tl.load(TGT + r, mask=row_mask, other=-1)
    lse = tl.load(LSE + r, mask=row_mask, other=0.0)
    j = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = j < vc
    if HAS_ORDER:
        vocab = tl.load(ORDER + v_chunk_start + j, mask=col_mask, other=0).to(tl.int64)
    else:
        vocab = (v_chunk_start + j).to(tl.int64)
    z = logit_tile(E, C, BIAS, e_rows, row_mask, vocab, col_mask, D, stride_e, stride_c, softcap,
                   HAS_BIAS, HAS_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_D)
    g = tl.exp(z - lse[:, None]) * (1.0 + 2.0 * z_loss * lse)[:, None]
    g = g - tl.where(vocab[None, :] == tgt[:, None], onehot_weight, 0.0) - uniform_weight
    if HAS_SOFTCAP:
        zc = z / softcap
        g = g * (1.0 - zc * zc)
    g = tl.where(row_mask[:, None] & col_mask[None, :], g, 0.0)
    in_first = (tl.arange(0, BLOCK_V) < BLOCK_V // SPLIT)[None, :]
    if FILTER:
        # filter on the unscaled gradient (|g| <= 1 + ...); a NaN tile is kept: NaN in, NaN grads out
        keep0 = _tile_matters(tl.where(in_first, g, 0.0), filter_eps)
        keep1 = keep0
        if SPLIT == 2:
            keep1 = _tile_matters(tl.where(in_first, 0.0, g), filter_eps)
        g = tl.where(tl.where(in_first, keep0, keep1), g, 0.0)
    else:
        keep0 = True
        keep1 = True
    # scaled by the upstream grad here (bf16 has fp32's range: no underflow), so the GEMMs are plain GEMMs
    g = g * tl.load(W + r, mask=row_mask, other=0.0)[:, None]
    # always written (zeros when filtered): a dense cuBLAS pass may read every tile
    tl.store(G + r[:, None].to(tl.int64) * stride_g + j[None, :], g.to(G.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])
    if NEED_DBIAS:
        tl.atomic_add(DBIAS + vocab, tl.sum(g, axis=0), mask=col_mask)
    if LISTS:  # only the sparse GEMMs read the work lists
        if keep0:
            _append(pid_n, pid_v * SPLIT, CNT_DC, LIST_DC, CNT_DE, LIST_DE, CNT_ALL, n_vb, n_nb)
        if SPLIT == 2:
            if (pid_v * SPLIT + 1) * (BLOCK_V // SPLIT) < vc:  # the second half exists in this chunk
                if keep1:
                    _append(pid_n, pid_v * SPLIT + 1, CNT_DC, LIST_DC, CNT_DE, LIST_DE, CNT_ALL, n_vb, n_nb)


@triton.jit
def _tile_matters(g, filter_eps):
    big = tl.max(tl.max(tl.abs(g), axis=1), axis=0) >= filter_eps
    nan = tl.sum(tl.sum((g != g).to(tl.int32), axis=1), axis=0) > 0
    return big | nan


@triton.jit
def _append(pid_n, sub_v, CNT_DC, LIST_DC, CNT_DE, LIST_DE, CNT_ALL, n_vb, n_nb):
    """Work lists for the sparse GEMMs: they loop over kept tiles only, with no branch in the loop (a branch
    stops Triton's software pipelining). Slot order is whatever the atomics give: the fp32 sums in dC/dE may
    differ in the last bits from run to run."""
    slot = tl.atomic_add(CNT_DC + sub_v, 1)
    tl.store(LIST_DC + sub_v * n_nb + slot, pid_n)
    slot = tl.atomic_add(CNT_DE + pid_n, 1)
    tl.store(LIST_DE + pid_n * n_vb + slot, sub_v)
    tl.atomic_add(CNT_ALL, 1)


@triton.jit
def _dc_kernel(G, CNT_DC, LIST_DC, E, ROWS, ORDER, DC, NV, D, stride_e, stride_g, stride_dc,
               v_chunk_start, vc, n_nb, HAS_ORDER: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_v = tl.program_id(0)
    pid_d = tl.program_id(1)
    j = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = j < vc
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < D
    acc = tl.zeros((BLOCK_V, BLOCK_D), dtype=tl.float32)
    for k in range(0, tl.load(CNT_DC + pid_v)):
        nb = tl.load(LIST_DC + pid_v * n_nb + k)
        r = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = r < NV
        g = tl.load(G + r[:, None].to(tl.int64) * stride_g + j[None, :],
                    mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        e_rows = tl.load(ROWS + r, mask=row_mask, other=0).to(tl.int64)
        e = tl.load(E + e_rows[:, None] * stride_e + d[None, :], mask=row_mask[:, None] & d_mask[None, :],
                    other=0.0)
        acc = dot(tl.trans(g.to(e.dtype)), e, acc)
    if HAS_ORDER:
        vocab = tl.load(ORDER + v_chunk_start + j, mask=col_mask, other=0).to(tl.int64)
    else:
        vocab = (v_chunk_start + j).to(tl.int64)
    tl.store(DC + vocab[:, None] * stride_dc + d[None, :], acc.to(DC.dtype.element_ty),
             mask=col_mask[:, None] & d_mask[None, :])


@triton.jit
def _de_kernel(G, CNT_DE, LIST_DE, C, ORDER, ROWS, DE, NV, D, stride_c, stride_g, stride_de, v_chunk_start, vc,
               n_vb, HAS_ORDER: tl.constexpr, DE_BY_ROW: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_d = tl.program_id(1)
    r = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = r < NV
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < D
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    n_active = tl.load(CNT_DE + pid_n)
    for k in range(0, n_active):
        vb = tl.load(LIST_DE + pid_n * n_vb + k)
        j = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        col_mask = j < vc
        if HAS_ORDER:
            vocab = tl.load(ORDER + v_chunk_start + j, mask=col_mask, other=0).to(tl.int64)
        else:
            vocab = (v_chunk_start + j).to(tl.int64)
        g = tl.load(G + r[:, None].to(tl.int64) * stride_g + j[None, :],
                    mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        c = tl.load(C + vocab[:, None] * stride_c + d[None, :], mask=col_mask[:, None] & d_mask[None, :],
                    other=0.0)
        acc = dot(g.to(c.dtype), c, acc)
    if n_active > 0:
        if DE_BY_ROW:
            out_rows = tl.load(ROWS + r, mask=row_mask, other=0).to(tl.int64)
        else:
            out_rows = r.to(tl.int64)
        ptr = DE + out_rows[:, None] * stride_de + d[None, :]
        mask = row_mask[:, None] & d_mask[None, :]
        old = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptr, (old + acc).to(DE.dtype.element_ty), mask=mask)


# fp32 inputs: their tiles take twice the shared memory of 16-bit ones (applied over any config on the GPU)
FP32_TILES = dict(BLOCK_D_DC=64, BLOCK_D_DE=64, num_stages=2)


def backward_config(interp: bool):
    if interp:
        return dict(BLOCK_N=16, BLOCK_V=16, SPLIT=2, BLOCK_D_TILE=16, BLOCK_D_DC=16, BLOCK_D_DE=16, num_warps=4,
                    num_stages=1)
    # BLOCK_V: the sparse GEMMs' tile and the filter's granularity; the tile kernel computes SPLIT of them at once
    return dict(BLOCK_N=128, BLOCK_V=128, SPLIT=2, BLOCK_D_TILE=64, BLOCK_D_DC=128, BLOCK_D_DE=128, num_warps=8,
                num_stages=3)


def default_filter_eps(dtype: torch.dtype) -> float:
    """apple's choice: eps/32 of the gradient dtype. A dropped element is < 1/32 of the spacing of 1.0 in that
    dtype; since the row's total |g| is 2*(1-p_t) <= 2 and bf16 dE/dC already round at eps/2 relative, the
    dropped mass sits below the output's own rounding except for rows whose gradient is nearly zero."""
    return torch.finfo(dtype).eps / 32


def vocab_order(e2d, c, bias, rows) -> torch.Tensor:
    """Vocabulary sorted by mean logit over the valid rows, descending. The mean of a linear map is the map of
    the mean, so this is one GEMV: C @ mean(E) (+ bias). Softcap is monotone, so it does not change the order."""
    weights = torch.zeros(e2d.shape[0], dtype=torch.float32, device=e2d.device)
    weights[rows] = 1.0 / max(rows.numel(), 1)
    e_mean = (weights @ e2d.float()) if e2d.device.type == "cpu" else torch.mv(e2d.T, weights.to(e2d.dtype)).float()
    key = torch.mv(c, e_mean.to(c.dtype)).float()
    if bias is not None:
        key = key + bias.float()
    return torch.argsort(key, descending=True).to(torch.int32)


def _dense_de_update(de_acc, g, c_chunk):
    """de_acc += g @ c_chunk with fp32 accumulation where cuBLAS offers it (bf16 inputs, fp32 output)."""
    if de_acc.dtype == g.dtype:
        de_acc.addmm_(g, c_chunk)
    elif de_acc.is_cuda:
        torch.addmm(de_acc, g, c_chunk, out_dtype=de_acc.dtype, out=de_acc)
    else:
        de_acc += (g.float() @ c_chunk.float())


@triton.jit
def _round_halves_kernel(LEFT, RIGHT, OUT, H, D, stride_right, BLOCK: tl.constexpr):
    """Row r of the 16-bit dE from the fp32 accumulator's halves: columns [0, H) from LEFT, [H, D) from RIGHT.
    LEFT's row r may occupy exactly OUT's row r bytes (the left half lives in dE's own buffer), so the whole
    row is loaded before the barrier and stored after it; rows never share bytes, so programs are independent."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    left = tl.load(LEFT + row * H + d, mask=d < H, other=0.0)
    right = tl.load(RIGHT + row * stride_right + tl.maximum(d - H, 0), mask=(d >= H) & (d < D), other=0.0)
    x = tl.where(d < H, left, right)
    tl.debug_barrier()
    tl.store(OUT + row * D + d, x.to(OUT.dtype.element_ty), mask=d < D)


class _FP32Accumulator:
    """dE of 16-bit inputs summed in fp32 (nv x D x 4 bytes) without a buffer of that size: its first ``left``
    columns live in dE's own bytes (an nv x D 16-bit buffer holds nv x D/2 fp32 exactly, row for row), the
    other D - left columns in ``right`` (dC's free rows or a separate buffer). left = 0 (whole accumulator in
    ``right``) or D/2; each contribution is then one GEMM per (part, first column) of ``parts``."""

    def __init__(self, de_c: torch.Tensor, right: torch.Tensor, left: int):
        self.de_c, self.right, self.left = de_c, right, left
        self.parts = [(right, 0)]
        if left:
            self.parts = [(de_c.view(torch.float32), 0), (right, left)]
        for acc, _ in self.parts:
            acc.zero_()

    def round_into_de(self):
        """dE (16-bit, compact rows) = the fp32 sum, rounded once. The accumulator is gone afterwards."""
        nv, D = self.de_c.shape
        if not self.left:
            self.de_c.copy_(self.right)
        elif nv:
            block = triton.next_power_of_2(D)
            _round_halves_kernel[(nv,)](self.parts[0][0], self.right, self.de_c, self.left, D,
                                        self.right.stride(0), BLOCK=block,
                                        num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)
        self.parts = []


# separate gradient-tile buffer once dC's free rows are too few. Budget (issue #3): 1% of the bound dE + dC, or
# 16 MB where 1% is less: 8 MiB fits 1% from ~0.9 GiB up (256k: 11.6 MiB); smaller shapes get 12 MiB (< 15.26 MiB)
TAIL_BYTES = 8 << 20
SMALL_TAIL_BYTES = 12 << 20
SEPARATE_BYTES = 64 << 20  # gradient-tile buffer when dC cannot host it (sorted vocabulary, or no dC wanted)
# kept-tile fraction of a chunk above which its dE/dC GEMMs go to cuBLAS over the whole chunk (filtered tiles are
# zeros there), below it to the sparse Triton GEMMs over the kept tiles (v2, NOTES.md)
DENSE_ABOVE = 0.3
ALIGN = 64  # elements: scratch views in dC start 128-byte aligned (bf16) for cuBLAS


def _fit(s, V, D, nv, step, limit, align=ALIGN):
    """Largest chunk (a multiple of ``step``, or the whole rest V - s) starting at vocabulary row s whose
    gradient tiles (nv x cur elements) fit in dC's flat storage between the end of the chunk's own rows and
    ``limit``: align_up((s+cur)*D) + nv*cur <= limit. 0 when not even one step fits."""
    cur = max(0, (limit - s * D - align) // (nv + D))
    if cur >= V - s:
        return V - s
    return cur // step * step


def plan_chunks(V, D, nv, step, buf_cols, acc_elems, align=ALIGN):
    """The vocabulary chunks of the in-place schedule: [(start, cur, g_off or None, flush_before, mode)], and the
    accumulator's flat offset in dC (None when there is none).

    dC (V x D, contiguous) is written chunk by chunk in vocabulary order, so its rows after the current chunk
    are free: the chunk's gradient tiles live there (g_off: flat element offset) and, when ``acc_elems`` > 0,
    the fp32 dE accumulator too, at the very end of dC (it needs 2*nv rows of a 16-bit dC). Chunks shrink as
    the free region does (cur ~ (free rows) * D / (nv + D)); mode "both" computes dC and dE of the chunk.
    Once the room ahead of the accumulator is too small for ``buf_cols`` columns, the rest of the vocabulary
    is done twice so that all of dE is summed in fp32: first dE only (mode "de", tiles in the separate buffer
    of buf_cols columns, g_off None), then the accumulator is rounded into dE once (flush_before on the next
    chunk) and the logit tiles of the rest are recomputed for dC only (mode "dc", tiles in the rows the
    accumulator freed). Accumulating those last chunks into bf16 dE instead biases the gradient (small
    contributions are rounded away: 2.8% error on a sum over tokens of dE for a 7% bf16 tail, measured on a
    trained model; NOTES.md v7). Without an accumulator every chunk is "both"; when dC's whole free region is
    smaller than ``buf_cols`` columns, the rest goes through the separate buffer."""
    total = V * D
    acc_off = (total - acc_elems) // align * align if acc_elems else total
    accumulating = acc_elems > 0 and acc_off > 0 and _fit(0, V, D, nv, step, acc_off, align) >= min(buf_cols, V)
    plan, s = [], 0
    while s < V:
        if accumulating:
            cur = _fit(s, V, D, nv, step, acc_off, align)
            if cur < buf_cols:  # room ahead of the accumulator too small: dE of the rest, flush, dC of the rest
                rest = s
                while s < V:
                    cur = min(buf_cols, V - s)
                    plan.append((s, cur, None, False, "de"))
                    s += cur
                s, first = rest, True
                while s < V:
                    cur = _fit(s, V, D, nv, step, total, align)
                    if cur >= min(buf_cols, V - s) and cur > 0:
                        plan.append((s, cur, -(-(s + cur) * D // align) * align, first, "dc"))
                    else:
                        cur = min(buf_cols, V - s)
                        plan.append((s, cur, None, first, "dc"))
                    s, first = s + cur, False
                return plan, acc_off
        else:
            cur = _fit(s, V, D, nv, step, total, align)
        if cur >= min(buf_cols, V - s) and cur > 0:
            plan.append((s, cur, -(-(s + cur) * D // align) * align, False, "both"))
        else:
            cur = min(buf_cols, V - s)
            plan.append((s, cur, None, False, "both"))
        s += cur
    # an accumulator that covered the whole vocabulary still holds dC's last rows: not possible (it sits in
    # them), so a plan that accumulates always ends with the "de"/"dc" pass above; none placed: no accumulator
    return plan, None


def recomputed_fraction(plan, V) -> float:
    """Share of the vocabulary whose logit tiles the plan computes twice (the "de" chunks)."""
    return sum(cur for _, cur, _, _, mode in plan if mode == "de") / max(V, 1)


# The two-pass ending of plan_chunks costs a second logit pass over its share of the vocabulary (in small
# chunks); above this share the accumulator (or the part of it dC cannot host) gets a separate buffer.
MAX_RECOMPUTED = 0.25


def in_dc_plan(V, D, nv, step, buf_cols, fp32_acc: bool):
    """(plan, acc_off, left) of the in-dC schedule. With an fp32 dE accumulator (16-bit inputs) and even D, the
    accumulator's left half (left = D/2 columns) lives in dE's own bytes and only its right half in dC's last nv
    rows: the two-pass ending then recomputes about half the vocabulary the whole accumulator would (measured
    1-4% faster at every benchmark shape, NOTES v9b, for a second GEMM per dE update). Odd D has no such half:
    the whole accumulator in dC's last 2*nv rows (left = 0). Either placement is taken when its ending
    recomputes at most MAX_RECOMPUTED of the vocabulary, else acc_off is None (the part not in dE gets a
    separate buffer)."""
    if not fp32_acc:
        return (*plan_chunks(V, D, nv, step, buf_cols, 0), 0)
    left = D // 2 if D % 2 == 0 else 0
    plan, acc_off = plan_chunks(V, D, nv, step, buf_cols, 2 * nv * (D - left))
    if acc_off is not None and recomputed_fraction(plan, V) <= MAX_RECOMPUTED:
        return plan, acc_off, left
    return plan_chunks(V, D, nv, step, buf_cols, 0)[0], None, left


def linear_ce_backward(e2d, c, bias, rows, targets, lse, w, *, softcap: Optional[float], label_smoothing: float,
                       z_loss: float, filter_eps: Optional[float], need_e: bool = True, need_c: bool = True,
                       scratch_in_dc: bool = True, dc: Optional[torch.Tensor] = None, tiles: str = "auto"):
    """Returns (dE shaped like e2d or None, dC or None, dbias or None). ``w``: fp32 upstream grad per valid row.
    ``filter_eps``: None (exact) or the tile-skip threshold; filtering sorts the vocabulary (vocab_order).

    Per vocabulary chunk, after the gradient-tile kernel, the fraction of kept tiles picks the GEMMs: above
    DENSE_ABOVE cuBLAS on the whole chunk (fast when most tiles matter), else the Triton kernels that visit
    kept tiles only (filtering only; the count is read without a sync, see _KeptTiles).

    Memory (``scratch_in_dc``, the default; not with a sorted vocabulary): the gradient tiles and the fp32 dE
    accumulator live in dC's not-yet-written rows (plan_chunks), so the extra memory is one small buffer
    (TAIL_BYTES, or SMALL_TAIL_BYTES for small shapes) for the last chunks; otherwise a SEPARATE_BYTES tile
    buffer. dE is accumulated in compact valid-row order in dE's own first nv rows and spread to the token rows
    at the end when tokens are ignored. ``dc``: the dC buffer when the forward allocated it already (c's shape,
    contiguous; its contents are overwritten). ``tiles``: "auto" (the Gluon tile kernel where
    ``gluon_tile.gluon_tiles_ok`` allows it) or "triton" (``_grad_tile_kernel`` always).
    """
    N, D = e2d.shape
    V = c.shape[0]
    nv = rows.numel()
    cfg = dict(backward_config(interpreting()))
    if e2d.dtype == torch.float32 and not interpreting():
        cfg.update(FP32_TILES)
    bn, bv, split = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_V"), cfg.pop("SPLIT", 1)
    bd_tile, bd_dc, bd_de = cfg.pop("BLOCK_D_TILE"), cfg.pop("BLOCK_D_DC"), cfg.pop("BLOCK_D_DE")
    need_b = bias is not None and need_c
    de = torch.zeros(N, D, dtype=e2d.dtype, device=e2d.device) if need_e else None
    if need_c and dc is None:
        dc = torch.empty_like(c)
    elif not need_c:
        dc = None
    db = torch.zeros(V, dtype=torch.float32, device=c.device) if need_b else None
    if nv == 0:
        return de, (dc.zero_() if need_c else None), (db.to(bias.dtype) if need_b else None)
    # label smoothing puts -ls/V on every element: filtering would drop it systematically, so it is off then
    filtering = filter_eps is not None and label_smoothing == 0.0
    order = vocab_order(e2d, c, bias, rows) if filtering else None  # sorting only helps filtering
    # fp16 gradients scaled by 1/N would underflow: fp16 inputs get a bf16 buffer (same size, fp32's range)
    g_dtype = {torch.float32: torch.float32}.get(e2d.dtype, torch.bfloat16)
    elem = torch.finfo(g_dtype).bits // 8
    step = bv * split
    # dC's free rows can hold the tiles only if dC is written in vocabulary order (no sorting) and has the
    # tiles' element size (always: fp32 -> fp32, bf16/fp16 -> bf16)
    in_dc = scratch_in_dc and need_c and order is None and c.element_size() == elem and dc.is_contiguous()
    if in_dc:
        bound = (N + V) * D * e2d.element_size()  # dE + dC: what must be allocated anyway
        tile_bytes = TAIL_BYTES if bound // 100 >= TAIL_BYTES + (1 << 20) else SMALL_TAIL_BYTES
    else:
        tile_bytes = SEPARATE_BYTES
    buf_cols = min(max(step, (tile_bytes // max(nv * elem, 1)) // step * step), triton.cdiv(V, step) * step)
    # fp32 dE accumulation (16-bit inputs): in dC's free rows (in_dc) or a separate nv x D fp32 scratch
    fp32_acc = need_e and e2d.dtype != torch.float32
    if in_dc:
        plan, acc_off, left = in_dc_plan(V, D, nv, step, buf_cols, fp32_acc)
    else:
        plan = [(s, min(buf_cols, V - s), None, False, "both") for s in range(0, V, buf_cols)]
        acc_off, left = None, 0
    vc = max(p[1] for p in plan)
    buf = None
    n_nb, n_vb = triton.cdiv(nv, bn), triton.cdiv(vc, bv)
    n_chunks = len(plan)
    counts = torch.zeros(n_chunks, n_vb + n_nb + 1, dtype=torch.int32, device=e2d.device)  # dC | dE | all
    list_dc = torch.empty(n_vb, n_nb, dtype=torch.int32, device=e2d.device)
    list_de = torch.empty(n_nb, n_vb, dtype=torch.int32, device=e2d.device)
    de_c = de[:nv] if need_e else None  # compact: row i is valid token rows[i] (spread at the end)
    acc = None
    de_parts = [(de_c, 0)]  # (target, first column of C) of each dE GEMM; fp32 inputs: dE in place
    if fp32_acc:
        if acc_off is not None:
            right = dc.view(-1)[acc_off:acc_off + 2 * nv * (D - left)].view(torch.float32).view(nv, D - left)
        else:  # no dC, a sorted vocabulary, or dC too small to host it
            right = torch.empty(nv, D - left, dtype=torch.float32, device=e2d.device)
        acc = _FP32Accumulator(de_c, right, left)
        de_parts = acc.parts
    order_arg = order if order is not None else rows  # any int tensor; unused when HAS_ORDER is False
    # work lists only for the sparse GEMMs: with filtering, or when cuBLAS cannot take the tiles (fp16 inputs)
    lists = filtering or g_dtype != e2d.dtype or DENSE_ABOVE >= 1.0
    # the Gluon kernel writes the tiles only (no work lists, no dbias): the dense path, every tile kept
    gluon = not lists and gluon_tiles_ok(e2d, c, bias=bias, filtering=filtering, order=order, g_dtype=g_dtype,
                                         tiles=tiles)
    dc_flat = dc.view(-1).view(g_dtype) if in_dc else None  # per-chunk views: one as_strided (launch-bound shapes)
    cnt_dc = cnt_de = cnt_all = counts  # placeholders when no lists are kept
    e_valid = None  # the valid rows of e, for the dense path (a view when no token is ignored)
    progress = _KeptTiles(n_chunks, e2d.device)
    for chunk, (start, cur, g_off, flush, mode) in enumerate(plan):
        if flush and acc is not None:  # its rows of dC come next: round it into dE (once)
            acc.round_into_de()
            acc = None
        do_c, do_e = need_c and mode != "de", need_e and mode != "dc"
        if g_off is not None:
            g_buf = dc_flat.as_strided((nv, cur), (cur, 1), g_off)
        else:
            if buf is None:
                buf = torch.empty(nv * buf_cols, dtype=g_dtype, device=e2d.device)
            g_buf = buf.as_strided((nv, cur), (cur, 1))
        if lists:
            cnt_dc, cnt_de, cnt_all = counts[chunk, :n_vb], counts[chunk, n_vb:-1], counts[chunk, -1:]
        if gluon:
            if e_valid is None:
                e_valid = e2d if nv == N else e2d.index_select(0, rows)
            grad_tiles(e_valid, c[start:start + cur], targets, lse, w, g_buf, v_start=start, softcap=softcap,
                       z_loss=z_loss, onehot_weight=1.0 - label_smoothing, uniform_weight=label_smoothing / V)
        else:
            _grad_tile_kernel[(n_nb, triton.cdiv(cur, step))](
                e2d, c, c if bias is None else bias, rows, targets, lse, w, order_arg, g_buf, db if need_b else w,
                cnt_dc, list_dc, cnt_de, list_de, cnt_all,
                nv, D, e2d.stride(0), c.stride(0), g_buf.stride(0), start, cur, n_vb, n_nb,
                float(softcap or 1.0), float(z_loss), 1.0 - label_smoothing, label_smoothing / V,
                float(filter_eps or 0.0), HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
                HAS_ORDER=order is not None, FILTER=filtering, NEED_DBIAS=need_b and mode != "dc", SPLIT=split,
                LISTS=lists,
                BLOCK_N=bn, BLOCK_V=step,
                BLOCK_D=bd_tile, **cfg)
        n_tiles = n_nb * triton.cdiv(cur, bv)
        kept = progress.kept(chunk, cnt_all, n_tiles) if filtering else n_tiles
        vocab_chunk = order[start:start + cur].long() if order is not None else None
        if kept == 0:  # nothing above the filter in the whole chunk: dC rows are zero, dE unchanged
            if do_c:
                if vocab_chunk is None:
                    dc[start:start + cur].zero_()
                else:
                    dc.index_fill_(0, vocab_chunk, 0)
            continue
        if kept > DENSE_ABOVE * n_tiles and g_dtype == e2d.dtype:
            g = g_buf
            if do_c:
                if e_valid is None:
                    e_valid = e2d if nv == N else e2d.index_select(0, rows)
                if vocab_chunk is None:
                    torch.mm(g.T, e_valid, out=dc[start:start + cur])
                else:
                    dc.index_copy_(0, vocab_chunk, torch.mm(g.T, e_valid))
            if do_e:
                c_chunk = c[start:start + cur] if vocab_chunk is None else c.index_select(0, vocab_chunk)
                for target, col in de_parts:
                    _dense_de_update(target, g, c_chunk[:, col:col + target.shape[1]])
            continue
        if do_c:
            _dc_kernel[(triton.cdiv(cur, bv), triton.cdiv(D, bd_dc))](
                g_buf, cnt_dc, list_dc, e2d, rows, order_arg, dc, nv, D, e2d.stride(0),
                g_buf.stride(0), dc.stride(0), start, cur, n_nb, HAS_ORDER=order is not None,
                BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd_dc, **cfg)
        if do_e:
            for target, col in de_parts:
                width = target.shape[1]  # the accumulator's column part [col, col + width)
                _de_kernel[(n_nb, triton.cdiv(width, bd_de))](
                    g_buf, cnt_de, list_de, c[:, col:], order_arg, rows, target, nv, width, c.stride(0),
                    g_buf.stride(0), target.stride(0), start, cur, n_vb, HAS_ORDER=order is not None,
                    DE_BY_ROW=False, BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd_de, **cfg)
    del buf
    if need_e:
        if acc is not None:
            acc.round_into_de()
            del acc
        if nv < N:
            _spread_rows(de, rows)
    return de, dc, (db.to(bias.dtype) if need_b else None)


def _spread_rows(de, rows, block=1024):
    """In place: compact row i of ``de`` moves to row rows[i] (rows strictly increasing, so rows[i] >= i), the
    other rows become zero. Blocks go from the end, each through a small copy: a block's targets never hit a
    compact row still to be moved (they are >= the block's own first row) nor a row already placed."""
    nv = rows.numel()
    valid = torch.zeros(de.shape[0], dtype=torch.bool, device=de.device)
    valid[rows.long()] = True
    for hi in range(nv, 0, -block):
        lo = max(0, hi - block)
        de.index_copy_(0, rows[lo:hi].long(), de[lo:hi].clone())
    de[~valid] = 0


class _KeptTiles:
    """How many tiles of a chunk passed the filter, without stalling the GPU: on CUDA each chunk's count is
    copied to pinned memory behind an event and the newest finished chunk's fraction is used (with sorted
    vocabulary it changes slowly from chunk to chunk). Either GEMM path is correct whatever the count; only
    speed depends on it. On the CPU (interpreter) the exact count is read, and an empty chunk is skipped."""

    def __init__(self, n_chunks, device):
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(n_chunks, dtype=torch.int32, pin_memory=self.cuda)
        self.tiles = [1] * n_chunks
        self.events = []
        self.done = -1

    def kept(self, chunk, cnt_all, n_tiles):
        if not self.cuda:
            return int(cnt_all.item())
        self.host[chunk:chunk + 1].copy_(cnt_all, non_blocking=True)
        self.tiles[chunk] = n_tiles
        ev = torch.cuda.Event()
        ev.record()
        self.events.append(ev)
        while self.done + 1 < chunk and self.events[self.done + 1].query():
            self.done += 1
        if self.done < 0:
            return n_tiles  # nothing known yet: dense (correct either way); never the "skip" value 0
        return max(1, round(int(self.host[self.done]) / self.tiles[self.done] * n_tiles))
