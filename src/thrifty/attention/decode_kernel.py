"""Split-K decode attention over a :class:`~thrifty.attention.kv_cache.QuantizedKV` (int8 codes, per-token
scales): for queries of 1–16 rows, where the prefill kernel (64-row tiles, a K/V pre-pass every call) is the
wrong tool.

Decode is a memory-bound pass over the cache: the kernel's job is to read every cache byte once, at full
bandwidth, with enough programs in flight. Two launches:

1. ``_decode_split_kernel``, grid (B·Hkv, n_split): one program takes ALL query rows that share one kv head
   (G = H/Hkv heads × Sq positions, padded to ≥ 16 rows for the tensor cores) and one chunk of the cache.
   Each KV head's codes are read once per split, never once per query head (GQA for free). Per tile of
   BLOCK_N tokens:

       s   = (q·sm_scale·log2e)_fp16 · k_codesᵀ  ·  k_scale[token]      (fp32 accumulation)
       m   = max(m, rowmax(s));  p = 2^(s − m);  l = l·α + Σp
       acc = acc·α + (p · v_scale[token])_fp16 · v_codes

   int8 codes are exact in fp16, so the only roundings beyond the cache's own are q and p·v_scale in fp16
   (2^-11 relative; SDPA in bf16 rounds at 2^-8). Writes (m, l, acc) per row and split in fp32.
2. ``_decode_combine_kernel``, grid (B·Hkv,): merges the splits (log-sum-exp rescaling), divides by l,
   writes the output in q's dtype and layout.

Host side: one Python function, two FastLauncher launches, two workspace allocations; no host sync, so the
call can be captured in a CUDA graph (the split count and the cache length are baked into a capture).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import triton
import triton.language as tl

from ..triton_utils import FastLauncher, mma
from .quant_kernel import INTERPRET, LOG2E, _finite_or_zero, cdiv, launch_with

if TYPE_CHECKING:  # annotations only: kv_cache imports this module to append with the kernel
    from .kv_cache import QuantizedKV


@triton.jit
def _decode_split_kernel(Q, K, Ks, V, Vs, Part, ML,
                         s_qb, s_qh, s_qs, s_qd, c_b, c_h, c_s, cs_b, cs_h,
                         H_KV, Sq, L, chunk, n_split, qk_scale,
                         G: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr):
    pid_bh, pid_s = tl.program_id(0), tl.program_id(1)
    b, hkv = pid_bh // H_KV, pid_bh % H_KV
    rows = tl.arange(0, ROWS)
    g, i = rows // Sq, rows % Sq  # row → (query head within the group, query position)
    row_ok = rows < G * Sq
    d = tl.arange(0, HEAD_DIM)
    q_ptr = Q + b.to(tl.int64) * s_qb + (hkv * G + g)[:, None] * s_qh + i[:, None] * s_qs + d[None, :] * s_qd
    q = tl.load(q_ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)
    # NaN in -> NaN out (the rule of reference.nonfinite_rows): a row whose query holds NaN/inf, or that sees
    # a token the cache marks non-finite (NaN scale, see kv_cache.quantize_per_token), is NaN; everything
    # else is computed with those values as zeros, so the other rows are unaffected
    row_bad = tl.max(tl.where(tl.abs(q) < float("inf"), 0, 1), axis=1)
    q = (_finite_or_zero(q) * qk_scale).to(tl.float16)
    last_key = L - Sq + i  # causal: query i sees keys ≤ L − Sq + i
    k_base = K + b.to(tl.int64) * c_b + hkv * c_h
    v_base = V + b.to(tl.int64) * c_b + hkv * c_h
    ks_base = Ks + b.to(tl.int64) * cs_b + hkv * cs_h
    vs_base = Vs + b.to(tl.int64) * cs_b + hkv * cs_h
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, L)
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        col_ok = cols < hi
        k = tl.load(k_base + cols[None, :].to(tl.int64) * c_s + d[:, None], mask=col_ok[None, :], other=0)
        ks = tl.load(ks_base + cols, mask=col_ok, other=0.0)
        vs = tl.load(vs_base + cols, mask=col_ok, other=0.0)
        col_finite = (tl.abs(ks) < float("inf")) & (tl.abs(vs) < float("inf"))
        ks, vs = _finite_or_zero(ks), _finite_or_zero(vs)
        s = mma(q, k.to(tl.float16), tl.zeros((ROWS, BLOCK_N), tl.float32)) * ks[None, :]
        keep = col_ok[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= last_key[:, None])
        sees_bad = tl.where(keep & ~col_finite[None, :], 1, 0) + tl.zeros((ROWS, BLOCK_N), tl.int32)  # full shape
        row_bad = tl.maximum(row_bad, tl.max(sees_bad, axis=1))
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: keep p = 0, no nan
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + cols[:, None].to(tl.int64) * c_s + d[None, :], mask=col_ok[:, None], other=0)
        acc = mma((p * vs[None, :]).to(tl.float16), v.to(tl.float16), acc * alpha[:, None])
        m_i = m_new
    acc = tl.where(row_bad[:, None] > 0, float("nan"), acc)  # NaN survives the combine's rescaling and l
    part = Part + ((pid_bh * n_split + pid_s) * ROWS + rows[:, None]).to(tl.int64) * HEAD_DIM + d[None, :]
    tl.store(part, acc)
    ml = ML + (pid_bh * n_split + pid_s) * ROWS + rows
    tl.store(ml, m_i)
    tl.store(ml + tl.num_programs(0) * n_split * ROWS, l_i)


@triton.jit
def _decode_combine_kernel(Part, ML, Out, s_ob, s_oh, s_os, s_od, H_KV, Sq, n_split,
                           G: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    pid_bh = tl.program_id(0)
    b, hkv = pid_bh // H_KV, pid_bh % H_KV
    rows = tl.arange(0, ROWS)
    d = tl.arange(0, HEAD_DIM)
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    plane = tl.num_programs(0) * n_split * ROWS
    for s in range(0, n_split):
        ml = ML + (pid_bh * n_split + s) * ROWS + rows
        m_s = tl.load(ml)
        l_s = tl.load(ml + plane)
        o_s = tl.load(Part + ((pid_bh * n_split + s) * ROWS + rows[:, None]).to(tl.int64) * HEAD_DIM + d[None, :])
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a, c = tl.math.exp2(m - m_safe), tl.math.exp2(m_s - m_safe)
        l = l * a + l_s * c
        acc = acc * a[:, None] + o_s * c[:, None]
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # rows that see no key output zeros
    g, i = rows // Sq, rows % Sq
    o_ptr = Out + b.to(tl.int64) * s_ob + (hkv * G + g)[:, None] * s_oh + i[:, None] * s_os + d[None, :] * s_od
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=(rows < G * Sq)[:, None])


_SPLIT_LAUNCH = FastLauncher(_decode_split_kernel)
_COMBINE_LAUNCH = FastLauncher(_decode_combine_kernel)

# Launch shape. GPU values are a design choice (not swept: no GPU this session): BLOCK_N tokens per step
# (64 KB of int8 K+V at D=128 per 4 warps in flight with 3 stages), and enough splits that about
# TARGET_PROGRAMS programs stream the cache (2 per SM on an H100 keep its HBM busy).
DECODE_CONFIG = dict(block_n=64, num_warps=4, num_stages=3, target_programs=264, min_chunk=256)
_INTERPRET_CONFIG = dict(block_n=16, num_warps=4, num_stages=1, target_programs=4, min_chunk=16)


def decode_config() -> dict:
    return _INTERPRET_CONFIG if INTERPRET else DECODE_CONFIG


def split_plan(length: int, programs_per_split: int, cfg: dict) -> tuple[int, int]:
    """(chunk, n_split): cache tokens per program (a multiple of BLOCK_N, ≥ min_chunk) and the number of
    chunks, so that programs_per_split · n_split ≈ target_programs."""
    block_n = cfg["block_n"]
    want = max(1, cfg["target_programs"] // max(programs_per_split, 1))
    chunk = cdiv(cdiv(length, want), block_n) * block_n
    chunk = max(chunk, cfg["min_chunk"])
    return chunk, cdiv(length, chunk)


def decode_forward_triton(q: torch.Tensor, cache: QuantizedKV, *, causal: bool, sm_scale: float) -> torch.Tensor:
    """The two launches on validated inputs: q ``(B, H, Sq, D)`` (any strides), Sq ≤ 16."""
    B, H, Sq, D = q.shape
    H_kv, L = cache.k.shape[1], cache.length
    G = H // H_kv
    rows = max(16, 1 << (G * Sq - 1).bit_length())  # a power of two ≥ 16: the dot's M
    cfg = decode_config()
    chunk, n_split = split_plan(L, B * H_kv, cfg)
    part = torch.empty(B * H_kv, n_split, rows, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(2, B * H_kv, n_split, rows, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    spec = FastLauncher._spec
    sig = (q.shape, q.stride(), q.dtype, q.data_ptr() % 16, cache.k.shape, cache.k.stride(), cache.k_scale.stride(),
           causal, spec(L), spec(chunk), spec(n_split), spec(Sq), cfg["block_n"])  # see sage_forward_triton
    launch_with(_SPLIT_LAUNCH, sig, (B * H_kv, n_split),
        q, cache.k, cache.k_scale, cache.v, cache.v_scale, part, ml,
        *q.stride(), *cache.k.stride()[:3], *cache.k_scale.stride()[:2],
        H_kv, Sq, L, chunk, n_split, sm_scale * LOG2E,
        G=G, ROWS=rows, HEAD_DIM=D, BLOCK_N=cfg["block_n"], CAUSAL=causal,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    launch_with(_COMBINE_LAUNCH, sig, (B * H_kv,),
        part, ml, out, *out.stride(), H_kv, Sq, n_split,
        G=G, ROWS=rows, HEAD_DIM=D, num_warps=4, num_stages=1)
    return out




@triton.jit
def _append_kernel(X, Codes, Scale, s_xb, s_xh, s_xs, s_xd, c_b, c_h, c_s, cs_b, cs_h, H_KV, start,
                   QMAX: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (b·Hkv + h, i): token i of the new ones → int8 codes and its scale at slot start + i."""
    pid_bh, i = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H_KV, pid_bh % H_KV
    d = tl.arange(0, HEAD_DIM)
    x = tl.load(X + b.to(tl.int64) * s_xb + h * s_xh + i * s_xs + d * s_xd).to(tl.float32)
    bad = tl.max(tl.where(tl.abs(x) < float("inf"), 0, 1), axis=0)
    x = _finite_or_zero(x)  # as quantize_per_token: codes of the finite values, a NaN scale marks the token
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / QMAX, 1e-12)
    y = x / scale
    codes = tl.where(y >= 0, y + 0.5, y - 0.5).to(tl.int8)  # round half away from zero, as the reference
    scale = tl.where(bad > 0, float("nan"), scale)
    slot = start + i
    tl.store(Codes + b.to(tl.int64) * c_b + h * c_h + slot.to(tl.int64) * c_s + d, codes)
    tl.store(Scale + b.to(tl.int64) * cs_b + h * cs_h + slot, scale)


_APPEND_LAUNCH = FastLauncher(_append_kernel)


def append_triton(cache: QuantizedKV, k: torch.Tensor, v: torch.Tensor) -> None:
    """Quantizes ``(B, Hkv, n, D)`` K and V into slots ``[length, length + n)`` of ``cache`` (room made by
    the caller): one launch each, instead of ~6 torch ops per tensor."""
    B, H, n, D = k.shape
    qmax = float((1 << (cache.bits - 1)) - 1)
    spec = FastLauncher._spec
    for x, codes, scale in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        sig = (x.shape, x.stride(), x.dtype, x.data_ptr() % 16, codes.shape, spec(cache.length))
        launch_with(_APPEND_LAUNCH, sig, (B * H, n), x, codes, scale, *x.stride(), *codes.stride()[:3], *scale.stride()[:2], H,
                       cache.length, QMAX=qmax, HEAD_DIM=D, num_warps=1, num_stages=1)


__all__ = ["decode_forward_triton", "append_triton", "split_plan", "DECODE_CONFIG"]
