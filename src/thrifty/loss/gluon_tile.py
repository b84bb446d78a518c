"""The CCE backward's gradient tiles as a persistent, warp-specialized Gluon kernel for Hopper (sm_90, issue #32).

Same output as ``backward._grad_tile_kernel`` on its dense path (bf16 E and C, no bias, no filtering or sorted
vocabulary): per vocabulary chunk, g = w·[exp(z − lse)·(1 + 2·z_loss·lse) − onehot_weight·[col = tgt] −
uniform_weight]·(1 − (z/softcap)² with a softcap, z = softcap·tanh(E·Cᵀ/softcap) then) as bf16 into the chunk's
gradient buffer, columns/rows past ``cur``/``nv`` untouched. The Triton kernel runs the same tiles at ~0.69 of a
cuBLAS matmul: its epilogue (exp, compares, a 64 KB store per tile) stalls the tensor cores, and its grid
relaunches per tile. Here (NOTES.md "The Gluon gradient-tile kernel"):

* one program per SM walks the chunk's tiles (``_tile_coords``: grouped order, a wave of programs covers a band of
  ``GROUP_ROWS`` rows of E and a few vocabulary tiles, so each C tile comes from HBM once per band and the band of
  E stays in L2);
* a 1-warp producer partition issues the TMA loads (E rows and C rows, both K-major, zero-filled past the edges)
  into a ``STAGES``-deep shared-memory ring;
* two consumer warpgroups issue the ``wgmma`` and run the epilogue straight from the accumulator registers,
  cooperatively: both work on every 128 x 256 tile, one 64-row half each. (A ping-pong schedule, alternate
  128 x 128 tiles per warpgroup with one's epilogue under the other's MMAs, measured 15–35% slower on the H100 and
  was removed: NOTES.md.)
* each warpgroup hands its bf16 half-tile to a TMA store through its own shared-memory buffer
  (``tma_store``): the copy to HBM runs while the warpgroup starts the next tile's MMAs, where ``gl.store`` from
  the accumulator layout kept it in the epilogue (the same mainloop without the store, the LSE forward, runs
  2.5 ms faster per vocabulary at 256k). Softcapped tiles and rows not 16-byte aligned keep ``gl.store``.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..triton_utils import cdiv, interpreting, sm_count

# Rows of E one wave shares (the band of the grouped tile order): 2048 rows are 9.4 MB at D=2304, 16.8 MB at
# D=4096, which stay in L2 (50 MB) beside the wave's C tiles while the band sweeps the chunk.
GROUP_ROWS = 2048

# block_m: rows per consumer warpgroup (its accumulator is block_m x block_n fp32: 128 registers per thread at
# 64 x 256); a tile is HALVES * block_m rows; stages of 48 KB (two 64-row E blocks and one 256-row C block of 64
# columns); tma_store: the gradient leaves through a 32 KB shared buffer per warpgroup and a TMA store, so the
# ring keeps 3 stages (144 + 64 KB of the 227 KB; 4 without the buffers); the consumers get 240 registers each,
# the producer 24.
TILE_CONFIG = dict(block_m=64, block_n=256, block_k=64, stages=3, consumer_regs=240, producer_regs=24, num_warps=4,
                   tma_store=True)
# Softcapped tiles: the two-pass epilogue keeps the other column half live beside z and g, which spills 272 B
# at 64 x 256; 64 x 128 per warpgroup (64 accumulator registers) fits, and 6 stages of 32 KB keep the same
# ~192 KB of loads in flight (Gemma-2 caps its logits at 30: the paper's 256k shape). Its even/odd column halves
# are not boxes a TMA store can take, so it stores from registers.
SOFTCAP_TILE_CONFIG = dict(TILE_CONFIG, block_n=128, stages=6, tma_store=False)
HALVES = 2  # consumer warpgroups, each on its own row half of every tile

launch_count = 0  # Gluon tile launches in this process: tests read it to see which kernel a backward took
tma_store_count = 0  # of which stored the gradient by TMA: tests read it to see that path ran


@gluon.jit
def _tanh(x):
    # the Triton path's form (forward._tanh), so that softcapped logits round alike
    return 1.0 - 2.0 / (gl.exp(2.0 * x) + 1.0)


@gluon.jit
def _tile_coords(t, n_m, n_n, GROUP_M: gl.constexpr):
    """(row block, vocabulary block) of tile t: bands of GROUP_M row blocks, each band walked vocabulary block by
    vocabulary block with the row block fastest, so a wave of consecutive tiles shares its C tiles (and the band's
    E rows) through L2."""
    per_band = GROUP_M * n_n
    band = t // per_band
    first_m = band * GROUP_M
    rows_in_band = gl.minimum(n_m - first_m, GROUP_M)
    r = t - band * per_band
    return first_m + r % rows_in_band, r // rows_in_band


@gluon.jit
def _producer(e_desc, c_desc, a_smem, b_smem, ready, empty, n_tiles, n_m, n_n, k_steps,
              TILE_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              STAGES: gl.constexpr, A_SUB: gl.constexpr, GROUP_M: gl.constexpr):
    """1 warp: every k-step of this program's tiles, in order, into ring slot step % STAGES once its previous
    occupant was released by both consumers (a fresh barrier passes the wait on phase 1). A slot holds A_SUB
    blocks of E rows (the tile's row halves) and one block of C rows."""
    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    NBYTES: gl.constexpr = A_SUB * e_desc.block_type.nbytes + c_desc.block_type.nbytes
    step = 0
    for t in range(pid, n_tiles, n_prog):
        m, n = _tile_coords(t, n_m, n_n, GROUP_M)
        for k in range(k_steps):
            slot = step % STAGES
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), NBYTES)
            for h in gl.static_range(A_SUB):
                tma.async_copy_global_to_shared(e_desc, [m * TILE_M + h * BLOCK_M, k * BLOCK_K], ready.index(slot),
                                                a_smem.index(slot * A_SUB + h))
            tma.async_copy_global_to_shared(c_desc, [n * BLOCK_N, k * BLOCK_K], ready.index(slot), b_smem.index(slot))
            step += 1


@gluon.jit
def _mainloop(a_smem, b_smem, ready, empty, step0, k_steps, acc_layout: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, A_SUB: gl.constexpr, HALF: gl.constexpr):
    """Row half HALF of z = E_tile · C_tileᵀ in fp32 over the ring steps [step0, step0 + k_steps): one async
    wgmma group in flight, each slot released as soon as the wgmma that read it retired.

    A parity wait on a ready barrier is only sound when the slot's previous fill has completed (two phases
    behind, the parity would match again and the wait pass on stale data). It has: this warpgroup consumed that
    fill itself, and the producer refills a slot only after both warpgroups released it."""
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    for k in range(k_steps):
        step = step0 + k
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        acc = warpgroup_mma(a_smem.index(slot * A_SUB + HALF), b_smem.index(slot).permute((1, 0)), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1, pred=k > 0)  # step − 1's slot
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index((step0 + k_steps - 1) % STAGES), count=1)
    return acc


@gluon.jit
def _epilogue(acc, TGT, LSE, W, G, NV, VC, stride_g, v_start, off_m, off_n, softcap, z_loss, onehot_weight,
              uniform_weight, acc_layout: gl.constexpr, HAS_SOFTCAP: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr):
    """The tile's gradient from its logits in registers. With a softcap, z and the running gradient are both live
    per element (the factor 1 − (z/softcap)² needs z after the exp), so the tile is done in two halves, the even
    and the odd columns (in the wgmma layout a thread holds columns in pairs, so the split moves no data); at
    64 x 256 even that spills, hence SOFTCAP_TILE_CONFIG's 64 x 128."""
    if HAS_SOFTCAP:
        even, odd = gl.split(gl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
        cols = 2 * gl.arange(0, BLOCK_N // 2, layout=gl.SliceLayout(0, even.type.layout))
        _store_grad(even, cols, TGT, LSE, W, G, NV, VC, stride_g, v_start, off_m, off_n, softcap, z_loss,
                    onehot_weight, uniform_weight, HAS_SOFTCAP, BLOCK_M)
        _store_grad(odd, cols + 1, TGT, LSE, W, G, NV, VC, stride_g, v_start, off_m, off_n, softcap, z_loss,
                    onehot_weight, uniform_weight, HAS_SOFTCAP, BLOCK_M)
    else:
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        _store_grad(acc, cols, TGT, LSE, W, G, NV, VC, stride_g, v_start, off_m, off_n, softcap, z_loss,
                    onehot_weight, uniform_weight, HAS_SOFTCAP, BLOCK_M)


@gluon.jit
def _store_grad(acc, cols, TGT, LSE, W, G, NV, VC, stride_g, v_start, off_m, off_n, softcap, z_loss, onehot_weight,
                uniform_weight, HAS_SOFTCAP: gl.constexpr, BLOCK_M: gl.constexpr):
    """g for logits ``acc`` at tile columns ``cols`` (in acc's column layout), stored as bf16 with masks
    (rows < NV, columns < VC), int64 row offsets."""
    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc.type.layout))
    row_ok = rows < NV
    g = _grad_values(acc, cols, rows, row_ok, TGT, LSE, W, v_start, off_n, softcap, z_loss, onehot_weight,
                     uniform_weight, HAS_SOFTCAP)
    ptrs = G + (rows.to(gl.int64) * stride_g + off_n)[:, None] + cols[None, :]
    gl.store(ptrs, g.to(G.dtype.element_ty), mask=row_ok[:, None] & (cols < VC - off_n)[None, :])


@gluon.jit
def _tma_store_grad(acc, TGT, LSE, W, g_desc, g_smem, NV, v_start, off_m, off_n, z_loss, onehot_weight,
                    uniform_weight, acc_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """g for logits ``acc`` (no softcap) through this warpgroup's shared buffer and one TMA store, which clips the
    rows past NV and the columns past the chunk (the descriptor's shape). The store is left in flight: the next
    tile's mainloop runs under it, and only the next epilogue waits for it to have read the buffer."""
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    g = _grad_values(acc, cols, rows, rows < NV, TGT, LSE, W, v_start, off_n, 1.0, z_loss, onehot_weight,
                     uniform_weight, False)
    tma.store_wait(0)  # the previous tile's copy has read the buffer (waited on by the thread that issued it) ...
    gl.thread_barrier()  # ... before any thread of the warpgroup overwrites it
    g_smem.store(g.to(gl.bfloat16))
    fence_async_shared()
    gl.thread_barrier()  # every thread's part is in shared memory before the copy is issued
    tma.async_copy_shared_to_global(g_desc, [off_m, off_n], g_smem)


@gluon.jit
def _grad_values(acc, cols, rows, row_ok, TGT, LSE, W, v_start, off_n, softcap, z_loss, onehot_weight,
                 uniform_weight, HAS_SOFTCAP: gl.constexpr):
    """The fp32 gradient of logits ``acc`` (rows ``rows``, tile columns ``cols``), as backward._grad_tile_kernel
    forms it."""
    lse = gl.load(LSE + rows, mask=row_ok, other=0.0)
    w = gl.load(W + rows, mask=row_ok, other=0.0)
    # the target's column inside this tile (any value outside the tile matches no column)
    tgt_col = (gl.load(TGT + rows, mask=row_ok, other=-1) - (v_start + off_n)).to(gl.int32)
    z = acc
    if HAS_SOFTCAP:
        z = softcap * _tanh(acc / softcap)
    g = gl.exp(z - lse[:, None]) * (1.0 + 2.0 * z_loss * lse)[:, None]
    g = g - gl.where(cols[None, :] == tgt_col[:, None], onehot_weight, 0.0) - uniform_weight
    if HAS_SOFTCAP:
        zc = z / softcap
        g = g * (1.0 - zc * zc)
    return g * w[:, None]


@gluon.jit
def _consumer(a_smem, b_smem, ready, empty, TGT, LSE, W, G, g_desc, g_smem, NV, VC, stride_g, v_start, softcap,
              z_loss, onehot_weight, uniform_weight, n_tiles, n_m, n_n, k_steps,
              HAS_SOFTCAP: gl.constexpr, TILE_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, A_SUB: gl.constexpr, GROUP_M: gl.constexpr, TMA_STORE: gl.constexpr,
              WG: gl.constexpr):
    """Consumer warpgroup WG (of A_SUB): rows [WG·BLOCK_M, +BLOCK_M) of every local tile; local tile i holds ring
    steps [i·k_steps, +k_steps). TMA_STORE: the gradient leaves through g_smem's buffer WG and ``g_desc``."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    for t in range(pid, n_tiles, n_prog):
        m, n = _tile_coords(t, n_m, n_n, GROUP_M)
        i = (t - pid) // n_prog
        acc = _mainloop(a_smem, b_smem, ready, empty, i * k_steps, k_steps, acc_layout, BLOCK_M, BLOCK_N, STAGES,
                        A_SUB, WG)
        if TMA_STORE:
            _tma_store_grad(acc, TGT, LSE, W, g_desc, g_smem.index(WG), NV, v_start, m * TILE_M + WG * BLOCK_M,
                            n * BLOCK_N, z_loss, onehot_weight, uniform_weight, acc_layout, BLOCK_M, BLOCK_N)
        else:
            _epilogue(acc, TGT, LSE, W, G, NV, VC, stride_g, v_start, m * TILE_M + WG * BLOCK_M, n * BLOCK_N,
                      softcap, z_loss, onehot_weight, uniform_weight, acc_layout, HAS_SOFTCAP, BLOCK_M, BLOCK_N)
    if TMA_STORE:
        tma.store_wait(0)  # the last copy has read the buffer before the program's shared memory is released


@gluon.jit
def _ring(e_desc, c_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
          STAGES: gl.constexpr, A_SUB: gl.constexpr):
    """The shared-memory ring (A_SUB blocks of E rows and one block of C rows per slot) and its ready/empty
    mbarriers, initialised: what every kernel of this module feeds ``_producer`` and ``_mainloop`` with."""
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * A_SUB, BLOCK_M, BLOCK_K], e_desc.layout)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BLOCK_K], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=A_SUB)  # every consumer warpgroup reads each slot
    fence_async_shared()
    return a_smem, b_smem, ready, empty


@gluon.jit
def _grad_tile_gluon_kernel(e_desc, c_desc, g_desc, TGT, LSE, W, G, NV, VC, D, stride_g, v_start,
                            softcap, z_loss, onehot_weight, uniform_weight,
                            HAS_SOFTCAP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            BLOCK_K: gl.constexpr, STAGES: gl.constexpr, A_SUB: gl.constexpr,
                            GROUP_M: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                            TMA_STORE: gl.constexpr):
    """Persistent over the chunk's tiles: E_valid rows (``e_desc``, nv x D) against the chunk's C rows
    (``c_desc``, cur x D); G: the chunk's nv x cur gradient view (row stride ``stride_g``), also ``g_desc``
    (BLOCK_M x BLOCK_N boxes) when TMA_STORE, else None."""
    TILE_M: gl.constexpr = BLOCK_M * A_SUB  # rows of one scheduled tile (A_SUB = 2 warpgroup halves)
    n_m = gl.cdiv(NV, TILE_M)
    n_n = gl.cdiv(VC, BLOCK_N)
    n_tiles = n_m * n_n
    k_steps = gl.cdiv(D, BLOCK_K)
    a_smem, b_smem, ready, empty = _ring(e_desc, c_desc, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, A_SUB)
    if TMA_STORE:
        g_smem = gl.allocate_shared_memory(gl.bfloat16, [A_SUB, BLOCK_M, BLOCK_N], g_desc.layout)
        g_out = g_desc
    else:  # unused placeholders: warp_specialize takes no None
        g_smem = G
        g_out = G
    gl.warp_specialize([
        (_consumer, (a_smem, b_smem, ready, empty, TGT, LSE, W, G, g_out, g_smem, NV, VC, stride_g, v_start,
                     softcap, z_loss, onehot_weight, uniform_weight, n_tiles, n_m, n_n, k_steps, HAS_SOFTCAP,
                     TILE_M, BLOCK_M, BLOCK_N, STAGES, A_SUB, GROUP_M, TMA_STORE, 0)),
        (_consumer, (a_smem, b_smem, ready, empty, TGT, LSE, W, G, g_out, g_smem, NV, VC, stride_g, v_start,
                     softcap, z_loss, onehot_weight, uniform_weight, n_tiles, n_m, n_n, k_steps, HAS_SOFTCAP,
                     TILE_M, BLOCK_M, BLOCK_N, STAGES, A_SUB, GROUP_M, TMA_STORE, 1)),
        (_producer, (e_desc, c_desc, a_smem, b_smem, ready, empty, n_tiles, n_m, n_n, k_steps, TILE_M, BLOCK_M,
                     BLOCK_N, BLOCK_K, STAGES, A_SUB, GROUP_M)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---------------------------------------------------------------------------- the forward's log-sum-exp
NEG_BIG = gl.constexpr(-1.0e30)  # forward.NEG_BIG: a finite "minus infinity" (exp(NEG_BIG - NEG_BIG) is 1, not NaN)


@gluon.jit
def _lse_epilogue(acc, TGT, PART, NV, V, slot, off_m, off_n, softcap, acc_layout: gl.constexpr,
                  HAS_SOFTCAP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The tile's per-row statistics (max m, Σ exp(z − m), target logit, Σ z over columns < V; softcap first, as
    forward._row_stats_kernel), merged (online max/sum) into partial slot ``slot`` of PART (slots x 4 x NV fp32).

    The slot belongs to this program, and its rows [off_m, +BLOCK_M) to this warpgroup alone, so the
    read-modify-write needs no lock. Its tiles run one after the other, and the statistics go to a layout of one
    element per thread, BLOCK_M = 64 rows over the warpgroup's 128 threads: each row is held by two threads (in
    different warps) of which Triton lets a fixed one store (the one whose replica bits are 0). That thread reads
    back only what it wrote itself, so program order alone orders one tile's update before the next; the other
    copy's reads are never stored."""
    z = acc
    if HAS_SOFTCAP:
        z = softcap * _tanh(acc / softcap)
    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    # the target's column inside this tile (targets outside it, and rows past NV (-1), match no column)
    tgt_col = (gl.load(TGT + rows, mask=rows < NV, other=-1) - off_n).to(gl.int32)
    inside = (cols < V - off_n)[None, :]  # columns past V hold TMA's zero fill
    t_z = gl.sum(gl.where(cols[None, :] == tgt_col[:, None], z, 0.0), axis=1)
    t_sum = gl.sum(gl.where(inside, z, 0.0), axis=1)
    z = gl.where(inside, z, NEG_BIG)
    t_m = gl.max(z, axis=1)
    t_s = gl.sum(gl.exp(z - t_m[:, None]), axis=1)

    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    t_m = gl.convert_layout(t_m, row_layout)
    t_s = gl.convert_layout(t_s, row_layout)
    t_z = gl.convert_layout(t_z, row_layout)
    t_sum = gl.convert_layout(t_sum, row_layout)
    r = off_m + gl.arange(0, BLOCK_M, layout=row_layout)
    ok = r < NV
    mine = PART + slot.to(gl.int64) * 4 * NV + r
    m_old = gl.load(mine, mask=ok, other=NEG_BIG)
    m_new = gl.maximum(m_old, t_m)
    s_new = gl.load(mine + NV, mask=ok, other=0.0) * gl.exp(m_old - m_new) + t_s * gl.exp(t_m - m_new)
    gl.store(mine, m_new, mask=ok)
    gl.store(mine + NV, s_new, mask=ok)
    gl.store(mine + 2 * NV, gl.load(mine + 2 * NV, mask=ok, other=0.0) + t_z, mask=ok)
    gl.store(mine + 3 * NV, gl.load(mine + 3 * NV, mask=ok, other=0.0) + t_sum, mask=ok)


@gluon.jit
def _lse_consumer(a_smem, b_smem, ready, empty, TGT, PART, NV, V, softcap, n_tiles, n_m, n_n, k_steps,
                  HAS_SOFTCAP: gl.constexpr, TILE_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, A_SUB: gl.constexpr, GROUP_M: gl.constexpr, WG: gl.constexpr):
    """Consumer warpgroup WG: rows [WG·BLOCK_M, +BLOCK_M) of every local tile, in order; statistics into partial
    slot ``program`` (the warpgroups' rows never overlap)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    for t in range(pid, n_tiles, n_prog):
        m, n = _tile_coords(t, n_m, n_n, GROUP_M)
        i = (t - pid) // n_prog
        acc = _mainloop(a_smem, b_smem, ready, empty, i * k_steps, k_steps, acc_layout, BLOCK_M, BLOCK_N, STAGES,
                        A_SUB, WG)
        _lse_epilogue(acc, TGT, PART, NV, V, pid, m * TILE_M + WG * BLOCK_M, n * BLOCK_N, softcap, acc_layout,
                      HAS_SOFTCAP, BLOCK_M, BLOCK_N)


@gluon.jit
def _lse_gluon_kernel(e_desc, c_desc, TGT, PART, NV, V, D, softcap,
                      HAS_SOFTCAP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      BLOCK_K: gl.constexpr, STAGES: gl.constexpr, A_SUB: gl.constexpr, GROUP_M: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """Persistent over all tiles of z = E_valid · Cᵀ (``e_desc``: nv x D, ``c_desc``: the whole V x D
    classifier), the gradient tiles' schedule; per-row partial statistics into PART (programs x 4 x NV,
    initialised to (NEG_BIG, 0, 0, 0) by the host, merged there)."""
    TILE_M: gl.constexpr = BLOCK_M * A_SUB
    n_m = gl.cdiv(NV, TILE_M)
    n_n = gl.cdiv(V, BLOCK_N)
    n_tiles = n_m * n_n
    k_steps = gl.cdiv(D, BLOCK_K)
    a_smem, b_smem, ready, empty = _ring(e_desc, c_desc, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, A_SUB)
    gl.warp_specialize([
        (_lse_consumer, (a_smem, b_smem, ready, empty, TGT, PART, NV, V, softcap, n_tiles, n_m, n_n, k_steps,
                         HAS_SOFTCAP, TILE_M, BLOCK_M, BLOCK_N, STAGES, A_SUB, GROUP_M, 0)),
        (_lse_consumer, (a_smem, b_smem, ready, empty, TGT, PART, NV, V, softcap, n_tiles, n_m, n_n, k_steps,
                         HAS_SOFTCAP, TILE_M, BLOCK_M, BLOCK_N, STAGES, A_SUB, GROUP_M, 1)),
        (_producer, (e_desc, c_desc, a_smem, b_smem, ready, empty, n_tiles, n_m, n_n, k_steps, TILE_M, BLOCK_M,
                     BLOCK_N, BLOCK_K, STAGES, A_SUB, GROUP_M)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ------------------------------------------------------------------------------------------------- host side
def gluon_tiles_ok(e2d: torch.Tensor, c: torch.Tensor, *, bias, filtering: bool, order, g_dtype: torch.dtype,
                   tiles: str = "auto") -> bool:
    """Whether a backward's gradient tiles go to the Gluon kernel: ``tiles == "auto"``; bf16 E and C, bf16 tiles,
    no bias (no dbias either), no filtering or sorted vocabulary (the dense path: no work lists; a softcap
    takes SOFTCAP_TILE_CONFIG); TMA-ready rows (unit inner stride, row strides and base addresses 16-byte aligned, so D % 8 == 0); a Hopper
    GPU (``on_hopper``). Every other call keeps ``backward._grad_tile_kernel``."""
    if tiles != "auto" or bias is not None or filtering or order is not None:
        return False
    if e2d.dtype != torch.bfloat16 or c.dtype != torch.bfloat16 or g_dtype != torch.bfloat16:
        return False
    return _tma_rows(e2d) and _tma_rows(c) and on_hopper(e2d.device)


def on_hopper(device) -> bool:
    """A CUDA device of compute capability 9.x (H100, H200) running compiled kernels (not the interpreter)."""
    device = torch.device(device)
    return device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device)[0] == 9


def _tma_rows(x: torch.Tensor) -> bool:
    """A 2-D bf16 tensor a TMA descriptor can read by rows (and so can any row range of it)."""
    return (x.dim() == 2 and x.shape[1] % 8 == 0 and x.stride(1) == 1 and x.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0)


@functools.lru_cache(maxsize=None)
def shared_layouts(block_m: int, block_n: int, block_k: int):
    """(E tile layout, C tile layout) of the TMA descriptors (also the compile test's signature)."""
    return (gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.bfloat16))


@functools.lru_cache(maxsize=None)
def grad_store_layout(block_m: int, block_n: int):
    """The shared layout of a warpgroup's gradient half-tile and of the TMA store descriptor that copies it out."""
    return gl.NVMMASharedLayout.get_default_for([block_m, block_n], gl.bfloat16)


def _descriptors(e_rows: torch.Tensor, c_rows: torch.Tensor, block_m: int, block_n: int, block_k: int):
    """TMA descriptors over E rows (block_m x block_k boxes) and C rows (block_n x block_k), both K-major; boxes
    past the tensors' edges arrive zero-filled."""
    e_layout, c_layout = shared_layouts(block_m, block_n, block_k)
    D = e_rows.shape[1]
    return (TensorDescriptor(e_rows, [e_rows.shape[0], D], [e_rows.stride(0), 1], [block_m, block_k], e_layout),
            TensorDescriptor(c_rows, [c_rows.shape[0], D], [c_rows.stride(0), 1], [block_n, block_k], c_layout))


def tile_config(overrides: dict | None = None, base: dict = TILE_CONFIG) -> dict:
    """``base`` with ``overrides`` (tests and timing runs), checked: known keys only, and block_m a multiple of
    the wgmma's 16 rows per warp times num_warps."""
    cfg = dict(base, **(overrides or {}))
    unknown = sorted(set(cfg) - set(base))
    if unknown or cfg["block_m"] % (16 * cfg["num_warps"]) or cfg["block_m"] > 32 * cfg["num_warps"]:
        raise ValueError(f"config: keys of {sorted(base)} with block_m a multiple of 16 * num_warps and at most "
                         f"32 * num_warps (one warpgroup's rows of a tile), got {overrides!r}")
    return cfg


def grad_tiles(e_valid: torch.Tensor, c_chunk: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
               w: torch.Tensor, g_buf: torch.Tensor, *, v_start: int, softcap, z_loss: float, onehot_weight: float,
               uniform_weight: float, config: dict | None = None) -> None:
    """g_buf (nv x cur bf16, unit inner stride) = the gradient tiles of rows ``e_valid`` (nv x D) against the
    vocabulary rows ``c_chunk`` (cur x D, vocabulary ids v_start + j); targets, lse, w: per valid row.
    ``config``: overrides (tests and timing runs) of TILE_CONFIG, or of SOFTCAP_TILE_CONFIG with a softcap."""
    global launch_count, tma_store_count
    cfg = tile_config(config, SOFTCAP_TILE_CONFIG if softcap is not None else TILE_CONFIG)
    nv, D = e_valid.shape
    cur = c_chunk.shape[0]
    if nv == 0 or cur == 0:
        return
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    tile_m = HALVES * bm
    e_desc, c_desc = _descriptors(e_valid, c_chunk, bm, bn, bk)
    tma_store = cfg["tma_store"] and softcap is None and _tma_rows(g_buf)
    g_desc = None
    if tma_store:
        g_desc = TensorDescriptor(g_buf, [nv, cur], [g_buf.stride(0), 1], [bm, bn], grad_store_layout(bm, bn))
    n_tiles = cdiv(nv, tile_m) * cdiv(cur, bn)
    grid = (min(sm_count(e_valid.device), n_tiles), )
    _grad_tile_gluon_kernel[grid](
        e_desc, c_desc, g_desc, targets, lse, w, g_buf, nv, cur, D, g_buf.stride(0), v_start,
        float(softcap or 1.0), float(z_loss), float(onehot_weight), float(uniform_weight),
        HAS_SOFTCAP=softcap is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=cfg["stages"],
        A_SUB=HALVES, GROUP_M=max(1, GROUP_ROWS // tile_m), CONSUMER_REGS=cfg["consumer_regs"],
        PRODUCER_REGS=cfg["producer_regs"], TMA_STORE=tma_store, num_warps=cfg["num_warps"])
    launch_count += 1
    tma_store_count += tma_store


# ------------------------------------------------------------------------------ host side: the forward's LSE
# the forward's tiles: the gradient tiles' schedule (the statistics epilogue is lighter than the gradient's: no
# store of the tile, a 1 KB read-modify-write of the slot per warpgroup), with the ring's 4th stage in the shared
# memory the gradient buffers take there
LSE_CONFIG = {**{k: v for k, v in TILE_CONFIG.items() if k != "tma_store"}, "stages": 4}

lse_launch_count = 0  # Gluon LSE launches in this process: tests read it to see which forward a call took


def lse_programs(nv: int, V: int, device, config: dict | None = None) -> int:
    """Programs of the persistent LSE grid: one per SM, fewer when there are fewer tiles."""
    cfg = tile_config(config, LSE_CONFIG)
    return min(sm_count(device), cdiv(nv, HALVES * cfg["block_m"]) * cdiv(V, cfg["block_n"]))


def lse_partial_bytes(nv: int, V: int, device) -> int:
    """Bytes of the partial-statistics buffer: one slot per program, 4 fp32 per row each: 17.3 MB at 132 SMs and
    nv = 8192."""
    return lse_programs(nv, V, device) * 4 * nv * 4


def gluon_lse_ok(e2d: torch.Tensor, c: torch.Tensor, *, bias, nv: int, forward: str = "auto") -> bool:
    """Whether a forward's log-sum-exp goes to the Gluon kernel: ``forward == "auto"``; bf16 E and C, no bias,
    at least one valid row; TMA-ready rows (C, and E unless its valid rows are gathered into a contiguous copy:
    D % 8 == 0); a Hopper GPU (``on_hopper``); and the forward's extra memory within the classifier's size: the
    partial buffer twice (merge_partials' temporaries are smaller than it) plus the gathered valid rows when tokens
    are ignored. A training call's backward allocates dC (that size) anyway, so the forward never raises the
    peak; small V·D with many tokens (D=64, V=1000: 128 KB of C against 35 MB of partials) keeps the fused
    kernel. Every other call keeps forward.py's paths."""
    if forward != "auto" or bias is not None or nv == 0:
        return False
    if e2d.dtype != torch.bfloat16 or c.dtype != torch.bfloat16:
        return False
    gathered = nv != e2d.shape[0]
    if not (_tma_rows(c) and (e2d.shape[1] % 8 == 0 if gathered else _tma_rows(e2d))):
        return False
    if not on_hopper(e2d.device):
        return False
    extra = 2 * lse_partial_bytes(nv, c.shape[0], e2d.device) + (nv * e2d.shape[1] * 2 if gathered else 0)
    return extra <= c.numel() * c.element_size()


def lse_forward_gluon(e2d: torch.Tensor, c: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, softcap,
                      config: dict | None = None):
    """forward.lse_forward's result (lse, target logit, logit sum; fp32, one per valid row) with no bias, from
    the Gluon kernel over the whole vocabulary: rows ``rows`` of e2d (N x D bf16), classifier c (V x D bf16),
    ``targets`` (int64, one per valid row). ``config``: LSE_CONFIG overrides (``tile_config``)."""
    from .forward import merge_partials

    global lse_launch_count
    cfg = tile_config(config, LSE_CONFIG)
    nv = rows.numel()
    V, D = c.shape
    if nv == 0:
        empty = torch.empty(0, dtype=torch.float32, device=e2d.device)
        return empty, empty.clone(), empty.clone()
    e_valid = e2d if nv == e2d.shape[0] else e2d.index_select(0, rows)
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    e_desc, c_desc = _descriptors(e_valid, c, bm, bn, bk)
    programs = lse_programs(nv, V, e2d.device, cfg)
    part = torch.zeros(programs, 4, nv, dtype=torch.float32, device=e2d.device)
    part[:, 0].fill_(NEG_BIG.value)  # (max, sum, z_t, z_sum) = (NEG_BIG, 0, 0, 0): a slot no tile reached adds nothing
    _lse_gluon_kernel[(programs, )](
        e_desc, c_desc, targets, part, nv, V, D, float(softcap or 1.0), HAS_SOFTCAP=softcap is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=cfg["stages"], A_SUB=HALVES,
        GROUP_M=max(1, GROUP_ROWS // (HALVES * bm)),
        CONSUMER_REGS=cfg["consumer_regs"], PRODUCER_REGS=cfg["producer_regs"], num_warps=cfg["num_warps"])
    lse_launch_count += 1
    return merge_partials(part)
