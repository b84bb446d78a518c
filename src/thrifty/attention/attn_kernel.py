"""The Triton forward of SageAttention2 (8-bit): INT8 Q·Kᵀ (int32 accumulation), FP8 e4m3 P̃·V.

One program quantizes its BLOCK_M query rows (int8, one scale per token, sm_scale·log2e folded in) and walks
the KV tiles of its kv head (GQA by index math: kv head = head // group, K/V are never repeated in memory).
Per tile, with c = q_scale·k_scale per row:

    s   = int32 dot(q̂, k̂ᵀ)
    m   = max(m, rowmax(s)·c)                            # online softmax in base 2
    p̃   = e4m3(448·2^(s·c − m))                          # static scale: P̃ = 1 ↦ largest e4m3 value
    acc = acc·α + dot(p̃, v̂)                              # fresh fp32 partial per tile (two-level accum.)

On the GPU (``fold``) the middle two lines cost one IADD and ONE FFMA per score: s + 0x4B400000 read as a
float is exactly 1.5·2²³ + s, and 1.5·2²³·c, m and log2 448 go into one per-row bias. The epilogue applies
1/l and V's per-channel scale once per row. Tiles that need no mask (interior tiles; all tiles left of the
diagonal when causal) run a loop without any masking; only the diagonal and the ragged last tile run the
masked loop. Causal with q_len < kv_len aligns queries to the last positions. See NOTES.md.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..triton_utils import LOG2E, FastLauncher, cdiv, launch_with, mma
from .quant_kernel import FP8_MAX, INTERPRET, MAX_SPLIT, quantize_kv, quantize_rows, to_e4m3, unsmoothed_lse
from .reference import SMOOTH_Q_BLOCK

LN2 = math.log(2.0)


@triton.jit
def _exp2(x, FTZ: tl.constexpr):
    """2^x; FTZ: one MUFU.EX2 (``ex2.approx.ftz.f32``, subnormal results flushed: p̃ loses them anyway)."""
    if FTZ:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return tl.math.exp2(x)


@triton.jit
def _tiles(acc, l_i, m_i, q, q_scale, k_base, ks_base, v_base, offs_m, lo, hi, Sk, Sk_pad, causal_offset,
           HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
           PV_FP8: tl.constexpr, P_SCALE: tl.constexpr, PRE_ROUND: tl.constexpr, FAST_CVT: tl.constexpr,
           WS: tl.constexpr, FOLD: tl.constexpr, FTZ: tl.constexpr,
           LOG2_P_SCALE: tl.constexpr, kr_base, kr_ss, kr_sd, q_bar, ds0, qk_scale, SMOOTH_Q: tl.constexpr,
           SMOOTH_ROWS: tl.constexpr, K_PER_TOKEN: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        cols = start_n + offs_n
        k = tl.load(k_base + cols[None, :] * HEAD_DIM + offs_d[:, None])  # (D, BLOCK_N), D contiguous
        if K_PER_TOKEN:  # per row: dequantization · sm_scale · log2e; the keys' scales multiply t below
            c = q_scale
        else:
            c = q_scale * tl.load(ks_base + start_n // BLOCK_N)
        s_i = tl.dot(q, k)  # int32
        if FAST_CVT:
            # int32 → fp32 without I2F (a quarter-rate instruction, like ex2): the bit pattern of 1.5·2^23
            # plus s is the float 1.5·2^23 + s exactly for |s| < 2^22 (D·127² ≤ 2.1M), and subtracting
            # 1.5·2^23 again is exact. Two full-rate integer/FP32 ops instead.
            f = (s_i + 0x4B400000).to(tl.float32, bitcast=True)
            t = f - 12582912.0
        else:
            t = s_i.to(tl.float32)
        if K_PER_TOKEN:
            t = t * tl.load(ks_base + cols)[None, :]
        if SMOOTH_Q:
            # ΔS = mean(q_group)·(k − mean K) from the unquantized K (fp32, the paper's GEMV: one per group of
            # SMOOTH_ROWS queries), folded into t in units of the dequantized dot product so that everything
            # below is unchanged: t·c + ΔS·qk_scale.
            kr = tl.load(kr_base + cols[None, :] * kr_ss + offs_d[:, None] * kr_sd, mask=cols[None, :] < Sk,
                         other=0.0).to(tl.float32)
            ds = _group_delta_s(q_bar, ds0, kr, acc.shape[0], SMOOTH_ROWS) * qk_scale
            t = t + ds * (1.0 / c)[:, None]
        if MASKED:
            keep = cols[None, :] < Sk
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + causal_offset)
            t = tl.where(keep, t, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(t, axis=1) * c)
            # a row that has seen no key yet keeps m = -inf; exp2(-inf - 0) = 0 instead of nan
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        elif FAST_CVT and not SMOOTH_Q and not K_PER_TOKEN:
            m_new = tl.maximum(m_i, tl.max(s_i, axis=1).to(tl.float32) * c)  # c > 0: max commutes with ·c
        else:
            m_new = tl.maximum(m_i, tl.max(t, axis=1) * c)
        alpha = tl.math.exp2(m_i - m_new)
        v = tl.load(v_base + offs_d[None, :] * Sk_pad + cols[:, None])  # (BLOCK_N, D), tokens contiguous
        if FOLD:
            # p = P_SCALE·2^(s·c − m) from ONE FFMA on the magic-number float f = 1.5·2^23 + s: the bias
            # 1.5·2^23·c + m − log2(P_SCALE) is per row; its rounding (≤ 0.75·c, i.e. under one unit of the
            # int32 dot product) is far below the int8 quantization noise. No multiply by P_SCALE left.
            if MASKED:
                x = tl.fma(t, c[:, None], -(m_new - LOG2_P_SCALE)[:, None])
            else:
                x = tl.fma(f, c[:, None], -(c * 12582912.0 + (m_new - LOG2_P_SCALE))[:, None])
            if PRE_ROUND:  # the interpreter's e4m3 conversion does not saturate; the GPU's does
                x = tl.minimum(x, LOG2_P_SCALE)
            p = _exp2(x, FTZ)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            partial = tl.dot(to_e4m3(p, PRE_ROUND), v)
        else:
            x = tl.fma(t, c[:, None], -m_new[:, None])  # scores − row max, log2 units, one FFMA
            p = _exp2(x, FTZ)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if PV_FP8:
                partial = tl.dot(to_e4m3(p * P_SCALE, PRE_ROUND), v)
            else:
                partial = mma(p.to(v.dtype), v, tl.zeros_like(acc))
        acc = acc * alpha[:, None] + partial
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _group_delta_s(q_bar, ds0, kr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr):
    """ΔS of one KV tile, (BLOCK_M, BLOCK_N): row r gets mean(q_group(r))·kr − ds0[group(r)], from each group's
    mean (q_bar: (G, D)), the tile's unquantized keys (kr: (D, BLOCK_N)) and ds0 = mean·mean(K) per group (G,),
    which makes the product one with the smoothed keys K − mean(K). One GEMV per group of ROWS queries."""
    G: tl.constexpr = BLOCK_M // ROWS
    group = tl.arange(0, G)
    row_group = tl.arange(0, BLOCK_M) // ROWS
    ds = tl.zeros((BLOCK_M, kr.shape[1]), tl.float32)
    for g in tl.static_range(G):
        mean_g = tl.sum(tl.where(group[:, None] == g, q_bar, 0.0), axis=0)
        ds_g = tl.sum(mean_g[:, None] * kr, axis=0) - tl.sum(tl.where(group == g, ds0, 0.0), axis=0)
        ds = tl.where(row_group[:, None] == g, ds_g[None, :], ds)
    return ds


@triton.jit
def _smooth_q(qf, row_ok, n_rows, k_mean, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """SageAttention2's Q smoothing per group of ROWS queries: (qf minus its group's mean, the means (G, D),
    ds0 = mean·mean(K) (G,)). ``n_rows``: this block's valid rows (the means are over those only)."""
    G: tl.constexpr = BLOCK_M // ROWS
    sums = tl.sum(tl.reshape(qf, (G, ROWS, HEAD_DIM)), axis=1)
    count = tl.minimum(tl.maximum(n_rows - tl.arange(0, G) * ROWS, 1), ROWS).to(tl.float32)
    q_bar = sums / count[:, None]
    per_row = tl.reshape(tl.broadcast_to(q_bar[:, None, :], (G, ROWS, HEAD_DIM)), (BLOCK_M, HEAD_DIM))
    qf = tl.where(row_ok[:, None], qf - per_row, 0.0)
    return qf, q_bar, tl.sum(q_bar * k_mean[None, :], axis=1)


@triton.jit
def _sees_bad_key(first_bad_base, n_split, Sk, offs_m, causal_offset, CAUSAL: tl.constexpr,
                  MAX_SPLIT: tl.constexpr):
    """Rows that attend to a key whose K or V row holds NaN/inf: the statistics pass wrote each token chunk's
    first such key (else Sk); their minimum is the head's first bad key, and query i sees it iff it is
    ≤ i + causal_offset (any key without ``causal``). ≤ MAX_SPLIT int32 from L2, once per program."""
    chunk = tl.arange(0, MAX_SPLIT)
    first = tl.min(tl.load(first_bad_base + chunk, mask=chunk < n_split, other=Sk), axis=0)
    if CAUSAL:
        return first <= offs_m + causal_offset
    return (offs_m >= 0) & (first < Sk)


@triton.jit
def _sage_fwd_kernel(Q, K, Ks, V, Stats, FirstBad, n_split, Out, Lse,
                     stride_qb, stride_qh, stride_qs, stride_qd,
                     stride_ob, stride_oh, stride_os, stride_od,
                     H, H_KV, BH_KV, Sq, Sk, Sk_pad, causal_offset, qk_scale,
                     KR, stride_kb, stride_kh, stride_ks, stride_kd,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QMAX: tl.constexpr,
                     CAUSAL: tl.constexpr, PV_FP8: tl.constexpr, P_SCALE: tl.constexpr,
                     HAS_VMEAN: tl.constexpr, RETURN_LSE: tl.constexpr, PRE_ROUND: tl.constexpr,
                     FAST_CVT: tl.constexpr, REVERSE: tl.constexpr, WS: tl.constexpr,
                     FOLD: tl.constexpr, FTZ: tl.constexpr, LOG2_P_SCALE: tl.constexpr,
                     SMOOTH_Q: tl.constexpr, SMOOTH_ROWS: tl.constexpr, K_PER_TOKEN: tl.constexpr,
                     MAX_SPLIT: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    if REVERSE:  # causal: the longest rows first, so the short ones fill the tail of the launch
        pid_m = tl.num_programs(0) - 1 - pid_m
    b, h = pid_bh // H, pid_bh % H
    bh_kv = b * H_KV + h // (H // H_KV)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    # Q quantized here, per token (no pre-pass for Q); qk_scale = sm_scale·log2e folded into its scale.
    qf = tl.load(Q + b.to(tl.int64) * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs
                 + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0).to(tl.float32)
    # NaN in -> NaN out (reference.nonfinite_rows) for queries: a row holding NaN/inf gets a non-finite scale
    # from quantize_rows; its arithmetic stays in its own row and the epilogue writes it as NaN.
    q_bad = offs_m < 0  # no row, unless Q smoothing zeroes the bad elements below (then the scale is finite)
    if SMOOTH_Q:  # SageAttention2 Q smoothing: each group's mean removed, ΔS added back per tile
        q_ok = tl.abs(qf) < float("inf")  # bad elements as zeros: they cannot spread through the group mean
        q_bad = tl.max(tl.where(q_ok, 0, 1), axis=1) > 0
        qf = tl.where(q_ok, qf, 0.0)
        # ΔS uses γ(K) = K − mean(K): ds0 = q̄·mean(K) per group
        qf, q_bar, ds0 = _smooth_q(qf, row_ok, Sq - pid_m * BLOCK_M, tl.load(Stats + bh_kv * HEAD_DIM + offs_d),
                                   BLOCK_M, HEAD_DIM, SMOOTH_ROWS)
    else:
        q_bar = tl.zeros((BLOCK_M // SMOOTH_ROWS, HEAD_DIM), tl.float32)
        ds0 = tl.zeros((BLOCK_M // SMOOTH_ROWS,), tl.float32)
    q, q_scale = quantize_rows(qf, QMAX)
    q_scale = q_scale * qk_scale
    kr_base = KR + b.to(tl.int64) * stride_kb + (h // (H // H_KV)) * stride_kh
    k_base = K + bh_kv.to(tl.int64) * Sk_pad * HEAD_DIM
    v_base = V + bh_kv.to(tl.int64) * HEAD_DIM * Sk_pad
    ks_base = Ks + bh_kv * (Sk_pad if K_PER_TOKEN else Sk_pad // BLOCK_N)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    # Tiles [0, full_end) need no mask; [full_end, hi) hold the diagonal or the ragged end.
    if CAUSAL:
        hi = tl.minimum(Sk, tl.maximum((pid_m + 1) * BLOCK_M + causal_offset, 0))
        full_end = tl.minimum(tl.maximum(pid_m * BLOCK_M + causal_offset + 1, 0) // BLOCK_N * BLOCK_N,
                              Sk // BLOCK_N * BLOCK_N)
    else:
        hi = Sk
        full_end = Sk // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _tiles(acc, l_i, m_i, q, q_scale, k_base, ks_base, v_base, offs_m, 0, full_end, Sk,
                           Sk_pad, causal_offset, HEAD_DIM, BLOCK_N, False, CAUSAL, PV_FP8, P_SCALE, PRE_ROUND,
                           FAST_CVT, WS, FOLD, FTZ, LOG2_P_SCALE, kr_base, stride_ks, stride_kd, q_bar, ds0,
                           qk_scale, SMOOTH_Q, SMOOTH_ROWS, K_PER_TOKEN)
    acc, l_i, m_i = _tiles(acc, l_i, m_i, q, q_scale, k_base, ks_base, v_base, offs_m, full_end, hi, Sk,
                           Sk_pad, causal_offset, HEAD_DIM, BLOCK_N, True, CAUSAL, PV_FP8, P_SCALE, PRE_ROUND,
                           FAST_CVT, False, FOLD, FTZ, LOG2_P_SCALE, kr_base, stride_ks, stride_kd, q_bar, ds0,
                           qk_scale, SMOOTH_Q, SMOOTH_ROWS, K_PER_TOKEN)

    # Epilogue: 1/(l·P_SCALE) and V's per-channel scale once per row; rows that saw no key output zeros.
    l_norm = l_i if FOLD else l_i * P_SCALE  # FOLD's l already holds P_SCALE·Σp
    l_safe = tl.where(l_i > 0, l_norm, 1.0)
    out = acc * (tl.load(Stats + (BH_KV + bh_kv) * HEAD_DIM + offs_d)[None, :] / l_safe[:, None])
    if HAS_VMEAN:
        out = tl.where(l_i[:, None] > 0, out + tl.load(Stats + (2 * BH_KV + bh_kv) * HEAD_DIM + offs_d)[None, :], 0.0)
    o_ptr = Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    lse_ptr = Lse + pid_bh.to(tl.int64) * Sq + offs_m
    if RETURN_LSE:
        lse = tl.where(l_i > 0, (m_i + tl.math.log2(l_safe / P_SCALE)) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr, lse, mask=row_ok)
    # NaN in -> NaN out, once the results are stored (the accumulator is dead: no register pressure added
    # where the tile loop's values are live); the NaN stores are predicated off unless a row is bad, and the
    # barrier orders them after the first stores of other threads.
    row_bad = row_ok & (q_bad | ~(q_scale < float("inf")) | _sees_bad_key(FirstBad + bh_kv * n_split, n_split, Sk,
                                                                         offs_m, causal_offset, CAUSAL, MAX_SPLIT))
    tl.debug_barrier()
    tl.store(o_ptr, tl.full((BLOCK_M, HEAD_DIM), float("nan"), tl.float32).to(Out.dtype.element_ty),
             mask=row_bad[:, None])
    if RETURN_LSE:
        tl.store(lse_ptr, tl.full((BLOCK_M,), float("nan"), tl.float32), mask=row_bad)


_FWD_LAUNCH = FastLauncher(_sage_fwd_kernel)


def kernel_config(head_dim: int, device: torch.device) -> dict:
    """Tile sizes, launch options and inner-loop variants (NOTES.md, v3/v4). Small tiles under the
    interpreter keep CPU tests fast; there the inner loop is the reference's arithmetic step for step (no
    inline PTX, no folded exponent). On the GPU (H100 sweeps at S=8k, benchmarks/results/attention_h100.json):
    D=128: 64x128 tiles, 4 warps, 3 stages; D=64: 64x64, 4 warps, 3 stages (+13% over 128x64).
    ``fold``: the magic-number offset and P_SCALE folded into one FFMA per score (+7% D=128, +13% D=64);
    ``fast_cvt``: int32→fp32 without I2F; ``reverse``: causal rows longest first (+4% D=64 causal);
    ``ftz``: ex2.approx.ftz (no measurable change); ``ws``: tl.range warp_specialize (does not compile
    for this loop in Triton 3.6 on sm_90)."""
    if INTERPRET and device.type == "cpu":
        return dict(block_m=32, block_n=16, num_warps=4, num_stages=1, fast_cvt=True,
                    reverse=True, ws=False, fold=False, ftz=False)
    variants = dict(fast_cvt=True, reverse=True, ws=False, fold=True, ftz=True)
    if head_dim <= 64:
        return dict(block_m=64, block_n=64, num_warps=4, num_stages=3, **variants)
    return dict(block_m=64, block_n=128, num_warps=4, num_stages=3, **variants)


# fp32 V tiles (fp32 inputs with pv="fp16") take twice the shared memory: at D=128, 3 stages need 248 KB, over
# the H100's 227 KB per block (tests/test_compile_sm90.py); 2 stages need 168 KB
FP32_V_MAX_STAGES = 2

_CONFIGS: dict = {}


def _config(head_dim: int, device: torch.device, config: dict | None) -> dict:
    if config:
        return dict(kernel_config(head_dim, device), **config)
    key = (head_dim, device.type)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = _CONFIGS[key] = kernel_config(head_dim, device)
    return cfg


def quantize_inputs(q, k, v, *, sm_scale: float, qk_bits: int = 8, pv: str = "fp8", smooth_k: bool = True,
                    smooth_v: bool = False, config: dict | None = None, smooth_q: bool = False, sig=None) -> dict:
    """The pre-pass (K and V: 2 launches; Q is quantized inside the attention kernel): everything the
    kernel reads, quantized and laid out (see quant_kernel)."""
    cfg = _config(q.shape[-1], q.device, config)
    qmax = 127.0 if qk_bits == 8 else 7.0
    k_per_token = qk_bits == 4  # SageAttention2-4b here: one K scale per key (reference: k_granularity="token")
    kv = quantize_kv(k, v, qmax=qmax, block_n=cfg["block_n"], smooth_k=smooth_k, fp8_v=pv == "fp8",
                     smooth_v=smooth_v, sig=sig, k_per_token=k_per_token)
    return dict(q=q, qmax=qmax, sm_scale=sm_scale, **kv, pv_fp8=pv == "fp8", smooth_v=smooth_v, cfg=cfg,
                k_raw=k, smooth_q=smooth_q, k_per_token=k_per_token)


def launch(prepared: dict, out: torch.Tensor, lse: torch.Tensor | None, *, causal: bool, H: int, H_kv: int,
           Sq: int, Sk: int, sig=None) -> None:
    """The attention kernel (with Q's quantization) on prepared K/V (out: (B, H, Sq, D) view of any
    strides)."""
    p, cfg = prepared, prepared["cfg"]
    q = p["q"]
    B, D = out.shape[0], out.shape[-1]
    block_m = cfg["block_m"]
    fold = cfg["fold"] and cfg["fast_cvt"] and p["pv_fp8"] and not p["smooth_q"] and not p["k_per_token"]
    ftz = cfg["ftz"] and not INTERPRET
    grid = (cdiv(max(Sq, 1), block_m), B * H)
    return launch_with(_FWD_LAUNCH, sig, grid,
        q, p["k8"], p["k_scale"], p["vt"], p["stats"], p["first_bad"], p["first_bad"].shape[1], out, lse if lse is not None else out,
        *q.stride(), *out.stride(), H, H_kv, B * H_kv, Sq, Sk, p["k8"].shape[1], Sk - Sq,
        p["sm_scale"] * LOG2E, p["k_raw"], *p["k_raw"].stride(),
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=cfg["block_n"], QMAX=p["qmax"], CAUSAL=causal,
        PV_FP8=p["pv_fp8"], P_SCALE=FP8_MAX if p["pv_fp8"] else 1.0, HAS_VMEAN=p["smooth_v"],
        RETURN_LSE=lse is not None, PRE_ROUND=INTERPRET, FAST_CVT=cfg["fast_cvt"],
        REVERSE=causal and cfg["reverse"], WS=cfg["ws"], FOLD=fold, FTZ=ftz,
        LOG2_P_SCALE=math.log2(FP8_MAX) if p["pv_fp8"] else 0.0, SMOOTH_Q=p["smooth_q"],
        SMOOTH_ROWS=SMOOTH_Q_BLOCK, K_PER_TOKEN=p["k_per_token"], MAX_SPLIT=MAX_SPLIT, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"] if p["vt"].element_size() < 4 else min(cfg["num_stages"], FP32_V_MAX_STAGES))


def sage_forward_triton(q, k, v, *, causal: bool, sm_scale: float, qk_bits: int = 8, pv: str = "fp8",
                        smooth_k: bool = True, smooth_v: bool = False, return_lse: bool = False,
                        config: dict | None = None, smooth_q: bool = False):
    """(B, H, Sq, D), (B, Hkv, Sk, D) views of any strides → out like q (same strides order) [, lse fp32].
    Three launches: K/V statistics, K/V quantization, attention (with Q's quantization). The host cost
    is in NOTES.md (FastLauncher skips Triton's binder on repeated calls).
    Replaying recorded launches with reused intermediates was tried (NOTES.md v4) and dropped: no gain shown
    in the box's noisy host timing, and it kept up to 512 MB of buffers alive behind the user's back."""
    B, H, Sq, D = q.shape
    H_kv, Sk = k.shape[1], k.shape[2]
    # Everything the three launches specialize on, in one tuple: their launch keys come from it instead of
    # ~60 per-argument checks (FastLauncher.keyed). Intermediates are fresh allocations, hence aligned.
    sig = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, k.dtype, q.data_ptr() % 16,
           k.data_ptr() % 16, v.data_ptr() % 16, causal, qk_bits, pv, smooth_k, smooth_v, smooth_q, return_lse,
           None if config is None else tuple(sorted(config.items())))
    prepared = quantize_inputs(q, k, v, sm_scale=sm_scale, qk_bits=qk_bits, pv=pv, smooth_k=smooth_k,
                               smooth_v=smooth_v, config=config, smooth_q=smooth_q, sig=sig)
    out = torch.empty_like(q)  # keeps q's memory layout: a (B, S, H, D) view gets a (B, S, H, D) output
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device) if return_lse else None
    launch(prepared, out, lse, causal=causal, H=H, H_kv=H_kv, Sq=Sq, Sk=Sk, sig=sig)
    if not return_lse:
        return out
    if smooth_k:  # the kernel's LSE is of the smoothed scores
        lse = unsmoothed_lse(lse, q, prepared["stats"][0], sm_scale)
    return out, lse
