"""The family's split-K decode attention, for queries of 1–16 rows (where the prefill kernel, 64-row tiles and a
K/V pre-pass every call, is the wrong tool), over either cache the family holds:

* a :class:`~thrifty.kv.QuantizedKV` (packed unsigned 8/4/3-bit codes, per-token scales): ``BITS`` 8/4/3,
  :func:`decode_forward_triton`;
* a static buffer of float K/V rows with a validity byte per row (ShadowKV's: outliers + local window, selected
  chunks, generated tokens): ``BITS`` 0, :func:`masked_decode_attention`.

Decode is a memory-bound pass over the cache: the kernel's job is to read every cache byte once, at full
bandwidth, with enough programs in flight. Two launches:

1. ``_decode_split_kernel``, grid (B·Hkv, n_split): one program takes ALL query rows that share one kv head
   (G = H/Hkv heads × Sq positions, padded to ≥ 16 rows for the tensor cores) and one chunk of the cache.
   Each KV head's rows are read once per split, never once per query head (GQA for free). Online softmax in
   base 2 (qk_scale = sm_scale·log2e) with fp32 (m, l, acc) per row, written per split for the live rows.
   Packed codes are unpacked in registers (``_load_codes``: a shift and a mask per bit field) and centred on
   the token's zero point z (top/2; 7.5 for the 3-bit mode's 4-bit first token):

       s   = (q·qk_scale)_fp16 · (k_codes − z)ᵀ  ·  k_scale[token]      (fp32 accumulation)
       m   = max(m, rowmax(s));  p = 2^(s − m);  l = l·α + Σp
       acc = acc·α + (p · v_scale[token])_fp16 · (v_codes − z)

   code − z is a half-integer ≤ 127.5, exact in fp16, so the only roundings beyond the cache's own are q and
   p·v_scale in fp16 (2^-11 relative; SDPA in bf16 rounds at 2^-8). Float rows: s = (q in the rows' dtype ·
   Kᵀ)·qk_scale, acc += p (in the rows' dtype) · V; an invalid row scores −inf and its value is never loaded.
2. ``_decode_merge_kernel``, grid (B·Hkv, G·Sq): one program per query row merges the splits (log-sum-exp
   rescaling; S_BLOCK splits per load), divides by l, writes the output in q's dtype and layout.

Host side: one Python function per cache kind, two FastLauncher launches, two workspace allocations; no host
sync, so the call can be captured in a CUDA graph (the split count and the cache length are baked into a
capture). The append kernel (``_append_kernel``) quantizes new tokens into a QuantizedKV.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import triton
import triton.language as tl

from ..triton_utils import LOG2E, FastLauncher, cdiv, finite_or_zero, interpreting, launch_with, mma, sm_count

if TYPE_CHECKING:  # annotations only: quantized imports this module to append with the kernel
    from .quantized import QuantizedKV

INTERPRET = interpreting()  # fixed at import, like the kernels' jitting


@triton.jit
def _field(rows, d, mask, OFFSET: tl.constexpr, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One bit field of packed rows (quantized.py layout): channel d sits in byte OFFSET + d % n of its row
    (n = HEAD_DIM·WIDTH/8 bytes per field) at bit shift WIDTH·(d // n). ``rows``: pointers to the rows,
    broadcast against the channel indices ``d``."""
    n = HEAD_DIM * WIDTH // 8
    byte = tl.load(rows + OFFSET + d % n, mask=mask, other=0).to(tl.int32)
    return (byte >> (WIDTH * (d // n))) & ((1 << WIDTH) - 1)


@triton.jit
def _load_codes(rows, d, mask, BITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """int32 codes of channels d from packed rows: the fields of quantized.FIELDS (8: one; 4: one; 3: 2 + 1)."""
    if BITS == 3:
        codes = _field(rows, d, mask, 0, 2, HEAD_DIM) | (_field(rows, d, mask, HEAD_DIM // 4, 1, HEAD_DIM) << 2)
    else:
        codes = _field(rows, d, mask, 0, BITS, HEAD_DIM)
    return codes


@triton.jit
def _centred(codes, cols, sink_row, d, start, AXIS: tl.constexpr, BITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """fp16 (code − zero point) of a tile of codes whose tokens ``cols`` run along AXIS. In the 3-bit mode the
    first token's 4th bit comes from its plane ``sink_row`` and its zero point is 7.5 (quantized.py: first token at
    4 bits); only the tile starting at token 0 loads it."""
    half = ((1 << BITS) - 1) * 0.5
    zero = tl.full(cols.shape, half, tl.float32)
    if BITS == 3:
        zero = tl.where(cols == 0, 7.5, zero)
        if start == 0:
            top_bit = _field(sink_row, d, d < HEAD_DIM, 0, 1, HEAD_DIM) << 3
            if AXIS == 1:  # codes (D, BLOCK_N)
                codes = codes | tl.where(cols[None, :] == 0, top_bit[:, None], 0)
            else:  # codes (BLOCK_N, D)
                codes = codes | tl.where(cols[:, None] == 0, top_bit[None, :], 0)
    zero = zero[None, :] if AXIS == 1 else zero[:, None]
    return (codes.to(tl.float32) - zero).to(tl.float16)


@triton.jit
def _decode_split_kernel(Q, K, V, Ks, Vs, Ksink, Vsink, Valid, Part, ML,
                         s_qb, s_qh, s_qs, s_qd, c_b, c_h, c_s, r_b, r_h, sk_b, sk_h,
                         H_KV, Sq, L, chunk, n_split, qk_scale,
                         G: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr, BITS: tl.constexpr):
    """Program (b·Hkv + hkv, split): the G·Sq query rows of kv head hkv over cache rows [split·chunk, +chunk).
    BITS 8/4/3: packed codes with scales Ks/Vs (and the 3-bit mode's first-token planes Ksink/Vsink);
    BITS 0: float K/V rows and a validity byte per row (Valid). ``r_b``, ``r_h``: strides of the per-row
    arrays (scales or validity), whose rows are contiguous."""
    pid_bh, pid_s = tl.program_id(0), tl.program_id(1)
    b, hkv = pid_bh // H_KV, pid_bh % H_KV
    rows = tl.arange(0, ROWS)
    g, i = rows // Sq, rows % Sq  # row → (query head within the group, query position)
    row_live = rows < G * Sq
    d = tl.arange(0, HEAD_DIM)
    q_ptr = Q + b.to(tl.int64) * s_qb + (hkv * G + g)[:, None] * s_qh + i[:, None] * s_qs + d[None, :] * s_qd
    q = tl.load(q_ptr, mask=row_live[:, None], other=0.0)
    if BITS == 0:
        q = q.to(K.dtype.element_ty)  # the dot in the rows' own dtype; scaled after it, in fp32
    else:
        # NaN in -> NaN out (the rule of reference.nonfinite_rows): a row whose query holds NaN/inf, or that
        # sees a token the cache marks non-finite (NaN scale, see quantized.quantize_per_token), is NaN;
        # everything else is computed with those values as zeros, so the other rows are unaffected
        q = q.to(tl.float32)
        row_bad = tl.max(tl.where(tl.abs(q) < float("inf"), 0, 1), axis=1)
        q = (finite_or_zero(q) * qk_scale).to(tl.float16)
    last_key = L - Sq + i  # causal: query i sees keys ≤ L − Sq + i
    k_base = K + b.to(tl.int64) * c_b + hkv * c_h
    v_base = V + b.to(tl.int64) * c_b + hkv * c_h
    ks_base = Ks + b.to(tl.int64) * r_b + hkv * r_h
    vs_base = Vs + b.to(tl.int64) * r_b + hkv * r_h
    valid_base = Valid + b.to(tl.int64) * r_b + hkv * r_h
    ksink = Ksink + b.to(tl.int64) * sk_b + hkv * sk_h  # 3-bit mode only (else a placeholder, never read)
    vsink = Vsink + b.to(tl.int64) * sk_b + hkv * sk_h
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, L)
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        col_ok = cols < hi
        if BITS == 0:
            # a row the cache marks invalid (padding, an unused slot) gets weight 0 and its value is never
            # loaded: whatever it holds, NaN included, cannot leak
            ok = (tl.load(valid_base + cols, mask=col_ok, other=0) != 0) & col_ok
            keep = ok[None, :]
            k = tl.load(k_base + cols[:, None].to(tl.int64) * c_s + d[None, :], mask=col_ok[:, None], other=0.0)
            s = mma(q, tl.trans(k), tl.zeros((ROWS, BLOCK_N), tl.float32)) * qk_scale
        else:
            k = _load_codes(k_base + cols[None, :].to(tl.int64) * c_s, d[:, None], col_ok[None, :], BITS, HEAD_DIM)
            k = _centred(k, cols, ksink, d, start, 1, BITS, HEAD_DIM)
            ks = tl.load(ks_base + cols, mask=col_ok, other=0.0)
            vs = tl.load(vs_base + cols, mask=col_ok, other=0.0)
            col_finite = (tl.abs(ks) < float("inf")) & (tl.abs(vs) < float("inf"))
            ks, vs = finite_or_zero(ks), finite_or_zero(vs)
            s = mma(q, k, tl.zeros((ROWS, BLOCK_N), tl.float32)) * ks[None, :]
            keep = col_ok[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= last_key[:, None])
        if BITS != 0:
            sees_bad = tl.where(keep & ~col_finite[None, :], 1, 0) + tl.zeros((ROWS, BLOCK_N), tl.int32)
            row_bad = tl.maximum(row_bad, tl.max(sees_bad, axis=1))
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: keep p = 0, no nan
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if BITS == 0:
            v = tl.load(v_base + cols[:, None].to(tl.int64) * c_s + d[None, :], mask=ok[:, None], other=0.0)
            acc = mma(p.to(v.dtype), v, acc * alpha[:, None])
        else:
            v = _load_codes(v_base + cols[:, None].to(tl.int64) * c_s, d[None, :], col_ok[:, None], BITS, HEAD_DIM)
            v = _centred(v, cols, vsink, d, start, 0, BITS, HEAD_DIM)
            acc = mma((p * vs[None, :]).to(tl.float16), v, acc * alpha[:, None])
        m_i = m_new
    if BITS != 0:
        acc = tl.where(row_bad[:, None] > 0, float("nan"), acc)  # NaN survives the merge's rescaling and l
    # only the live rows are stored: the merge reads G·Sq rows per split, never the dot's padding
    part = Part + ((pid_bh * n_split + pid_s) * ROWS + rows[:, None]).to(tl.int64) * HEAD_DIM + d[None, :]
    tl.store(part, acc, mask=row_live[:, None])
    ml = ML + (pid_bh * n_split + pid_s) * ROWS + rows
    tl.store(ml, m_i, mask=row_live)
    tl.store(ml + tl.num_programs(0) * n_split * ROWS, l_i, mask=row_live)


@triton.jit
def _decode_merge_kernel(Part, ML, Out, s_ob, s_oh, s_os, s_od, H_KV, Sq, n_split,
                         G: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, S_BLOCK: tl.constexpr):
    """Program (b·Hkv + hkv, row): one query row's splits merged (log-sum-exp rescaling), S_BLOCK splits per
    load; divides by l and writes the row in q's dtype and layout. S_BLOCK = 1 merges split by split (the
    quantized path: its results do not depend on the block); many splits want a block (a chain of dependent
    loads costs ~0.5 µs per split)."""
    pid_bh, row = tl.program_id(0), tl.program_id(1)
    b, hkv = pid_bh // H_KV, pid_bh % H_KV
    s = tl.arange(0, S_BLOCK)
    d = tl.arange(0, HEAD_DIM)
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.zeros((), tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    plane = tl.num_programs(0) * n_split * ROWS
    for s0 in range(0, n_split, S_BLOCK):
        live = s0 + s < n_split
        part = (pid_bh * n_split + s0 + s) * ROWS + row
        m_s = tl.load(ML + part, mask=live, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(m_s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split has seen a key yet
        a, w = tl.math.exp2(m - m_safe), tl.math.exp2(m_s - m_safe)  # a split without a key has l = acc = 0
        l = l * a + tl.sum(tl.load(ML + plane + part, mask=live, other=0.0) * w, axis=0)
        o_s = tl.load(Part + part[:, None].to(tl.int64) * HEAD_DIM + d[None, :], mask=live[:, None], other=0.0)
        acc = acc * a + tl.sum(o_s * w[:, None], axis=0)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)  # a row that sees no key outputs zeros
    g, i = row // Sq, row % Sq
    o_ptr = Out + b.to(tl.int64) * s_ob + (hkv * G + g) * s_oh + i * s_os + d * s_od
    tl.store(o_ptr, out.to(Out.dtype.element_ty))


_SPLIT_LAUNCH = FastLauncher(_decode_split_kernel)
_MERGE_LAUNCH = FastLauncher(_decode_merge_kernel)

# Launch shape. GPU values are a design choice (not swept: no GPU this session): BLOCK_N tokens per step
# (64 KB of 8-bit K+V at D=128 per 4 warps in flight with 3 stages), and enough splits that about
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


def dot_rows(G: int, Sq: int) -> int:
    """Rows of a program's dot: its G·Sq query rows padded to a power of two ≥ 16 (the tensor cores' M)."""
    return max(16, 1 << (G * Sq - 1).bit_length())


def decode_forward_triton(q: torch.Tensor, cache: QuantizedKV, *, causal: bool, sm_scale: float) -> torch.Tensor:
    """The two launches on validated inputs: q ``(B, H, Sq, D)`` (any strides), Sq ≤ 16."""
    B, H, Sq, D = q.shape
    H_kv, L = cache.k.shape[1], cache.length
    k_sink = cache.k if cache.k_sink is None else cache.k_sink  # a placeholder pointer when there is no plane
    v_sink = cache.v if cache.v_sink is None else cache.v_sink
    G = H // H_kv
    rows = dot_rows(G, Sq)
    cfg = decode_config()
    chunk, n_split = split_plan(L, B * H_kv, cfg)
    part = torch.empty(B * H_kv, n_split, rows, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(2, B * H_kv, n_split, rows, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    spec = FastLauncher._spec
    sig = (q.shape, q.stride(), q.dtype, q.data_ptr() % 16, cache.k.shape, cache.k.stride(), cache.k_scale.stride(),
           causal, spec(L), spec(chunk), spec(n_split), spec(Sq), cfg["block_n"], cache.bits)  # see FastLauncher.keyed
    launch_with(_SPLIT_LAUNCH, sig, (B * H_kv, n_split),
        q, cache.k, cache.v, cache.k_scale, cache.v_scale, k_sink, v_sink, cache.k_scale, part, ml,
        *q.stride(), *cache.k.stride()[:3], *cache.k_scale.stride()[:2], *k_sink.stride()[:2],
        H_kv, Sq, L, chunk, n_split, sm_scale * LOG2E,
        G=G, ROWS=rows, HEAD_DIM=D, BLOCK_N=cfg["block_n"], CAUSAL=causal, BITS=cache.bits,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    # S_BLOCK 1: split by split, in order (a block would regroup the sums: the last bits of the output would move)
    launch_with(_MERGE_LAUNCH, sig, (B * H_kv, G * Sq),
        part, ml, out, *out.stride(), H_kv, Sq, n_split,
        G=G, ROWS=rows, HEAD_DIM=D, S_BLOCK=1, num_warps=4, num_stages=1)
    return out


# ShadowKV's buffer (masked_decode_attention): about MASKED_PROGRAMS_PER_SM programs per SM over the (sequence,
# KV head) rows, whole BLOCK_N blocks per split (batch 1 at 122K: 8 heads x ~2.5K rows -> 8 x 40 splits of 64
# rows), so a few thousand rows cost what dense attention over as many rows costs; the merge reads up to
# MERGE_BLOCK splits per load (64 x D fp32: 32 KB at D = 128)
MASKED_PROGRAMS_PER_SM = 4
MERGE_BLOCK = 64


def masked_split_plan(rows: int, N: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """(splits, rows per split) of :func:`masked_decode_attention` over ``rows`` (sequence, KV head) pairs of N
    cache rows each: ~4 programs per SM, whole blocks per split."""
    blocks = cdiv(N, block_n)
    programs = MASKED_PROGRAMS_PER_SM * sm_count(device)
    splits = max(1, min(blocks, cdiv(programs, rows)))
    split_len = cdiv(blocks, splits) * block_n
    return cdiv(N, split_len), split_len


def masked_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float,
                            splits: Optional[int] = None, block_n: int = 64,
                            merge_block: int = MERGE_BLOCK) -> torch.Tensor:
    """softmax(q·Kᵀ·scale)·V over the valid rows of a static buffer (ShadowKV's: outliers + local window,
    selected chunks, generated tokens). q ``(B, Hq, 1, D)``; k, v ``(B, H, N, D)`` of one dtype, one layout and
    contiguous rows; valid ``(B, H, N)`` bool -> ``(B, Hq, 1, D)`` in q's dtype. A row marked invalid never
    counts, whatever it holds (NaN included). ``splits``: of the row axis (default: ~4 programs per SM);
    ``merge_block``: splits the merge loads at once. Every shape is static and nothing syncs with the host, so a
    step can be captured in a CUDA graph."""
    B, Hq, Sq, D = q.shape
    H, N = k.shape[1], k.shape[2]
    if v.shape != k.shape or v.stride() != k.stride() or k.stride(-1) != 1 or valid.stride(-1) != 1:
        raise ValueError(f"k, v, valid: expected k and v of one shape and layout with contiguous rows, and "
                         f"contiguous valid rows, got strides {k.stride()}, {v.stride()}, {valid.stride()}")
    G = Hq // H
    rows = dot_rows(G, Sq)
    if splits is None:
        splits, split_len = masked_split_plan(B * H, N, block_n, q.device)
    else:
        split_len = cdiv(cdiv(N, splits), block_n) * block_n
        splits = cdiv(N, split_len)
    part = torch.empty(B * H, splits, rows, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(2, B * H, splits, rows, dtype=torch.float32, device=q.device)
    out = torch.empty(B, Hq, Sq, D, dtype=q.dtype, device=q.device)
    flags = valid.view(torch.int8)  # also the placeholder of the pointers only the quantized mode reads
    _SPLIT_LAUNCH((B * H, splits),
        q, k, v, flags, flags, flags, flags, flags, part, ml,
        *q.stride(), *k.stride()[:3], *valid.stride()[:2], 0, 0,
        H, Sq, N, split_len, splits, scale * LOG2E,
        G=G, ROWS=rows, HEAD_DIM=D, BLOCK_N=block_n, CAUSAL=False, BITS=0, num_warps=4, num_stages=3)
    _MERGE_LAUNCH((B * H, G * Sq),
        part, ml, out, *out.stride(), H, Sq, splits,
        G=G, ROWS=rows, HEAD_DIM=D, S_BLOCK=min(merge_block, 1 << (splits - 1).bit_length()),
        num_warps=4, num_stages=3)
    return out


@triton.jit
def _store_field(row, codes, OFFSET: tl.constexpr, WIDTH: tl.constexpr, SHIFT: tl.constexpr,
                 HEAD_DIM: tl.constexpr, mask):
    """Bits [SHIFT, SHIFT + WIDTH) of one token's HEAD_DIM codes packed into the field at byte OFFSET of its
    row (the layout ``_field`` reads): byte j gets channels j, j + n, ... at shifts 0, WIDTH, ..."""
    n: tl.constexpr = HEAD_DIM * WIDTH // 8
    per_byte: tl.constexpr = 8 // WIDTH
    parts = (tl.reshape(codes, (per_byte, n)) >> SHIFT) & ((1 << WIDTH) - 1)  # [r, j] = channel r·n + j
    byte = tl.sum(parts << (WIDTH * tl.arange(0, per_byte))[:, None], axis=0)
    tl.store(row + OFFSET + tl.arange(0, n), byte.to(tl.uint8), mask=mask)


@triton.jit
def _append_kernel(X, Codes, Scale, Sink, s_xb, s_xh, s_xs, s_xd, c_b, c_h, c_s, cs_b, cs_h, sk_b, sk_h, H_KV,
                   start, BITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (b·Hkv + h, i): token i of the new ones → packed codes and its scale at slot start + i, on the
    unsigned absmax grid of quantized.quantize_per_token (same operations, same bits)."""
    pid_bh, i = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H_KV, pid_bh % H_KV
    d = tl.arange(0, HEAD_DIM)
    x = tl.load(X + b.to(tl.int64) * s_xb + h * s_xh + i * s_xs + d * s_xd).to(tl.float32)
    bad = tl.max(tl.where(tl.abs(x) < float("inf"), 0, 1), axis=0)
    x = finite_or_zero(x)  # as quantize_per_token: codes of the finite values, a NaN scale marks the token
    slot = start + i
    top = (1 << BITS) - 1
    if BITS == 3:
        top = tl.where(slot == 0, 15, top)  # the first token at 4 bits (quantized.SINK_BITS)
    half = top * 0.5
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / half, 1e-12)
    y = x / scale + (half + 0.5)  # ≥ 0 up to rounding: truncation is floor once clamped at 0
    codes = tl.minimum(tl.maximum(y, 0.0), top).to(tl.int32)
    scale = tl.where(bad > 0, float("nan"), scale)
    row = Codes + b.to(tl.int64) * c_b + h * c_h + slot.to(tl.int64) * c_s
    if BITS == 3:
        _store_field(row, codes, 0, 2, 0, HEAD_DIM, None)
        _store_field(row, codes, HEAD_DIM // 4, 1, 2, HEAD_DIM, None)
        _store_field(Sink + b.to(tl.int64) * sk_b + h * sk_h, codes, 0, 1, 3, HEAD_DIM, slot == 0)
    else:
        _store_field(row, codes, 0, BITS, 0, HEAD_DIM, None)
    tl.store(Scale + b.to(tl.int64) * cs_b + h * cs_h + slot, scale)


_APPEND_LAUNCH = FastLauncher(_append_kernel)


def append_triton(cache: QuantizedKV, k: torch.Tensor, v: torch.Tensor) -> None:
    """Quantizes ``(B, Hkv, n, D)`` K and V into slots ``[length, length + n)`` of ``cache`` (room made by
    the caller): one launch each, instead of ~6 torch ops per tensor."""
    B, H, n, D = k.shape
    spec = FastLauncher._spec
    for x, codes, scale, sink in ((k, cache.k, cache.k_scale, cache.k_sink), (v, cache.v, cache.v_scale, cache.v_sink)):
        sink = codes if sink is None else sink  # a placeholder pointer when there is no plane
        sig = (x.shape, x.stride(), x.dtype, x.data_ptr() % 16, codes.shape, spec(cache.length), cache.bits)
        launch_with(_APPEND_LAUNCH, sig, (B * H, n), x, codes, scale, sink, *x.stride(), *codes.stride()[:3],
                    *scale.stride()[:2], *sink.stride()[:2], H, cache.length, BITS=cache.bits, HEAD_DIM=D,
                    num_warps=1, num_stages=1)


__all__ = ["decode_forward_triton", "masked_decode_attention", "append_triton", "split_plan", "masked_split_plan",
           "DECODE_CONFIG"]
