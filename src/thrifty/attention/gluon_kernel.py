"""The Gluon (``triton.experimental.gluon``) Hopper forward of SageAttention2 (8-bit): issue #28 item 1, first step.

Same inputs and semantics as ``attn_kernel._sage_fwd_kernel`` on its GPU path (``fold``, ``fast_cvt``, ``ftz``):
the K/V pre-pass of ``quant_kernel.quantize_kv`` (int8 K [B·Hkv·S_pad, D] with one scale per KS_BLOCK keys, e4m3
Vᵀ [B·Hkv·D, S_pad] with per-channel scales, the statistics and ``first_bad``), Q quantized per token inside
the kernel (sm_scale·log2e folded into its scale), INT8 ``wgmma`` for Q·Kᵀ into int32, the folded exponent
p̃ = 448·2^(s·c − m) from one FFMA on the magic-number float, ``ex2.approx.ftz``, P̃ in e4m3 from registers,
FP8 ``wgmma`` for P̃·V into a fresh fp32 fragment per tile (two-level accumulation), 1/l and V's scales once in
the epilogue, LSE, the NaN rule (``first_bad`` and the query scale), causal with Sq ≤ Sk aligned to the end.

What Gluon adds over the Triton kernel (structure, one CTA = BLOCK_M query rows of one head):

* K and Vᵀ tiles come by TMA (host-side descriptors) into a ``STAGES``-deep shared-memory ring, each slot with
  its own K and V mbarrier, so Q·Kᵀ of a tile starts as soon as its K has landed.
* ``gl.warp_specialize`` with a 1-warp producer partition that only issues TMA loads (waiting on per-slot
  "empty" barriers) and one or two consumer warpgroups (``CONSUMERS``); the producer asks for ``PRODUCER_REGS``
  registers (setmaxnreg). (A one-warpgroup structure that issued its own loads ``STAGES − 1`` tiles ahead wrote
  NaN rows at D=64 with 64x64 tiles and was slower than the default everywhere it was measured: removed.)
* Inside the consumer, the P̃·V ``wgmma`` is issued asynchronously and the accumulator rescale (acc·α) and the
  row sum run while it executes.
* ``PINGPONG`` (the head_dim-128 causal default): FA3's ordering of two consumer warpgroups. They take turns through
  two mbarriers; in turn j + 1 a warpgroup issues P̃ⱼ·Vⱼ together with Q·Kⱼ₊₁, and its softmax of tile j + 1 runs
  while the other warpgroup's pair occupies the tensor cores (``_tiles_pingpong``).
* Tile shapes (``gluon_config``): ``block_m`` query rows per consumer warpgroup (64: one m64 ``wgmma``; 128: two,
  over the same 4 warps) and ``block_n`` keys per tile, one or two of the pre-pass's K-scale blocks (D=64: 128-key
  tiles at 64-key scales; D=128 without a mask: 256-key tiles at 128-key scales). D=64 is bound by instruction
  issue, not by the tensor cores: 128 rows spread the per-tile costs (mbarrier waits, warpgroup barriers, wgmma
  issue and waits, loop overhead) over twice the scores, 128 keys also the per-row ones (max and sum shuffles, α,
  the exponent's bias) and halve acc·α per score. The arithmetic per score is unchanged; with 128-key tiles each
  fresh P̃·V fragment sums 128 products in the tensor core's accumulator before the fp32 add (as at D=128 causal;
  256 at D=128 full) instead of 64.
* ``v_perm16``: the pre-pass stores Vᵀ's tokens in the order in which a thread's Q·Kᵀ accumulator columns
  line up with the k slots of the P̃·V ``wgmma``'s register operand (``quant_kernel.v_slot``, SageAttention2's
  V layout), and the kernel relabels P̃'s columns to match (reshape/permute: no data movement), instead of
  moving P̃ between the 4 lanes of each quad (SEL + SHFL + PRMT: 0.75 instructions per score).

Not here (NOTES.md "The Gluon kernel"): the FMA-pipe exp2 polynomial and conditional rescaling (FA4; both tried
and removed, measured), a persistent causal scheduler, Q smoothing / ΔS (qk_bits=4 with smooth_q), 16-bit P·V.
Those calls stay on the Triton kernel.
"""

from __future__ import annotations

import functools
import math
import types

import torch
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..triton_utils import LOG2E, FastLauncher, cdiv
from .quant_kernel import FP8_MAX, MAX_SPLIT, quantize_kv, unsmoothed_lse
from .routing import GLUON_HEAD_DIMS

LOG2_FP8_MAX = math.log2(FP8_MAX)
MAGIC = 12582912.0  # 1.5·2^23: s + 0x4B400000 read as a float is MAGIC + s exactly for |s| < 2^22


@gluon.jit
def _ex2(x):
    """2^x with one MUFU.EX2, subnormal results flushed (p̃ loses them in e4m3 anyway)."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _max_keep_nan(a, b):
    return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, n_tiles, k_row0, v_row0,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The producer partition (1 warp): tile j goes into slot j % STAGES once the consumer released its previous
    occupant (tile j − STAGES); a fresh barrier counts as released (parity trick: wait on phase 1 first)."""
    for j in range(n_tiles):
        slot = j % STAGES
        phase = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), phase)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row0 + j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [v_row0, j * BLOCK_N], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _halves(first, a, b, KSPLIT: gl.constexpr):
    """Per score: ``a`` (a per-row value) in the tile's first K-scale block, ``b`` in the second. ``first`` is
    a column predicate that is a compile-time constant per register (in the wgmma layout a thread's columns are
    8g + 2·(lane % 4) + {0, 1}, and the split is at a multiple of 8), so the select folds away."""
    if KSPLIT == 1:
        r = a[:, None]
    else:
        r = gl.where(first, a[:, None], b[:, None])
    return r


@gluon.jit
def _cols_below(offs_n, bound):
    """offs_n[None, :] < bound, written as (offs_n & ~6) < bound − (offs_n & 6) (the same for any integers). In
    the wgmma layout a thread's columns are 8g + 2·(lane % 4) + {0, 1}: ``offs_n & 6`` is then one value per
    thread and ``offs_n & ~6`` a constant per register, so each score costs one compare with an immediate and
    no column index stays live in a register (128×128 tiles spilled holding them)."""
    return (offs_n & ~6)[None, :] < bound - (offs_n & 6)[None, :]


@gluon.jit
def _scaled_row_max(v, first, c0, c1, lowest, KSPLIT: gl.constexpr):
    """max over a row of v·c, c > 0 per K-scale block (the max commutes with the scale, so it is taken on v:
    the int32 scores of unmasked tiles, the masked fp32 scores of the others; ``lowest``: v's −∞)."""
    if KSPLIT == 1:
        m = gl.max(v, axis=1).to(gl.float32) * c0
    else:  # two K-scale blocks per tile: one max per block, scaled, then the larger
        m0 = gl.max(gl.where(first, v, lowest), axis=1).to(gl.float32) * c0
        m1 = gl.max(gl.where(first, lowest, v), axis=1).to(gl.float32) * c1
        m = gl.maximum(m0, m1)
    return m


@gluon.jit
def _k_scales(q_scale, ks_base, j, n_ks, KSPLIT: gl.constexpr):
    """Per row and K-scale block of tile j: dequantization · sm_scale · log2e. The second block of a ragged last
    tile can lie past the head's scales (S padded to KS_BLOCK only): its keys are masked, any scale > 0 does."""
    c0 = q_scale * gl.load(ks_base + j * KSPLIT)
    c1 = c0
    if KSPLIT == 2:
        c1 = q_scale * gl.load(ks_base + gl.minimum(j * 2 + 1, n_ks - 1))
    return c0, c1


@gluon.jit
def _softmax_tile(s_i, j, m_i, offs_n, first, key_end, c0, c1, Sk, BLOCK_N: gl.constexpr, KSPLIT: gl.constexpr,
                  MASKED: gl.constexpr, CAUSAL: gl.constexpr, LOG2_P_SCALE: gl.constexpr):
    """The int32 scores of tile j → (p̃ = 448·2^(s·c − m) in fp32, α = 2^(m_old − m_new), m_new).
    ``MASKED``: keys past the end or (causal) past the row's diagonal are dropped (one compare per score)."""
    # int32 → fp32 without I2F: the bit pattern of 1.5·2^23 + s is that float exactly (|s| ≤ D·127² < 2^22)
    f = (s_i + 0x4B400000).to(gl.float32, bitcast=True)
    c = _halves(first, c0, c1, KSPLIT)
    if MASKED:
        if CAUSAL:
            keep = _cols_below(offs_n, (key_end - j * BLOCK_N)[:, None])
        else:
            keep = _cols_below(offs_n, Sk - j * BLOCK_N)
        t = gl.where(keep, f - 12582912.0, float("-inf"))
        m_new = gl.maximum(m_i, _scaled_row_max(t, first, c0, c1, float("-inf"), KSPLIT))
        m_new = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        x = gl.fma(t, c, -(m_new - LOG2_P_SCALE)[:, None])
    else:
        m_new = gl.maximum(m_i, _scaled_row_max(s_i, first, c0, c1, -2147483648, KSPLIT))
        # p̃ = 448·2^(s·c − m) in ONE FFMA on f: bias 1.5·2^23·c + m − log2 448 per row (and K-scale block)
        x = gl.fma(f, c, -_halves(first, c0 * 12582912.0 + (m_new - LOG2_P_SCALE),
                                  c1 * 12582912.0 + (m_new - LOG2_P_SCALE), KSPLIT))
    return _ex2(x), _ex2(m_i - m_new), m_new


@gluon.jit
def _to_p8(p, p_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, V_PERM16: gl.constexpr):
    """P̃ in e4m3 as the register A operand of the P̃·V wgmma."""
    p8 = p.to(gl.float8e4nv)
    if V_PERM16:  # Vᵀ's tokens are in quant_kernel.v_slot order: relabel the columns, registers stay put
        p8 = gl.reshape(gl.permute(gl.reshape(p8, [BLOCK_M, BLOCK_N // 16, 2, 4, 2]), (0, 1, 3, 2, 4)),
                        [BLOCK_M, BLOCK_N])
    return gl.convert_layout(p8, p_layout, assert_trivial=V_PERM16)  # else shuffles between the 4 lanes


@gluon.jit
def _tiles(acc, l_i, m_i, q_smem, q_scale, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
           ks_base, n_ks, offs_m, j_lo, j_hi, Sk, causal_offset,
           s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, KS_BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
           STAGES: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
           LOG2_P_SCALE: gl.constexpr, V_PERM16: gl.constexpr):
    """KV tiles [j_lo, j_hi) of one consumer warpgroup; ``MASKED``: the diagonal / ragged-end tiles. A tile
    holds ``KSPLIT`` = BLOCK_N / KS_BLOCK blocks of the pre-pass's K scales (1, or 2 with BLOCK_N 128 at D=64:
    the per-row max, sum, α and the per-tile waits then cover 128 keys at the pre-pass's 64-key scales)."""
    KSPLIT: gl.constexpr = BLOCK_N // KS_BLOCK
    gl.static_assert(KSPLIT * KS_BLOCK == BLOCK_N and KSPLIT <= 2, "BLOCK_N: one or two K-scale blocks")
    # Registers per thread live while the P̃·V wgmma runs if the row sum waits for it: p (fp32), P̃ (e4m3), the
    # fresh P̃·V fragment and acc. 128×128 tiles at D=64 need 288 of the 240 setmaxnreg gives (ptxas: 200 B
    # spilled); summing first frees p before the wgmma (no spills). The other shapes need ≤ 208: sum under it.
    SUM_UNDER_PV: gl.constexpr = (BLOCK_M * BLOCK_N * 5 // 4 + 2 * BLOCK_M * HEAD_DIM) // 128 <= 208
    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    first = (offs_n < KS_BLOCK)[None, :]
    key_end = gl.minimum(offs_m + (causal_offset + 1), Sk)  # causal: the end of the keys each row sees
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, s_layout)
    o_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    for j in range(j_lo, j_hi):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        c0, c1 = _k_scales(q_scale, ks_base, j, n_ks, KSPLIT)
        mbarrier.wait(k_ready.index(slot), phase)
        s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_i = warpgroup_mma_wait(0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(slot), count=1)
        p, alpha, m_new = _softmax_tile(s_i, j, m_i, offs_n, first, key_end, c0, c1, Sk, BLOCK_N, KSPLIT, MASKED,
                                        CAUSAL, LOG2_P_SCALE)
        if not SUM_UNDER_PV:
            l_i = l_i * alpha + gl.sum(p, axis=1)
        p8 = _to_p8(p, p_layout, BLOCK_M, BLOCK_N, V_PERM16)
        mbarrier.wait(v_ready.index(slot), phase)
        pv_tok = warpgroup_mma(p8, v_smem.index(slot).permute((1, 0)), o_zero, use_acc=False, is_async=True)
        # under the P̃·V wgmma: the row sum (where p fits beside it) and the rescale of the running output
        if SUM_UNDER_PV:
            l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.convert_layout(alpha, o_row)[:, None]
        pv = warpgroup_mma_wait(0, deps=(pv_tok, ))
        mbarrier.arrive(v_empty.index(slot), count=1)
        acc = acc + pv
        m_i = m_new
    return acc, l_i, m_i


@gluon.jit
def _turn(turns, t, WG: gl.constexpr):
    """FA3's ping-pong: warpgroup WG issues its wgmma group t only after the other warpgroup issued its group
    t − 1 (WG 0; group 0 goes at once: a fresh barrier passes a wait on phase 1) or t (WG 1)."""
    mbarrier.wait(turns.index(WG), (t & 1) ^ (1 - WG))


@gluon.jit
def _pingpong_step(acc, l_i, m_i, s_i, c0, c1, j, q_smem, q_scale, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                   turns, ks_base, n_ks, offs_n, first, key_end, Sk, s_zero, o_zero, o_row: gl.constexpr,
                   p_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, KSPLIT: gl.constexpr,
                   STAGES: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr, LOG2_P_SCALE: gl.constexpr,
                   V_PERM16: gl.constexpr, WG: gl.constexpr, LAST: gl.constexpr):
    """Tile j's softmax (its scores ``s_i`` are in), then in turn j + 1 this warpgroup's P̃_j·V_j and (unless
    ``LAST``) Q·K_{j+1}; while they run, the other warpgroup has its softmax. Returns tile j + 1's scores and
    K scales (``c0``, ``c1``: tile j's, loaded a tile ahead so that their latency is not on the softmax's path)."""
    slot = j % STAGES
    if not LAST:
        c0_next, c1_next = _k_scales(q_scale, ks_base, j + 1, n_ks, KSPLIT)
    p, alpha, m_i = _softmax_tile(s_i, j, m_i, offs_n, first, key_end, c0, c1, Sk, BLOCK_N, KSPLIT, MASKED, CAUSAL,
                                  LOG2_P_SCALE)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p8 = _to_p8(p, p_layout, BLOCK_M, BLOCK_N, V_PERM16)
    mbarrier.wait(v_ready.index(slot), (j // STAGES) & 1)
    if not LAST:
        nxt = (j + 1) % STAGES
        mbarrier.wait(k_ready.index(nxt), ((j + 1) // STAGES) & 1)
    _turn(turns, j + 1, WG)
    pv_tok = warpgroup_mma(p8, v_smem.index(slot).permute((1, 0)), o_zero, use_acc=False, is_async=True)
    if not LAST:
        s_tok = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.arrive(turns.index(1 - WG), count=1)
    acc = acc * gl.convert_layout(alpha, o_row)[:, None]
    if LAST:
        pv = warpgroup_mma_wait(0, deps=(pv_tok, ))
    else:
        pv = warpgroup_mma_wait(1, deps=(pv_tok, ))  # groups retire in order: P̃·V first
    mbarrier.arrive(v_empty.index(slot), count=1)
    acc = acc + pv
    if not LAST:
        s_i = warpgroup_mma_wait(0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(nxt), count=1)
        c0, c1 = c0_next, c1_next
    return acc, l_i, m_i, s_i, c0, c1


@gluon.jit
def _tiles_pingpong(acc, l_i, m_i, q_smem, q_scale, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turns,
                    ks_base, n_ks, offs_m, full_end, hi, Sk, causal_offset,
                    s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, KS_BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
                    STAGES: gl.constexpr, CAUSAL: gl.constexpr, LOG2_P_SCALE: gl.constexpr, V_PERM16: gl.constexpr,
                    WG: gl.constexpr):
    """KV tiles [0, hi) of consumer warpgroup WG (of two, with a producer warp) in FA3's ping-pong order: turn 0
    issues Q·K_0, turn j + 1 issues P̃_j·V_j with Q·K_{j+1}, and the warpgroups take turns, so that one
    warpgroup's softmax runs while the other's wgmma occupy the tensor cores. The last tile takes the masked
    softmax (exact for any tile)."""
    KSPLIT: gl.constexpr = BLOCK_N // KS_BLOCK
    gl.static_assert(KSPLIT * KS_BLOCK == BLOCK_N and KSPLIT <= 2, "BLOCK_N: one or two K-scale blocks")
    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    first = (offs_n < KS_BLOCK)[None, :]
    key_end = gl.minimum(offs_m + (causal_offset + 1), Sk)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, s_layout)
    o_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    c0, c1 = _k_scales(q_scale, ks_base, 0, n_ks, KSPLIT)
    mbarrier.wait(k_ready.index(0), 0)
    _turn(turns, 0, WG)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.arrive(turns.index(1 - WG), count=1)
    s_i = warpgroup_mma_wait(0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(0), count=1)

    split = gl.minimum(full_end, hi - 1)
    for j in range(0, split):
        acc, l_i, m_i, s_i, c0, c1 = _pingpong_step(
            acc, l_i, m_i, s_i, c0, c1, j, q_smem, q_scale, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turns,
            ks_base, n_ks, offs_n, first, key_end, Sk, s_zero, o_zero, o_row, p_layout, BLOCK_M, BLOCK_N, KSPLIT,
            STAGES, False, CAUSAL, LOG2_P_SCALE, V_PERM16, WG, False)
    for j in range(split, hi - 1):
        acc, l_i, m_i, s_i, c0, c1 = _pingpong_step(
            acc, l_i, m_i, s_i, c0, c1, j, q_smem, q_scale, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turns,
            ks_base, n_ks, offs_n, first, key_end, Sk, s_zero, o_zero, o_row, p_layout, BLOCK_M, BLOCK_N, KSPLIT,
            STAGES, True, CAUSAL, LOG2_P_SCALE, V_PERM16, WG, False)
    acc, l_i, m_i, s_i, c0, c1 = _pingpong_step(
        acc, l_i, m_i, s_i, c0, c1, hi - 1, q_smem, q_scale, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turns,
        ks_base, n_ks, offs_n, first, key_end, Sk, s_zero, o_zero, o_row, p_layout, BLOCK_M, BLOCK_N, KSPLIT,
        STAGES, True, CAUSAL, LOG2_P_SCALE, V_PERM16, WG, True)
    return acc, l_i, m_i


@gluon.jit
def _bounds(m_blk, Sk, causal_offset, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(first masked KV tile, end tile) of query block ``m_blk``: tiles [0, full_end) need no mask, [full_end,
    hi) hold the diagonal or the ragged end."""
    if CAUSAL:
        hi = gl.minimum(Sk, gl.maximum((m_blk + 1) * BLOCK_M + causal_offset, 0))
        full_end = gl.minimum(gl.maximum(m_blk * BLOCK_M + causal_offset + 1, 0) // BLOCK_N * BLOCK_N,
                              Sk // BLOCK_N * BLOCK_N)
    else:
        hi = Sk
        full_end = Sk // BLOCK_N * BLOCK_N
    return full_end // BLOCK_N, (hi + BLOCK_N - 1) // BLOCK_N


@gluon.jit
def _consumer(Q, Ks, Stats, FirstBad, n_split, Out, Lse, k_smem, v_smem, k_ready, v_ready,
              k_empty, v_empty, turns, q_smem, pid_m, b, h, bh_kv, n_tiles,
              stride_qb, stride_qh, stride_qs, stride_qd, stride_ob, stride_oh, stride_os, stride_od,
              H, BH_KV, Sq, Sk, Sk_pad, causal_offset,
              qk_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              KS_BLOCK: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_VMEAN: gl.constexpr,
              RETURN_LSE: gl.constexpr, QMAX: gl.constexpr, LOG2_P_SCALE: gl.constexpr,
              MAX_SPLIT: gl.constexpr, V_PERM16: gl.constexpr, PINGPONG: gl.constexpr, WG: gl.constexpr):
    """One consumer warpgroup, query rows [pid_m·BLOCK_M, +BLOCK_M) (``pid_m`` counts BLOCK_M-row blocks): Q's
    quantization, the KV loop over this block's tiles, the epilogue and the NaN rule. Tiles of the CTA's ring
    that this block does not need (causal, the lower block of a 2-consumer CTA) are released unread."""
    full_end_tile, hi_tile = _bounds(pid_m, Sk, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    # Layouts: int8 wgmma m64nNk32 for S (N = BLOCK_N up to 128; 256-key tiles as two n128 instructions: the
    # compiler's int8 wgmma takes no n256), fp8 wgmma m64nDk32 for O, P̃ as the register A operand.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N if BLOCK_N <= 128 else 128, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    VEC: gl.constexpr = 8  # 16-byte loads of 16-bit Q
    TPC: gl.constexpr = HEAD_DIM // VEC if HEAD_DIM // VEC < 32 else 32
    q_blk: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TPC, TPC], [4, 1], [1, 0])
    s_row: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_col: gl.constexpr = gl.SliceLayout(0, o_layout)

    # Q: per-token int8 with a NaN-keeping row max (a bad row gets a non-finite scale: the NaN rule for Q)
    offs_qm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_blk))
    offs_qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_blk))
    qf = gl.load(Q + b.to(gl.int64) * stride_qb + h * stride_qh + offs_qm[:, None] * stride_qs
                 + offs_qd[None, :] * stride_qd,
                 mask=(offs_qm < Sq)[:, None], other=0.0).to(gl.float32)
    amax = gl.reduce(gl.abs(qf), 1, _max_keep_nan)
    q_scale = gl.maximum(amax / QMAX, 1e-12, propagate_nan=tl.PropagateNan.ALL)
    xq = qf / q_scale[:, None]
    q_smem.store(gl.where(xq >= 0, xq + 0.5, xq - 0.5).to(gl.int8))
    fence_async_shared()
    q_scale = q_scale * qk_scale
    c_scale = gl.convert_layout(q_scale, s_row)

    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=s_row)
    n_ks = Sk_pad // KS_BLOCK  # K scales per head
    ks_base = Ks + bh_kv * n_ks
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, s_row)
    l_i = gl.zeros([BLOCK_M], gl.float32, s_row)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    if PINGPONG:
        acc, l_i, m_i = _tiles_pingpong(acc, l_i, m_i, q_smem, c_scale, k_smem, v_smem, k_ready, v_ready, k_empty,
                                        v_empty, turns, ks_base, n_ks, offs_m, full_end_tile, hi_tile, Sk,
                                        causal_offset, s_layout, o_layout, p_layout, BLOCK_M, BLOCK_N, KS_BLOCK,
                                        HEAD_DIM, STAGES, CAUSAL, LOG2_P_SCALE, V_PERM16, WG)
    else:
        acc, l_i, m_i = _tiles(acc, l_i, m_i, q_smem, c_scale, k_smem, v_smem, k_ready, v_ready,
                               k_empty, v_empty, ks_base, n_ks, offs_m, 0, full_end_tile,
                               Sk, causal_offset, s_layout, o_layout, p_layout, BLOCK_M, BLOCK_N, KS_BLOCK,
                               HEAD_DIM, STAGES, False, CAUSAL, LOG2_P_SCALE, V_PERM16)
        acc, l_i, m_i = _tiles(acc, l_i, m_i, q_smem, c_scale, k_smem, v_smem, k_ready, v_ready,
                               k_empty, v_empty, ks_base, n_ks, offs_m, full_end_tile, hi_tile,
                               Sk, causal_offset, s_layout, o_layout, p_layout, BLOCK_M, BLOCK_N, KS_BLOCK,
                               HEAD_DIM, STAGES, True, CAUSAL, LOG2_P_SCALE, V_PERM16)
    # tiles the other consumer reads: wait until they landed (so the arrival counts for them), release
    for j in range(hi_tile, n_tiles):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        mbarrier.arrive(k_empty.index(slot), count=1)
        mbarrier.wait(v_ready.index(slot), phase)
        mbarrier.arrive(v_empty.index(slot), count=1)
        if PINGPONG:  # keep the turns in step: the other warpgroup takes one turn per tile and one more
            _turn(turns, j + 1, WG)
            mbarrier.arrive(turns.index(1 - WG), count=1)

    # Epilogue: 1/l (l holds 448·Σp) and V's per-channel scale once per row; rows that saw no key give zeros.
    offs_om = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=o_row)
    offs_d = gl.arange(0, HEAD_DIM, layout=o_col)
    l_o = gl.convert_layout(l_i, o_row)
    l_safe = gl.where(l_o > 0, l_o, 1.0)
    out = acc * (gl.load(Stats + (BH_KV + bh_kv) * HEAD_DIM + offs_d)[None, :] / l_safe[:, None])
    if HAS_VMEAN:
        out = gl.where(l_o[:, None] > 0, out + gl.load(Stats + (2 * BH_KV + bh_kv) * HEAD_DIM + offs_d)[None, :], 0.0)
    row_ok = offs_om < Sq
    o_ptr = (Out + b.to(gl.int64) * stride_ob + h * stride_oh + offs_om[:, None] * stride_os
             + offs_d[None, :] * stride_od)
    gl.store(o_ptr, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    lse_ptr = Lse + (b * H + h).to(gl.int64) * Sq + offs_om
    if RETURN_LSE:
        m_o = gl.convert_layout(m_i, o_row)
        lse = gl.where(l_o > 0, (m_o + gl.log2(l_safe / 448.0)) * 0.6931471805599453, float("-inf"))
        gl.store(lse_ptr, lse, mask=row_ok)
    # NaN rule: a non-finite query scale, or a bad key this row attends to (≤ MAX_SPLIT int32 from L2)
    chunk = gl.arange(0, MAX_SPLIT, layout=gl.BlockedLayout([1], [32], [4], [0]))
    first = gl.min(gl.load(FirstBad + bh_kv * n_split + chunk, mask=chunk < n_split, other=Sk), axis=0)
    if CAUSAL:
        sees_bad = first <= offs_om + causal_offset
    else:
        sees_bad = (offs_om >= 0) & (first < Sk)
    q_bad = ~(gl.convert_layout(q_scale, o_row) < float("inf"))
    row_bad = row_ok & (q_bad | sees_bad)
    gl.thread_barrier()
    gl.store(o_ptr, gl.full([BLOCK_M, HEAD_DIM], float("nan"), gl.float32, o_layout).to(Out.dtype.element_ty),
             mask=row_bad[:, None])
    if RETURN_LSE:
        gl.store(lse_ptr, gl.full([BLOCK_M], float("nan"), gl.float32, o_row), mask=row_bad)


@gluon.jit
def _sage_fwd_gluon_kernel(Q, k_desc, v_desc, Ks, Stats, FirstBad, n_split, Out, Lse,
                           stride_qb, stride_qh, stride_qs, stride_qd, stride_ob, stride_oh, stride_os, stride_od,
                           H, H_KV, BH_KV, Sq, Sk, Sk_pad, causal_offset, qk_scale,
                           HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           KS_BLOCK: gl.constexpr, STAGES: gl.constexpr, QMAX: gl.constexpr, CAUSAL: gl.constexpr,
                           HAS_VMEAN: gl.constexpr, RETURN_LSE: gl.constexpr, REVERSE: gl.constexpr,
                           CONSUMERS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, LOG2_P_SCALE: gl.constexpr,
                           MAX_SPLIT: gl.constexpr, V_PERM16: gl.constexpr, PINGPONG: gl.constexpr):
    gl.static_assert(not PINGPONG or CONSUMERS == 2, "ping-pong needs two consumer warpgroups")
    pid_m, pid_bh = gl.program_id(0), gl.program_id(1)
    if REVERSE:  # causal: the longest rows first, so the short ones fill the tail of the launch
        pid_m = gl.num_programs(0) - 1 - pid_m
    b = pid_bh // H
    h = pid_bh % H
    bh_kv = b * H_KV + h // (H // H_KV)
    # the CTA's KV tiles: those of its last (longest, when causal) query block
    _, n_tiles = _bounds(pid_m * CONSUMERS + CONSUMERS - 1, Sk, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    k_row0 = bh_kv * Sk_pad
    v_row0 = bh_kv * HEAD_DIM

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.int8)
    q_smem = gl.allocate_shared_memory(gl.int8, [CONSUMERS, BLOCK_M, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HEAD_DIM, BLOCK_N], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # PINGPONG: one per consumer
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    fence_async_shared()

    if CONSUMERS == 1:
        gl.warp_specialize([
            (_consumer, (Q, Ks, Stats, FirstBad, n_split, Out, Lse, k_smem, v_smem, k_ready,
                         v_ready, k_empty, v_empty, turns, q_smem.index(0), pid_m, b, h, bh_kv, n_tiles,
                         stride_qb, stride_qh, stride_qs, stride_qd, stride_ob, stride_oh, stride_os, stride_od, H,
                         BH_KV, Sq, Sk, Sk_pad, causal_offset, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, KS_BLOCK,
                         STAGES, CAUSAL, HAS_VMEAN, RETURN_LSE, QMAX, LOG2_P_SCALE, MAX_SPLIT, V_PERM16, False, 0)),
            (_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, n_tiles, k_row0,
                         v_row0, BLOCK_N, STAGES)),
        ], [1], [PRODUCER_REGS])
    else:  # two consumer warpgroups (query blocks 2·pid_m and 2·pid_m + 1) sharing the K/V ring
        gl.warp_specialize([
            (_consumer, (Q, Ks, Stats, FirstBad, n_split, Out, Lse, k_smem, v_smem, k_ready,
                         v_ready, k_empty, v_empty, turns, q_smem.index(0), pid_m * 2, b, h, bh_kv, n_tiles,
                         stride_qb, stride_qh, stride_qs, stride_qd, stride_ob, stride_oh, stride_os, stride_od, H,
                         BH_KV, Sq, Sk, Sk_pad, causal_offset, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, KS_BLOCK,
                         STAGES, CAUSAL, HAS_VMEAN, RETURN_LSE, QMAX, LOG2_P_SCALE, MAX_SPLIT, V_PERM16, PINGPONG, 0)),
            (_consumer, (Q, Ks, Stats, FirstBad, n_split, Out, Lse, k_smem, v_smem, k_ready,
                         v_ready, k_empty, v_empty, turns, q_smem.index(1), pid_m * 2 + 1, b, h, bh_kv, n_tiles,
                         stride_qb, stride_qh, stride_qs, stride_qd, stride_ob, stride_oh, stride_os, stride_od, H,
                         BH_KV, Sq, Sk, Sk_pad, causal_offset, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, KS_BLOCK,
                         STAGES, CAUSAL, HAS_VMEAN, RETURN_LSE, QMAX, LOG2_P_SCALE, MAX_SPLIT, V_PERM16, PINGPONG, 1)),
            (_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, n_tiles, k_row0,
                         v_row0, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


_GLUON_LAUNCH = FastLauncher(_sage_fwd_gluon_kernel)


# ------------------------------------------------------------------------------------------------- host side
def gluon_config(head_dim: int, causal: bool) -> dict:
    """Tile sizes and launch options. ``scale_block`` (keys per K scale, the pre-pass's block) equals the Triton
    kernel's BLOCK_N (``attn_kernel.kernel_config``), so both kernels quantize K alike; ``block_n`` (keys per
    tile) is ``scale_block`` or twice it (D=64: 128-key tiles with two K scales each; D=128 without a mask:
    256-key tiles, ``D128_FULL_TILES``). ``block_m``: query rows per consumer warpgroup, 64 (one m64 wgmma) or
    128 (two m64 wgmma per warpgroup: the per-tile waits, barriers and loop overhead cover twice the rows; D=128
    spills at 128 rows, 4.7 KB). ``v_perm16``: Vᵀ in ``quant_kernel.v_slot`` token order, P̃ fed to the P̃·V
    wgmma without shuffles. ``pingpong`` depends on the mask (``causal``). Design values: 64 rows (the SA2 CUDA
    CTA), 3 stages (D=128 causal: 3·(16 + 16) KB of K/Vᵀ + 8 KB Q)."""
    # Two consumer warpgroups + a producer warp (the FA3 layout): on the H200 (attention_gluon_h200.json, e18fe69)
    # the only structure correct in every row, and the fastest at D=128 from 8K on (1.27-1.29x cuDNN at 32K). The
    # one-warpgroup structure without a producer (ws=False) wrote NaN rows at D=64 with 64x64 tiles (B=2, H=32,
    # S >= 2K) and once at D=128 32K, and lost to these configs at every measured shape: removed (NOTES.md).
    # D=128: P̃ taken from the accumulator as it lies (v_perm16); FA3's ping-pong schedule for causal calls only.
    # Kernel alone, H200, two runs (4cb493d attention_gluon_h200-pp128.json; d359f3c attention_gluon_h200-rs.json),
    # TFLOP/s, ping-pong vs free-running: causal 432/434 vs 412/415 at 2K, 732/734 vs 684/688 at 8K, 830/821 vs
    # 821/815 at 32K; full 600/603 vs 636/636 at 2K, 718 vs 748 at 4K, 791/787 vs 817/824 at 8K, 856/834 vs 865/852
    # at 32K. Against the structure with neither, ping-pong + v_perm16 gained 1.03-1.11x at 8K-32K.
    cfg = dict(block_m=64, scale_block=128, num_warps=4, consumers=2, producer_regs=24, consumer_regs=240,
               reverse=True, v_perm16=True, pingpong=bool(causal), **NARROW_D128_TILES)
    if head_dim <= 64:
        cfg.update(D64_TILES)
    elif not causal:
        cfg.update(D128_FULL_TILES)
    return cfg


# D=128 without a mask: 256-key tiles (two 128-key K-scale blocks; the S wgmma as two n128 instructions) in a
# 2-stage ring (2·(32 + 32) KB of K/Vᵀ). The per-tile costs (mbarrier waits, warpgroup barriers, the row max's
# shuffles, α, the exponent's bias) cover twice the keys, and acc·α runs half as often per score. Against
# NARROW_D128_TILES (the default before) in one process (H200, 14a7839, B=2 H=32, pre-pass
# included, TFLOP/s): 8K 793 vs 746 (1.20x vs 1.13x cuDNN), 32K 927 vs 857 (1.48x vs 1.37x); 2K 432 vs 440. A
# 3-stage ring (214 KB of shared memory) was 756 / 893. Causal calls keep 128-key tiles: 256 in the ping-pong
# spills 152 B and ran 0.86x, free-running 0.98-1.0x.
D128_FULL_TILES = dict(block_n=256, stages=2)
NARROW_D128_TILES = dict(block_n=128, stages=3)


# D=64: 128 query rows per consumer warpgroup and 128-key tiles (two 64-key K-scale blocks), P̃ taken from the
# accumulator's registers as they lie (v_perm16). Against 64x64 tiles (H200, ad1a33c, attention_gluon_h200-d64.json,
# B=2 H=32, TFLOP/s, full / causal): the kernel alone 446 vs 300 / 219 vs 187 at 2K, 554 vs 353 / 449 vs 333 at 8K,
# 596 vs 389 / 532 vs 366 at 32K; GPU time with the pre-pass 332 vs 256 / 177 vs 184 at 2K (the one loss), 516 vs
# 340 / 405 vs 310 at 8K, 586 vs 389 / 518 vs 365 at 32K. 128 rows alone or 128 keys alone were in between.
# SMALL_D64_TILES: the 64x64 tiles (the D=64 default before).
# The ping-pong schedule needs 64 rows per consumer at D=64 (128 spill), and there it lost to these tiles without it
# (H200, 4cb493d, attention_gluon_h200-pp.json: 482 vs 589 TOP/s at 32K full, 476 vs 527 causal, kernel alone).
D64_TILES = dict(block_m=128, block_n=128, scale_block=64, v_perm16=True, pingpong=False)
SMALL_D64_TILES = dict(block_m=64, block_n=64, scale_block=64, v_perm16=False, pingpong=False)


def resolved_config(head_dim: int, config: dict | None, causal: bool):
    """(``gluon_config(head_dim, causal)`` with the overrides of ``config`` applied, read-only; its launch key: the
    items sorted), made once per (head_dim, causal, overrides): a call's host path neither merges nor sorts them
    again."""
    # each value's type in the cache key: 1, 1.0 and True are equal keys but different constexprs
    overrides = tuple((name, type(value), value) for name, value in config.items()) if config else ()
    try:
        return _resolved_config(head_dim, bool(causal), overrides)
    except TypeError:  # an unhashable override cannot key the cache: resolved afresh (a bad one raises again)
        cfg = dict(gluon_config(head_dim, causal), **config)
        return cfg, tuple(sorted(cfg.items()))


@functools.lru_cache(maxsize=64)
def _resolved_config(head_dim: int, causal: bool, overrides: tuple):
    cfg = dict(gluon_config(head_dim, causal), **{name: value for name, _, value in overrides})
    return types.MappingProxyType(cfg), tuple(sorted(cfg.items()))


def supports(*, head_dim: int, qk_bits: int, pv: str, smooth_q: bool) -> bool:
    """Whether the Gluon kernel implements this call (else the Triton kernel runs it)."""
    # 4 bits stay on the Triton kernel (per-token K scales; an accuracy mode on Hopper's int8 tensor cores)
    return head_dim in GLUON_HEAD_DIMS and pv == "fp8" and not smooth_q and qk_bits == 8


@functools.lru_cache(maxsize=None)
def shared_layouts(head_dim: int, block_n: int):
    """(K tile layout, Vᵀ tile layout) of the TMA descriptors (also the compile test's signature); made once per
    shape (each layout object costs ~10 µs of host time to build)."""
    k_layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gl.int8)
    v_layout = gl.NVMMASharedLayout.get_default_for([head_dim, block_n], gl.float8e4nv)
    return k_layout, v_layout


def launch(prepared: dict, out: torch.Tensor, lse: torch.Tensor | None, *, causal: bool, H: int, H_kv: int,
           Sq: int, Sk: int, config: dict | None = None, sig=None, resolved=None) -> None:
    """The Gluon attention kernel on the pre-pass output (``quantize_kv``) and Q; out: (B, H, Sq, D) view.
    ``sig``: everything the launch specializes on (``sage_forward_gluon`` builds it): the compiled kernel is then
    looked up by it and the config's key and launched directly (``FastLauncher.keyed``) instead of through
    Triton's binder. ``resolved``: ``resolved_config(D, config, causal)`` where the caller has it already (then
    ``config`` is not read)."""
    p = prepared
    q = p["q"]
    B, D = out.shape[0], out.shape[-1]
    cfg, cfg_key = resolved if resolved is not None else resolved_config(D, config, causal)
    k8, vt = p["k8"], p["vt"]
    BH_kv, S_pad = k8.shape[0], k8.shape[1]
    if p["k_scale"].shape[1] * cfg["scale_block"] != S_pad or cfg["block_n"] not in (cfg["scale_block"],
                                                                                  2 * cfg["scale_block"]):
        raise ValueError(f"gluon launch: block_n {cfg['block_n']} must be 1 or 2 K-scale blocks of "
                         f"{cfg['scale_block']} keys, as the pre-pass wrote them ({S_pad} keys, "
                         f"{p['k_scale'].shape[1]} scales)")
    if cfg["consumers"] not in (1, 2) or (cfg["pingpong"] and cfg["consumers"] != 2):
        raise ValueError(f"gluon launch: config consumers must be 1 or 2, and pingpong=True needs consumers=2 (two "
                         f"consumer warpgroups take turns), got consumers={cfg['consumers']}, "
                         f"pingpong={cfg['pingpong']}")
    if p.get("v_perm16", False) != cfg["v_perm16"]:
        raise ValueError(f"gluon launch: config v_perm16={cfg['v_perm16']} but the pre-pass wrote Vᵀ with "
                         f"v_perm16={p.get('v_perm16', False)}")
    k_layout, v_layout = shared_layouts(D, cfg["block_n"])
    k2 = k8.view(BH_kv * S_pad, D)
    v2 = vt.view(BH_kv * D, S_pad)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [cfg["block_n"], D], k_layout)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [D, cfg["block_n"]], v_layout)
    grid = (cdiv(max(Sq, 1), cfg["block_m"] * cfg["consumers"]), B * H)
    args = (
        q, k_desc, v_desc, p["k_scale"], p["stats"], p["first_bad"], p["first_bad"].shape[1], out,
        lse if lse is not None else out, *q.stride(), *out.stride(), H, H_kv, BH_kv, Sq, Sk, S_pad, Sk - Sq,
        p["sm_scale"] * LOG2E)
    constexprs = dict(
        HEAD_DIM=D, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], KS_BLOCK=cfg["scale_block"],
        STAGES=cfg["stages"], QMAX=p["qmax"],
        CAUSAL=causal, HAS_VMEAN=p["smooth_v"], RETURN_LSE=lse is not None, REVERSE=causal and cfg["reverse"],
        CONSUMERS=cfg["consumers"], PRODUCER_REGS=cfg["producer_regs"],
        CONSUMER_REGS=cfg["consumer_regs"], LOG2_P_SCALE=LOG2_FP8_MAX, MAX_SPLIT=MAX_SPLIT,
        V_PERM16=cfg["v_perm16"], PINGPONG=cfg["pingpong"])
    if sig is None:
        _sage_fwd_gluon_kernel[grid](*args, **constexprs, num_warps=cfg["num_warps"])
    else:
        _GLUON_LAUNCH.keyed((sig, cfg_key), grid, *args, **constexprs,
                            num_warps=cfg["num_warps"], num_stages=None)


def sage_forward_gluon(q, k, v, *, causal: bool, sm_scale: float, qk_bits: int = 8, pv: str = "fp8",
                       smooth_k: bool = True, smooth_v: bool = False, return_lse: bool = False,
                       config: dict | None = None, smooth_q: bool = False):
    """``attn_kernel.sage_forward_triton``'s signature and results, on the Gluon kernel (CUDA, sm_90).
    Same pre-pass (``quantize_kv``: statistics + quantization, 2 launches), then the Gluon attention launch."""
    if not supports(head_dim=q.shape[-1], qk_bits=qk_bits, pv=pv, smooth_q=smooth_q):
        raise ValueError(f"sage_forward_gluon: head_dim {q.shape[-1]}, qk_bits={qk_bits}, pv={pv!r}, "
                         f"smooth_q={smooth_q} not implemented (head_dim 64/128, pv='fp8', no smooth_q)")
    B, H, Sq, D = q.shape
    H_kv, Sk = k.shape[1], k.shape[2]
    resolved = resolved_config(D, config, causal)
    cfg = resolved[0]
    qmax = 127.0 if qk_bits == 8 else 7.0
    # What the three launches specialize on (as attn_kernel.sage_forward_triton's): their compiled kernels are
    # looked up by it. Intermediates (codes, descriptors' tensors, out, lse) are fresh allocations, hence aligned.
    sig = ("gluon", q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, k.dtype, q.data_ptr() % 16,
           k.data_ptr() % 16, v.data_ptr() % 16, causal, qk_bits, smooth_k, smooth_v, return_lse)
    kv = quantize_kv(k, v, qmax=qmax, block_n=cfg["scale_block"], smooth_k=smooth_k, fp8_v=True,
                     smooth_v=smooth_v, sig=sig, v_perm16=cfg["v_perm16"])
    prepared = dict(q=q, qmax=qmax, sm_scale=sm_scale, smooth_v=smooth_v, **kv)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device) if return_lse else None
    launch(prepared, out, lse, causal=causal, H=H, H_kv=H_kv, Sq=Sq, Sk=Sk, sig=sig, resolved=resolved)
    if not return_lse:
        return out
    if smooth_k:  # the kernel's LSE is of the smoothed scores
        lse = unsmoothed_lse(lse, q, kv["stats"][0], sm_scale)
    return out, lse
