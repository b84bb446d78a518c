"""Triton kernels of :class:`~thrifty.bitnet.packed.PackedBitLinear` (sm_90 target; the CPU interpreter in tests).

Decode at 1 token is ``_decode_gemv_v3_kernel`` on codes made once per input (NOTES.md "Decode GEMV v3": the
codes kernel below, shared by sibling projections): programs of 8 whole output rows, 16-byte weight loads all in
flight (cp.async pipelined when a row is longer than one 1 KB chunk), the dp4a on masked fields, no layout change
before the final reduction; 2 tokens of a layer of ≤ 4096 rows run it too, one grid row per token. A forward is
two launches (one more when K is split):

1. ``_act_codes_kernel``, one program per token: the optional sub-norm and the recipe's quantizer (INT8 absmax,
   INT4-range absmean, TopK+INT8) with the arithmetic of ``quant_kernel._quantize_rows_kernel`` (its helpers),
   writing int8 codes (zero-padded to whole 256-weight groups), the fp32 scale and Σ codes of the token. At
   prefill on long rows (``codes_kernel``: INT8 / INT4 from 512 tokens where the row's block would be large)
   ``_act_codes_stream_kernel`` instead: the row walked in 1024-column chunks in up to three passes, 4 warps.
2. the matmul, weights unpacked in registers, ``acc = Σ c·x`` with the *codes* ``c = w + 1`` (the −1 is the
   per-token ``Σ x`` subtracted once in the epilogue), then ``((acc − Σx)·s_x)·α (+ b)`` in fp32:

   * ``_gemv_kernel`` (1–4 tokens, by config: the CUDA-core split-K GEMV v3 replaced, kept as the tests'
     cross-check): CUDA cores. The packed row is read as int32 words; ``(word >> 2i) &
     0x03030303`` is 4 consecutive codes as bytes, multiplied with 4 int8 activations by one ``dp4a``: 3
     instructions per 4 weights and token, per-lane accumulators reduced once at the end.
   * ``_gemm_kernel`` (3+ tokens, and 2 of wider layers; decode and prefill): int8 tensor cores, ``tl.dot(int8, int8) → int32``
     with the weights on the MMA's large side (swap-AB: ``acc[n, m]``) so 16 tokens fill the small side. A
     64-byte packed tile decodes into four (BLOCK_N, 64) int8 operands, 2 instructions per 4 weights (``shr`` +
     ``and`` on 4 packed bytes via ``inline_asm_elementwise``, pack = 4).

   Shapes are free (no table): the launcher picks the tile and the K split from M, N, K and the SM count. With
   a split, the partial sums go to an int32 workspace by integer atomics (exact, so the result does not depend on
   the order) and ``_splitk_epilogue_kernel`` applies the scales and zeroes the workspace for the next call.

Under the interpreter the inline PTX is replaced by the same arithmetic in Triton ops (``USE_ASM`` False).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..fused_layers import _check_norm_weight, _check_residual, _glu_values, _norm_launch, _rows, _store_add
from ..fused_layers import _store_rms_norm, check_glu
from ..triton_utils import FastLauncher, capability, interpreting
from ..triton_utils import sm_count as _sm_count  # PK._sm_count: the benchmarks' name (older trees have it)
from .pack import GROUP, SLICE, padded_k
from .kernel_math import COMPILED as COMPILED_, mul_rn, quant_code, quant_round, quant_scales, subnorm
from .kernel_math import subnorm_rstd
from .quant_kernel import KEYS, MAX_ROW, _cast, _topk_keep
from .reference import EPS, topk_count

KINDS = {"int8": 0, "int4": 1, "topk_int8": 2}  # the codes of quant_kernel.KINDS
USE_ASM = not interpreting()  # inline PTX (dp4a, packed decode) on the GPU; plain Triton ops in the interpreter
# COMPILED_ (kernel_math.COMPILED): compiled, not interpreted, kernels spell products that an add follows mul.rn,
# which LLVM never contracts into an FMA (Triton's enable_fp_fusion does: one rounding where PyTorch rounds twice).
# Fixed at import, as the kernels are; a constexpr global (not an argument): USE_ASM stays free to toggle on the GPU
GEMV_MAX_TOKENS = 4  # decode_plan takes up to this many tokens (an explicit config); plan() sends it 1-2
# plan(): 2 tokens stay on the CUDA-core decode GEMV only up to this many output rows; wider layers and 3-4 tokens
# go to the tensor-core GEMM. H200, 24b5466 (probe in NOTES.md "Few tokens"), graph-replayed on cold weights: 2
# tokens v1 / GEMM 7.3 / 11.6 us at 4096x4096, 6.4 / 8.6 at 2560x2560, but 16.8 / 12.7 at 11008x4096 and 11.3 / 9.1
# at 6912x2560; 3-4 tokens the GEMM wins everywhere (12.5 / 11.6 at 4096x4096 up to 59.0 / 14.9 at 22016x4096).
# (v3 at 2 tokens, which replaced v1 there, also beats the early-launched GEMM at 11008x4096 and 12288x4096, 10.1 /
# 11.8 and 10.7 / 12.0, but not at 6912x2560 or 22016x4096; the row rule stays.)
TWO_TOKEN_GEMV_MAX_ROWS = 4096
# The tensor-core GEMM launches early (programmatic dependent launch, weights prefetched into L2 behind the codes
# kernel) up to this many tokens and programs per SM. H200, f265734 for every token count: the layer 2-14% faster at
# 16 tokens, 6-59% slower at 128-2048 tokens. 5c27846 + this rule, graph-replayed on cold weights, on vs off in one
# process (NOTES.md "Few tokens: the GEMM launched early"): 3-16 tokens 6-18% faster wherever the grid has at most
# 2 programs per SM (4096x4096 11.6 -> 9.3 us at 4 tokens), slower with more (22016x4096, 344 programs: 15.0 -> 16.5;
# 32 tokens of 11008x4096, 344: 13.8 -> 16.6). At 32 tokens it also lost on 4096x11008's 256 programs (19.3 -> 21.6):
# 16 tokens is where it stops.
GEMM_PDL_MAX_TOKENS = 16
# Prefill tiles (more than 32 tokens), all 4 warps: 128x128 from PREFILL_SQUARE_MIN_TOKENS tokens (the fewest
# measured) where the layer has at least PREFILL_SQUARE_MIN_ROWS rows and that grid fills PREFILL_SQUARE_MIN_WAVES
# waves of programs, else 64x64. H200, 512-2048 tokens, 48 configs per shape, every config bit-exact
# (bitnet_kernels_h200-gemm2048-onedot.json, bitnet_kernels_h200-prefill-tiles.json; NOTES.md "One wgmma wait per
# group, and the prefill tiles"): at 2048 tokens 128x128 is 10-21% faster than the 128x64 8-warp tile it replaces
# on every layer of >= 4096 rows (4096x4096 66.8 -> 55.4 us, 1240 TOP/s) and 5-6% slower on the 2B's 2560-row
# layers, where 64x64 is within 1.5-3% of it; at 512 tokens 64x64 wins where 128x128 gives < 1.5 waves (4096x4096:
# 128 programs, 24.2 us against 21.8; the old tile 23.2).
PREFILL_SQUARE_MIN_TOKENS = 512
PREFILL_SQUARE_MIN_ROWS = 4096
PREFILL_SQUARE_MIN_WAVES = 1.5
GEMM_PDL_MAX_PROGRAMS_PER_SM = 2
FUSED_KINDS = {"int8": 0, "int4": 1}  # quantized inside the decode GEMV; TopK (a 15–31-step search) launches apart
NAN_BITS = tl.constexpr(0x7F800000)  # |x| bit patterns at or above this are ±inf or NaN
GROUP_ = tl.constexpr(GROUP)  # weights per packed group (kernels read constexprs, never plain module globals)
SLICE_ = tl.constexpr(SLICE)  # weights per 2-bit field of a group = bytes per row and group
WORDS_ = tl.constexpr(SLICE // 4)  # int32 words per row and group
HIGH_FIELD = tl.constexpr(0xC0C0C0C0 - (1 << 32))  # bits 6-7 of every byte, as an int32 (Triton's literals are)


@triton.jit
def _act_codes_kernel(x_ptr, w_ptr, codes_ptr, scale_ptr, sum_ptr, D, KP, stride_x, stride_c, k_keep, beta_scale,
                      norm_eps, KIND: tl.constexpr, HAS_NORM: tl.constexpr, KEY_SHIFT: tl.constexpr,
                      KEY_BITS: tl.constexpr, BLOCK_D: tl.constexpr, EPS_: tl.constexpr, PDL: tl.constexpr):
    """Codes, scale and Σ codes of one token (the values of quant_kernel's input kernel, before the rescale).
    ``PDL``: lets a decode GEMV launched with programmatic dependent launch start now (it waits for these codes)."""
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    x_in = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    x = x_in.to(tl.float32)
    if HAS_NORM:  # BitLinear's sub-norm, as quant_kernel computes it (the same helpers)
        rstd = subnorm_rstd(tl.sum(x * x, axis=0), D, norm_eps)
        x = subnorm(x, x_in.dtype, rstd, tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32), COMPILED_)
    _store_codes(x, cols, inside, D, KP, codes_ptr + row * stride_c, scale_ptr + row, sum_ptr + row, k_keep,
                 beta_scale, KIND, KEY_SHIFT, KEY_BITS, EPS_)


@triton.jit
def _glu_codes_kernel(G, U, Y, w_ptr, codes_ptr, scale_ptr, sum_ptr, D, KP, stride_g, stride_u, stride_c, beta_scale,
                      norm_eps, RELU2: tl.constexpr, KIND: tl.constexpr, HAS_NORM: tl.constexpr,
                      BLOCK_D: tl.constexpr, EPS_: tl.constexpr, PDL: tl.constexpr):
    """One row of the GLU in front of a packed layer (``fused_layers._glu_values``: y stored, the plain GLU's bit
    for bit) and that layer's activation codes of y (its sub-norm, then ``_act_codes_kernel``'s quantizer on the
    same block and launch shape): one launch where the decode step ran two. ``PDL``: as in ``_act_codes_kernel``."""
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    y_in = _glu_values(G + row * stride_g, U + row * stride_u, cols, inside, RELU2)
    tl.store(Y + row * D + cols, y_in, mask=inside)
    x = y_in.to(tl.float32)
    if HAS_NORM:
        rstd = subnorm_rstd(tl.sum(x * x, axis=0), D, norm_eps)
        x = subnorm(x, y_in.dtype, rstd, tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32), COMPILED_)
    _store_codes(x, cols, inside, D, KP, codes_ptr + row * stride_c, scale_ptr + row, sum_ptr + row, 0, beta_scale,
                 KIND, 0, 1, EPS_)


@triton.jit
def _stream_chunk(x_row, w_ptr, cols, D, rstd, HAS_NORM: tl.constexpr):
    """Columns ``cols`` of one row as fp32 (0 past ``D``), after the sub-norm with ``rstd`` when ``HAS_NORM``:
    :func:`subnorm` on the values the whole-row kernel gives it, so each value is its value bit for bit."""
    inside = cols < D
    x_in = tl.load(x_row + cols, mask=inside, other=0.0)
    x = x_in.to(tl.float32)
    if HAS_NORM:
        x = subnorm(x, x_in.dtype, rstd, tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32), COMPILED_)
    return x


@triton.jit
def _act_codes_stream_kernel(x_ptr, w_ptr, codes_ptr, scale_ptr, sum_ptr, D, KP, stride_x, stride_c, beta_scale,
                             norm_eps, KIND: tl.constexpr, HAS_NORM: tl.constexpr, CHUNK: tl.constexpr,
                             EPS_: tl.constexpr):
    """``_act_codes_kernel``'s codes, scale and Σ codes of one token (INT8 absmax / INT4-range absmean), the row
    walked in ``CHUNK``-column chunks instead of held whole in registers: Σx² (sub-norm only), then max |x| (and
    Σ|x| for INT4) of the (normed) values, then the codes, stored with Σ codes accumulated, and the zero padding
    up to ``KP``. Per-lane accumulators, reduced once per pass; the second and third reads of a row come from
    L1/L2. 32–40 registers, so 16 rows per SM: faster than the whole-row kernel only where that one's block is
    large (``codes_kernel``; NOTES.md "The streaming codes kernel": a row's chunk loads are serial round trips).
    Max |x| and Σ codes do not depend on the order, so INT8 without the sub-norm is the whole-row kernel's bit for
    bit; Σx² and Σ|x| are summed in another order."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    cols = tl.arange(0, CHUNK)
    rstd = 0.0
    if HAS_NORM:
        sq = tl.zeros([CHUNK], dtype=tl.float32)
        for start in range(0, D, CHUNK):
            x = _stream_chunk(x_row, w_ptr, start + cols, D, 0.0, False)  # the raw values: Σx² is before the norm
            sq += x * x
        rstd = subnorm_rstd(tl.sum(sq, axis=0), D, norm_eps)
    top = tl.zeros([CHUNK], dtype=tl.int32)
    abs_sum = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, D, CHUNK):
        c = start + cols
        x = _stream_chunk(x_row, w_ptr, c, D, rstd, HAS_NORM)
        bits = tl.where(c < D, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
        top = tl.maximum(top, bits)
        if KIND == 1:
            abs_sum += bits.to(tl.float32, bitcast=True)
    top_all = tl.max(top, axis=0)
    if KIND == 1:  # INT4 range, absmean
        multiplier, scale = quant_scales(top_all, tl.sum(abs_sum, axis=0), D, beta_scale, KIND, EPS_, COMPILED_)
    else:
        multiplier, scale = quant_scales(top_all, 0.0, D, beta_scale, KIND, EPS_, COMPILED_)
    finite = top_all < NAN_BITS  # a row holding NaN or ±inf: NaN scale, zero codes (as _store_codes)
    codes_row = codes_ptr + row * stride_c
    total = tl.zeros([CHUNK], dtype=tl.int32)
    for start in range(0, KP, CHUNK):
        c = start + cols
        x = _stream_chunk(x_row, w_ptr, c, D, rstd, HAS_NORM)
        codes = tl.where((c < D) & finite, quant_code(x, multiplier, KIND, COMPILED_), 0)
        tl.store(codes_row + c, codes.to(tl.int8), mask=c < KP)
        total += codes
    tl.store(scale_ptr + row, tl.where(finite, scale, float("nan")))
    tl.store(sum_ptr + row, tl.sum(total, axis=0))


@triton.jit
def _store_codes(x, cols, inside, D, KP, codes_row, scale_at, sum_at, k_keep, beta_scale, KIND: tl.constexpr,
                 KEY_SHIFT: tl.constexpr, KEY_BITS: tl.constexpr, EPS_: tl.constexpr):
    """The quantizer ``KIND`` on one fp32 row ``x`` (zero where not ``inside``): int8 codes (zero up to ``KP``),
    the scale (NaN for a row holding NaN or ±inf, whose codes are zero) and Σ codes."""
    bits = tl.where(inside, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
    top = tl.max(bits, axis=0)
    if KIND == 1:  # INT4 range, absmean
        multiplier, scale = quant_scales(top, tl.sum(bits.to(tl.float32, bitcast=True), axis=0), D, beta_scale,
                                         KIND, EPS_, COMPILED_)
    else:
        if KIND == 2:
            x = tl.where(_topk_keep(bits >> KEY_SHIFT, inside, k_keep, D, KEY_BITS), x, 0.0)
        multiplier, scale = quant_scales(top, 0.0, D, beta_scale, KIND, EPS_, COMPILED_)
    q = quant_round(x, multiplier, KIND)
    bad = top >= NAN_BITS
    codes = tl.where(inside & (top < NAN_BITS), q, 0.0).to(tl.int32)
    tl.store(codes_row + cols, codes.to(tl.int8), mask=cols < KP)
    tl.store(scale_at, tl.where(bad, float("nan"), scale))
    tl.store(sum_at, tl.sum(codes, axis=0))


@triton.jit
def _norm_codes_kernel(X, R, W, S, Y, codes_ptr, scale_ptr, sum_ptr, D, KP, stride_x, stride_r, stride_s, stride_y,
                       stride_c, eps, beta_scale, ADD: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr,
                       TAIL: tl.constexpr, EPS_: tl.constexpr, PDL: tl.constexpr):
    """One row of the reference model's RMSNorm (``ADD``: after the residual add) with ``fused_layers``' row code
    and launch shape, so y is that kernel's bit for bit, then the activation codes of y for the packed layer
    reading it (INT8 / INT4 range, ``_act_codes_kernel``'s quantizer): one launch where there were two.
    ``TAIL``: a power of two ≥ KP − BLOCK, the zero codes of the padding past a short row's block. ``PDL``: as in
    ``_act_codes_kernel``."""
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    if ADD:
        x_in = _store_add(X + row * stride_x, R + row * stride_r, S + row * stride_s, cols, inside)
    else:
        x_in = tl.load(X + row * stride_x + cols, mask=inside, other=0.0)
    y = _store_rms_norm(x_in, W, Y + row * stride_y, cols, inside, D, eps).to(tl.float32)
    codes_row = codes_ptr + row * stride_c
    _store_codes(y, cols, inside, D, KP, codes_row, scale_ptr + row, sum_ptr + row, 0, beta_scale, KIND, 0, 1,
                 EPS_)
    if TAIL > 0:
        pad = BLOCK + tl.arange(0, TAIL)
        tl.store(codes_row + pad, tl.zeros([TAIL], dtype=tl.int8), mask=pad < KP)


@triton.jit
def _dp4a(a, b, acc, USE_ASM: tl.constexpr):
    """acc + Σ_bytes a_byte·b_byte, ``a`` 4 unsigned bytes (codes 0..2), ``b`` 4 signed bytes, per int32 lane."""
    if USE_ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        for byte in tl.static_range(4):
            acc += ((a >> (8 * byte)) & 0xFF) * ((b << (24 - 8 * byte)) >> 24)
        return acc


@triton.jit
def _decode_field(p, FIELD: tl.constexpr, USE_ASM: tl.constexpr):
    """int8 codes 0..2 of 2-bit field ``FIELD`` of every packed byte: with PTX, 4 bytes per shift + and."""
    if USE_ASM:
        if FIELD == 0:
            return tl.inline_asm_elementwise("and.b32 $0, $1, 0x03030303;", "=r,r", [p], dtype=tl.int8,
                                             is_pure=True, pack=4)
        elif FIELD == 1:
            return tl.inline_asm_elementwise("shr.b32 $0, $1, 2;\n\tand.b32 $0, $0, 0x03030303;", "=r,r", [p],
                                             dtype=tl.int8, is_pure=True, pack=4)
        elif FIELD == 2:
            return tl.inline_asm_elementwise("shr.b32 $0, $1, 4;\n\tand.b32 $0, $0, 0x03030303;", "=r,r", [p],
                                             dtype=tl.int8, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise("shr.b32 $0, $1, 6;\n\tand.b32 $0, $0, 0x03030303;", "=r,r", [p],
                                             dtype=tl.int8, is_pure=True, pack=4)
    else:
        return ((p >> (2 * FIELD)) & 3).to(tl.int8)


@triton.jit
def _epilogue(acc, rows, toks, N, M, sum_ptr, scale_ptr, alpha_ptr, bias_ptr, out_ptr, stride_out,
              HAS_BIAS: tl.constexpr):
    """out[m, n] = ((acc[n, m] − Σx[m])·s[m])·α[n] (+ b[n]) in fp32, cast to the output dtype (nearest even)."""
    tok_ok = toks < M
    sx = tl.load(sum_ptr + toks, mask=tok_ok, other=0)
    s = tl.load(scale_ptr + toks, mask=tok_ok, other=0.0)
    _store_out(acc, sx, s, rows, rows < N, toks, N, M, alpha_ptr, bias_ptr, out_ptr, stride_out, HAS_BIAS)


@triton.jit
def _store_out(acc, sx, s, rows, row_ok, toks, N, M, alpha_ptr, bias_ptr, out_ptr, stride_out,
               HAS_BIAS: tl.constexpr):
    """The epilogue on Σx and the scales as values: ((acc − Σx)·s)·α (+ b), stored where ``row_ok``."""
    tok_ok = toks < M
    a = tl.load(alpha_ptr + rows, mask=row_ok, other=0.0)
    y = (acc - sx[None, :]).to(tl.float32) * s[None, :]
    if HAS_BIAS:  # (y·α) rounded before + b, as PyTorch does: a plain product here compiles to an FMA
        y = mul_rn(y, a[:, None], COMPILED_) + tl.load(bias_ptr + rows, mask=row_ok, other=0.0)[:, None]
    else:
        y = y * a[:, None]
    ptrs = out_ptr + toks.to(tl.int64)[None, :] * stride_out + rows[:, None]
    tl.store(ptrs, _cast(y, out_ptr.dtype.element_ty), mask=row_ok[:, None] & tok_ok[None, :])


@triton.jit
def _add_partial_sums(total, rows, toks, N, M, ws_ptr):
    """Adds this K-slice's partial sums to the int32 workspace (integer atomics: exact in any order);
    ``_splitk_epilogue_kernel`` scales them. (A last-arrival epilogue in this launch, CUTLASS's split-K semaphore,
    was 3.5–8 µs slower at 16 tokens on the H200 than the second launch: bitnet/NOTES.md.)"""
    mask = (rows < N)[:, None] & (toks < M)[None, :]
    ws = ws_ptr + toks.to(tl.int64)[None, :] * N + rows[:, None]
    tl.atomic_add(ws, total, mask=mask, sem="relaxed")


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, ws_ptr, sum_ptr, scale_ptr, alpha_ptr, bias_ptr, out_ptr, N, M, n_groups,
                 groups_per_split, w_row16, x_row16, stride_out, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                 SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr, STAGES: tl.constexpr):
    """1–4 tokens on CUDA cores: ``w_ptr`` int32 words of the packed rows, ``x_ptr`` int32 words of the codes."""
    # row strides come in units of 16 elements (rows are whole groups): the compiler then knows every row is
    # 16-byte aligned, so loads vectorize and the tensor-core loop pipelines (cp.async)
    stride_w = w_row16 * 16
    stride_x = x_row16 * 16
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    words = tl.arange(0, WORDS_)  # 16 int32 words = 64 packed bytes = one group of a row
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w + words[None, :]
    x_rows = x_ptr + toks.to(tl.int64)[:, None] * stride_x + words[None, :]
    row_ok = (rows < N)[:, None]
    tok_ok = (toks < M)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M, WORDS_], dtype=tl.int32)
    g_start = tl.program_id(1) * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, n_groups)
    for g in tl.range(g_start, g_end, num_stages=STAGES):  # loads of later groups in flight (cp.async)
        packed = tl.load(w_rows + g * (WORDS_), mask=row_ok, other=0, eviction_policy="evict_first")
        for field in tl.static_range(4):
            x = tl.load(x_rows + g * (GROUP_ // 4) + field * WORDS_, mask=tok_ok, other=0)
            codes = tl.broadcast_to(((packed >> (2 * field)) & 0x03030303)[:, None, :], acc.shape)
            acc = _dp4a(codes, tl.broadcast_to(x[None, :, :], acc.shape), acc, USE_ASM)
    total = tl.sum(acc, axis=2)
    if SPLIT:
        _add_partial_sums(total, rows, toks, N, M, ws_ptr)
    else:
        _epilogue(total, rows, toks, N, M, sum_ptr, scale_ptr, alpha_ptr, bias_ptr, out_ptr, stride_out, HAS_BIAS)


@triton.jit
def _prefetch_groups_l2(w_ptr, rows, row_ok, stride_w, g_start, g_end):
    """``prefetch.global.L2`` of the packed weight groups [g_start, g_end) of ``rows`` (u8 rows of ``stride_w``
    bytes, 64 bytes a group): one prefetch per 128-byte line (two groups)."""
    for g in range(g_start, g_end, 2):
        ptrs = w_ptr + rows.to(tl.int64) * stride_w + g * SLICE_
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                                  "=r,l,r", [ptrs, row_ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _group_weights(packed, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
    """int8 codes (BLOCK_N, 256) of one packed group in the inputs' order (k = field·64 + byte): the four fields
    side by side. Each thread already holds every field of its bytes, so this is a renaming of registers, no data
    moves between threads (sm_90 SASS: the four decodes, then the wgmma straight from those registers)."""
    w = tl.join(tl.join(_decode_field(packed, 0, USE_ASM), _decode_field(packed, 2, USE_ASM)),
                tl.join(_decode_field(packed, 1, USE_ASM), _decode_field(packed, 3, USE_ASM)))
    # w[n, byte, i, o] is field 2i + o: [n, i, o, byte] flattens to k = (2i + o)·64 + byte
    return tl.reshape(tl.permute(w, (0, 2, 3, 1)), [BLOCK_N, GROUP_])


@triton.jit
def _gemm_kernel(w_ptr, x_ptr, ws_ptr, sum_ptr, scale_ptr, alpha_ptr, bias_ptr, out_ptr, N, M, n_groups,
                 groups_per_split, w_row16, x_row16, stride_out, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                 SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr):
    """Int8 tensor cores, swap-AB: acc[n, m] += W(BLOCK_N, 256) @ Xᵀ(256, BLOCK_M) per packed group, its four 2-bit
    fields as one K=256 product: one wgmma wait per group. (One product per field made the tensor cores wait four
    times a group, since each field's decode reuses the registers the wgmma reads: 4-29% slower at 3-128 tokens,
    NOTES.md "One wgmma wait per group, and the prefill tiles".)
    ``PDL`` (launched with programmatic dependent launch, few tokens): as the decode GEMV, the program starts while
    the codes kernel ahead still runs, prefetches its weight groups into L2 and waits before reading the codes."""
    # row strides come in units of 16 elements (rows are whole groups): the compiler then knows every row is
    # 16-byte aligned, so loads vectorize and the tensor-core loop pipelines (cp.async)
    stride_w = w_row16 * 16
    stride_x = x_row16 * 16
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w + tl.arange(0, SLICE_)[None, :]
    x_groups = x_ptr + toks.to(tl.int64)[None, :] * stride_x + tl.arange(0, GROUP_)[:, None]
    row_ok = (rows < N)[:, None]
    tok_ok = (toks < M)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
    g_start = tl.program_id(1) * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, n_groups)
    if PDL:
        _prefetch_groups_l2(w_ptr, rows, rows < N, stride_w, g_start, g_end)
        gdc_wait()  # the codes, Σ codes and scales are the kernel ahead's output (and the workspace its zeros)
    for g in range(g_start, g_end):
        packed = tl.load(w_rows + g * SLICE_, mask=row_ok, other=0)
        xt = tl.load(x_groups + g * GROUP_, mask=tok_ok, other=0)
        acc = tl.dot(_group_weights(packed, BLOCK_N, USE_ASM), xt, acc, out_dtype=tl.int32)
    if SPLIT:
        _add_partial_sums(acc, rows, toks, N, M, ws_ptr)
    else:
        _epilogue(acc, rows, toks, N, M, sum_ptr, scale_ptr, alpha_ptr, bias_ptr, out_ptr, stride_out, HAS_BIAS)


@triton.jit
def _dp4a_fields(w, x0, x1, x2, x3, acc64, acc16, USE_ASM: tl.constexpr):
    """The 4 fields of the packed word ``w`` dotted with their activation words ``x0..x3``, with masks instead of
    shifts: ``w & 0xC0C0C0C0`` is field 3 × 64 per byte, ``w & 0x30303030`` field 2 × 16, and of ``s = w << 4``
    (one shift for both) ``s & 0xC0C0C0C0`` field 1 × 64, ``s & 0x30303030`` field 0 × 16. So fields 1 and 3 go
    into ``acc64`` (64·Σ), 0 and 2 into ``acc16`` (16·Σ), and the caller divides once (exact: every term is a
    multiple). 9 instructions per word (1 shift, 4 and, 4 dp4a) against 11 with a shift per field
    (a shift per field), on two pipes (ALU: shift/and; FMA: dp4a)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 s, t, a, b;\n\t"
            "shl.b32 s, $2, 4;\n\t"
            "and.b32 t, $2, 0xC0C0C0C0; dp4a.u32.s32 a, t, $6, $7;\n\t"
            "and.b32 t, s, 0xC0C0C0C0; dp4a.u32.s32 a, t, $4, a;\n\t"
            "and.b32 t, $2, 0x30303030; dp4a.u32.s32 b, t, $5, $8;\n\t"
            "and.b32 t, s, 0x30303030; dp4a.u32.s32 b, t, $3, b;\n\t"
            "mov.b32 $0, a; mov.b32 $1, b; }",
            "=r,=r,r,r,r,r,r,r,r", [w, x0, x1, x2, x3, acc64, acc16], dtype=(tl.int32, tl.int32), is_pure=True,
            pack=1)
    else:
        s = w << 4
        acc64 = _dp4a(w & HIGH_FIELD, x3, acc64, False)
        acc64 = _dp4a(s & HIGH_FIELD, x1, acc64, False)
        acc16 = _dp4a(w & 0x30303030, x2, acc16, False)
        acc16 = _dp4a(s & 0x30303030, x0, acc16, False)
        return acc64, acc16


@triton.jit
def _vector_words(t, ROWS: tl.constexpr, KW: tl.constexpr):
    """The 4 words of every 16-byte vector of a [ROWS, KW] int32 tile, as 4 [ROWS, KW // 4] tiles (the same split
    of every tile: word j of a vector pairs with word j). A thread holds whole vectors (the tiles are loaded 16
    bytes per thread), so the splits move no data; they let the dot chain a vector's 4 words into one accumulator
    pair instead of keeping 2·KW accumulators per row."""
    lo, hi = tl.split(tl.reshape(t, [ROWS, KW // 4, 2, 2]))
    a, b = tl.split(lo)
    c, d = tl.split(hi)
    return a, b, c, d


@triton.jit
def _field_words(x_row, word, inside, FIELD: tl.constexpr):
    """[1, KW] int32 words of the activation codes that field ``FIELD`` of the packed words ``word`` multiplies:
    codes 256·g + 64·FIELD + 4·(j % 16) + 0..3 of word j (group g = j // 16), i.e. word 64·g + 16·FIELD + j % 16
    of the code row. Runs of 16 consecutive words starting at multiples of 16 (the hints let the load be 16-byte
    vectors in the weight tile's own layout: the weights are never moved)."""
    idx = tl.max_contiguous(tl.multiple_of((word // WORDS_) * (GROUP_ // 4) + FIELD * WORDS_ + word % WORDS_,
                                           WORDS_), WORDS_)
    return tl.load(x_row + idx[None, :], mask=inside[None, :], other=0)


@triton.jit
def _dot_chunk(w, x_row, word, inside, acc64, acc16, ROWS: tl.constexpr, KW: tl.constexpr, USE_ASM: tl.constexpr):
    """acc64, acc16 + the [ROWS, KW] packed weight words ``w`` (words ``word`` of each row) dotted with the codes."""
    w0, w1, w2, w3 = _vector_words(w, ROWS, KW)
    f0 = _vector_words(_field_words(x_row, word, inside, 0), 1, KW)
    f1 = _vector_words(_field_words(x_row, word, inside, 1), 1, KW)
    f2 = _vector_words(_field_words(x_row, word, inside, 2), 1, KW)
    f3 = _vector_words(_field_words(x_row, word, inside, 3), 1, KW)
    acc64, acc16 = _dp4a_fields(w0, f0[0], f1[0], f2[0], f3[0], acc64, acc16, USE_ASM)
    acc64, acc16 = _dp4a_fields(w1, f0[1], f1[1], f2[1], f3[1], acc64, acc16, USE_ASM)
    acc64, acc16 = _dp4a_fields(w2, f0[2], f1[2], f2[2], f3[2], acc64, acc16, USE_ASM)
    acc64, acc16 = _dp4a_fields(w3, f0[3], f1[3], f2[3], f3[3], acc64, acc16, USE_ASM)
    return acc64, acc16


@triton.jit
def _prefetch_rows_l2(w_ptr, rows, row_ok, w_row16, n_words, KW: tl.constexpr):
    """``prefetch.global.L2`` of every 128-byte line of the program's packed weight rows (32 int32 words a line):
    the loads that follow ``gdc_wait`` then hit L2. One prefetch per line and thread, no registers held."""
    lines = tl.arange(0, KW // 32) * 32
    for c in range(0, tl.cdiv(n_words, KW)):
        word = c * KW + lines
        ptrs = w_ptr + rows[:, None] * (w_row16 * 16) + word[None, :]
        ok = (row_ok[:, None] & (word < n_words)[None, :]).to(tl.int32)
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                                  "=r,l,r", [ptrs, ok], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _decode_gemv_v3_kernel(codes_ptr, sum_ptr, scale_ptr, w_ptr, alpha_ptr, bias_ptr, out_ptr, N, M, n_groups,
                           rows_per_program, x_row16, w_row16, stride_out, BLOCK_N: tl.constexpr, KW: tl.constexpr,
                           STAGES: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr):
    """Decode GEMV v3 (NOTES.md "Decode GEMV v3"): one token (``program_id(1)``) on ready codes (int32 words of
    ``codes_ptr``, its scale and Σ codes), ``rows_per_program`` whole rows per program (a ``BLOCK_N`` tile, the
    rest masked), K in chunks of ``KW`` = 128 × warps int32 words per row: every thread loads one 16-byte vector
    per row and chunk, every warp 512 contiguous bytes of a row, and the activation words of its 4 columns per
    field in the same layout (16-byte vectors, L2/L1 hits), so nothing changes layout until the final reduction.
    ``STAGES`` > 1: ``tl.range`` software-pipelines the chunks (cp.async into shared memory, STAGES − 1 chunks in
    flight ahead); 1 chunk per row: plain 16-byte loads, all issued before the first dot.
    ``PDL`` (launched with programmatic dependent launch): the program starts while the kernel ahead (the codes
    kernel) still runs, streams its weight rows into L2 (they do not depend on that kernel), and waits for it only
    before the first read of the codes."""
    pid = tl.program_id(0)
    tok = tl.program_id(1)
    local = tl.arange(0, BLOCK_N)
    rows = pid * rows_per_program + local
    row_ok = (local < rows_per_program) & (rows < N)
    cols = tl.arange(0, KW)
    # int32 offsets (the launcher checks N·row words < 2^31); row strides in units of 16 words: 64-byte rows
    w_offs = rows[:, None] * (w_row16 * 16) + cols[None, :]
    x_row = codes_ptr + tok.to(tl.int64) * (x_row16 * 16)
    n_words = n_groups * WORDS_  # a multiple of 16 the compiler sees: the masks keep 16-byte vectors whole
    if PDL:
        _prefetch_rows_l2(w_ptr, rows, row_ok, w_row16, n_words, KW)
        # the codes, Σ codes and scale are the kernel ahead's output. No early start for the kernel after this
        # one: a sibling GEMV started now would stream its weights against these (H200, 6962961: back-to-back
        # GEMVs 5.5 -> 6.1 us at 4096x4096 with it)
        gdc_wait()
    acc64 = tl.zeros([BLOCK_N, KW // 4], dtype=tl.int32)
    acc16 = tl.zeros([BLOCK_N, KW // 4], dtype=tl.int32)
    for c in tl.range(0, tl.cdiv(n_words, KW), num_stages=STAGES):
        word = c * KW + cols
        inside = word < n_words
        w = tl.load(w_ptr + c * KW + w_offs, mask=row_ok[:, None] & inside[None, :], other=0,
                    eviction_policy="evict_first")
        acc64, acc16 = _dot_chunk(w, x_row, word, inside, acc64, acc16, BLOCK_N, KW, USE_ASM)
    # every dp4a term of acc64 (acc16) is a multiple of 64 (16): the shifts are exact per lane, one reduction
    total = tl.sum((acc64 >> 6) + (acc16 >> 4), axis=1)
    toks = tok + tl.arange(0, 1)
    _store_out(total[:, None], tl.load(sum_ptr + toks), tl.load(scale_ptr + toks), rows, row_ok, toks, N, M,
               alpha_ptr, bias_ptr, out_ptr, stride_out, HAS_BIAS)


@triton.jit
def _splitk_epilogue_kernel(ws_ptr, sum_ptr, scale_ptr, alpha_ptr, bias_ptr, out_ptr, N, M, stride_out,
                            BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The epilogue of a split-K matmul; leaves the workspace zero for the next one."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rows < N)[:, None] & (toks < M)[None, :]
    ws = ws_ptr + toks.to(tl.int64)[None, :] * N + rows[:, None]
    acc = tl.load(ws, mask=mask, other=0)
    # The compiler gives the zero store its own layout (the stored value is a constant, so it is coalesced on its
    # own: (4, 1) per thread over (16, 2) lanes vs the load's (8, 1) over (8, 4)): the thread that zeroes an
    # element is in general not the one that read it, and without this barrier a warp may zero sums another warp
    # has not read yet (that token's output then is −Σx·s·α). bar.sync performs every thread's reads first.
    tl.debug_barrier()
    tl.store(ws, tl.zeros_like(acc), mask=mask)
    _epilogue(acc, rows, toks, N, M, sum_ptr, scale_ptr, alpha_ptr, bias_ptr, out_ptr, stride_out, HAS_BIAS)


# --------------------------------------------------------------------------------------------- launchers

_ACT_LAUNCH = FastLauncher(_act_codes_kernel)
_ACT_STREAM_LAUNCH = FastLauncher(_act_codes_stream_kernel)
_NORM_CODES_LAUNCH = FastLauncher(_norm_codes_kernel)
_GLU_CODES_LAUNCH = FastLauncher(_glu_codes_kernel)
_GEMV_LAUNCH = FastLauncher(_gemv_kernel)
_DECODE_V3_LAUNCH = FastLauncher(_decode_gemv_v3_kernel)
_GEMM_LAUNCH = FastLauncher(_gemm_kernel)
_EPILOGUE_LAUNCH = FastLauncher(_splitk_epilogue_kernel)
EPILOGUE_TILE = (64, 16)  # (BLOCK_N, BLOCK_M) of the split-K epilogue
_WORKSPACES: dict = {}  # device -> int32 buffer kept all zero between calls (the split-K epilogue re-zeroes it)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The streaming codes kernel (_act_codes_stream_kernel; NOTES.md "The streaming codes kernel"), measured against the
# whole-row kernel on the H200 at 512 and 2048 bf16 rows, D = 2560 / 4096 / 6912 / 8192 / 11008, with and without the
# sub-norm: it wins where the whole-row kernel's block is large (BLOCK_D = next_pow2(padded_k(D)) at or above
# STREAM_MIN_BLOCK: 16 warps, a third of the lanes idle at 11008, 1-2 programs per SM; INT4's extra Σ|x| reduction
# already from 8192): 11008 INT8 31.1 -> 28.5 us, with the sub-norm 68.0 -> 46.1; INT4 at 6912 22.9 -> 16.6, at
# 11008 48.2 -> 30.1. At D <= 4096 (INT8 also at 8192) it is slower (4096 INT8 10.2 -> 11.5 us: the whole-row
# kernel's marginal rows already run at the copy bandwidth), and under STREAM_MIN_ROWS rows (decode, small
# batches: one wave, latency-bound) the whole-row kernel's single load per row wins. Chunks of STREAM_CHUNK columns,
# STREAM_WARPS warps (8 values per thread; 2048-column chunks and 8 warps measured no better).
STREAM_KINDS = ("int8", "int4")
STREAM_MIN_ROWS = 512
STREAM_MIN_BLOCK = {"int8": 16384, "int4": 8192}
STREAM_CHUNK = 1024
STREAM_WARPS = 4

V3_ROWS = 8  # v3 rows per program (4 where 8 would leave fewer than V3_MIN_PROGRAMS programs per SM)
V3_MIN_PROGRAMS = 2
V3_MAX_WORDS = 1 << 16  # v3's accumulators hold 64·Σ: |64 · 2 · 128 · 16·words| < 2^31 up to 2^16 words per row


def _v3_plan(n: int, words: int, sms: int) -> dict:
    """v3's tile (NOTES.md "Decode GEMV v3"): ``KW`` = 128 int32 words per warp (one 16-byte vector per thread and
    row), 2 warps where a row has ≥ 256 words (K ≥ 4096), else 1; 8 rows per program (4 where that gives too few
    programs); one chunk per row: plain loads (``num_stages`` 1), more: 3 pipeline stages (cp.async, 2 chunks
    ahead)."""
    warps = 2 if words >= 256 else 1
    kw = 128 * warps
    rows = V3_ROWS if _cdiv(n, V3_ROWS) >= V3_MIN_PROGRAMS * sms else V3_ROWS // 2
    stages = 1 if words <= kw else 3
    return dict(kernel="decode", version=3, BLOCK_N=rows, BLOCK_M=1, rows_per_program=rows, KW=kw, SB=0, split=1,
                num_warps=warps, num_stages=stages)


def decode_plan(m: int, n: int, k: int, sms: int = 132) -> dict:
    """Tile of the decode GEMV (v3, :func:`_v3_plan`) for 1–``GEMV_MAX_TOKENS`` tokens: on ready codes (the caller's
    codes kernel, or a sibling's), 4–8 rows per program, 16-byte loads, chunks pipelined; one grid row per token
    (the second and later tokens read the weights from L2), no K split, so a program owns whole rows."""
    if not 0 < m <= GEMV_MAX_TOKENS:
        raise ValueError(f"m: the decode GEMV takes 1–{GEMV_MAX_TOKENS} tokens, got {m}")
    return _v3_plan(n, padded_k(k) // 16, sms)


def takes_decode_gemv(m: int, n: int) -> bool:
    """True when :func:`plan` gives ``m`` tokens × ``n`` output rows the CUDA-core decode GEMV (v3, on ready codes):
    1 token, and 2 tokens of a layer with at most ``TWO_TOKEN_GEMV_MAX_ROWS`` rows (measured; the tensor-core GEMM
    elsewhere)."""
    return m == 1 or (m == 2 and n <= TWO_TOKEN_GEMV_MAX_ROWS)


def plan(m: int, n: int, k: int, sms: int = 132) -> dict:
    """Kernel, tile, K split and launch options for an (m tokens) × (n, k) product, from the shape alone.

    1 token, and 2 tokens of a layer of ≤ 4096 rows (:func:`takes_decode_gemv`): :func:`decode_plan` (no split;
    v3 on ready codes). Beyond, the tensor-core GEMM with the tile a sweep
    of tile/warp/split configs chose on the H200 (7B and 2B layer shapes, 32–2048 tokens, `bitnet/NOTES.md`):
    ≤ 32 tokens 64 × 16 tiles; from 512 tokens 128 × 128 where the layer has ≥ ``PREFILL_SQUARE_MIN_ROWS`` rows
    and those tiles fill ``PREFILL_SQUARE_MIN_WAVES`` waves; else 64 × 64; 4 warps, 3 stages. The K loop is split
    only for long K (≥ 24 groups: 6912, 11008) at ≤ 128 tokens, until 1.5 programs per SM or 4 groups per
    slice: there it pays (2560 × 6912 at 16 tokens: 10.2 against 12.8 µs unsplit); on K ≤ 4096 the workspace
    and the second launch cost more than the idle SMs (4096 × 4096 at 16 tokens: 8.9 unsplit, 10.0 split). (``kernel="gemv"``, the
    split-K CUDA-core GEMV the decode kernel replaced, is still run when a config asks for it: tests, the
    benchmark's sweep.)"""
    if takes_decode_gemv(m, n):
        return decode_plan(m, n, k, sms)
    groups = padded_k(k) // GROUP
    if m <= 32:
        block_n, block_m = 64, 16
    elif (m >= PREFILL_SQUARE_MIN_TOKENS and n >= PREFILL_SQUARE_MIN_ROWS
          and _cdiv(n, 128) * _cdiv(m, 128) >= PREFILL_SQUARE_MIN_WAVES * sms):
        block_n, block_m = 128, 128
    else:
        block_n, block_m = 64, 64
    tiles = _cdiv(n, block_n) * _cdiv(m, block_m)
    split = 1
    while m <= 128 and groups >= 24 and tiles * split < 3 * sms // 2 and groups // (split * 2) >= 4:
        split *= 2
    per_split = _cdiv(groups, split)
    return dict(kernel="gemm", BLOCK_N=block_n, BLOCK_M=block_m, split=_cdiv(groups, per_split),
                groups_per_split=per_split, num_warps=4, num_stages=3)


def pdl_ok(device: torch.device) -> bool:
    """True when the decode GEMV launches with programmatic dependent launch (and the codes kernels ahead of it
    let it start early): compiled kernels (not the interpreter) on an sm_90+ GPU. Why: a 1-token GEMV's own launch
    and the first trip to HBM were ~2–3 µs of its 5.6–11 (NOTES.md "Decode GEMV v3, measured"); launched early, it
    streams its weights into L2 while the codes kernel runs."""
    return USE_ASM and device.type == "cuda" and capability(device) >= (9, 0)


def gemm_launches_early(m: int, programs: int, device: torch.device) -> bool:
    """True when the tensor-core GEMM of ``m`` tokens on ``programs`` programs launches with programmatic dependent
    launch behind its codes kernel (measured: few tokens, at most ``GEMM_PDL_MAX_PROGRAMS_PER_SM`` programs per SM)."""
    return (m <= GEMM_PDL_MAX_TOKENS and programs <= GEMM_PDL_MAX_PROGRAMS_PER_SM * _sm_count(device)
            and pdl_ok(device))


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    """An all-zero int32 buffer of at least ``numel`` per device (the kernels leave it zero). One stream: two
    matmuls running concurrently on different streams would share it."""
    buf = _WORKSPACES.get(device)
    if buf is None or buf.numel() < numel:
        buf = torch.zeros(max(numel, 1 << 16), dtype=torch.int32, device=device)
        _WORKSPACES[device] = buf
    return buf


def scratch_nonzero(device: torch.device | str) -> dict:
    """Non-zero entries in ``device``'s split-K scratch buffer: ``{"workspace": n}`` (0 when not allocated yet).
    Every matmul must leave it all zero: the next split-K call accumulates into it from zero. A check for tests
    and diagnostics (``benchmarks/bitnet_packed_diag.py``); it reads the buffer (a device sync)."""
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"device: expected a torch.device or a device string, got {type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device: {err}") from None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    counts = {}
    buf = _WORKSPACES.get(device)
    counts["workspace"] = 0 if buf is None else int((buf != 0).sum())
    return counts


def codes_kernel(kind: str, m: int, d: int) -> str:
    """Which kernel :func:`quantize_codes` runs on ``m`` rows of ``d`` features for quantizer ``kind``: ``"stream"``
    (``_act_codes_stream_kernel``: INT8 / INT4 from STREAM_MIN_ROWS rows where the whole-row kernel's block is at
    least STREAM_MIN_BLOCK) or ``"whole-row"`` (``_act_codes_kernel``)."""
    if kind in STREAM_KINDS and m >= STREAM_MIN_ROWS and _pow2(padded_k(d)) >= STREAM_MIN_BLOCK[kind]:
        return "stream"
    return "whole-row"


def _code_buffers(m: int, kp: int, device) -> tuple:
    """(int8 codes (m, kp), fp32 scales (m,), int32 Σ codes (m,)): what every codes launch writes."""
    return (torch.empty((m, kp), dtype=torch.int8, device=device), torch.empty(m, dtype=torch.float32, device=device),
            torch.empty(m, dtype=torch.int32, device=device))


def _whole_row_launch(kp: int) -> dict:
    """Block and launch shape of the whole-row codes kernel for rows padded to ``kp``; the GLU + codes kernel takes
    the same, so its reductions run on the same layout and its codes are the codes kernel's bit for bit."""
    block = _pow2(kp)
    return dict(BLOCK_D=block, num_warps=max(1, min(16, block // 512)), num_stages=3)


def quantize_codes(x: torch.Tensor, kind: str, *, beta_scale: float = 1.0, topk_ratio: float = 0.5,
                   norm_weight=None, norm_eps: float = 1e-5):
    """(int8 codes (M, padded_k(D)), fp32 scales (M,), int32 Σ codes (M,)) of rows ``x`` (M, D) by the kernel."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {list(KINDS)}, got {kind!r}")
    if x.dtype not in KEYS:
        raise TypeError(f"x: expected a float32, bfloat16 or float16 tensor, got {x.dtype}")
    m, d = x.shape
    if d > MAX_ROW[kind]:
        raise ValueError(f"x: rows of {d} features exceed the kernel's {MAX_ROW[kind]} for {kind}")
    kp = padded_k(d)
    if x.stride(-1) != 1:
        x = x.contiguous()
    codes, scale, sums = _code_buffers(m, kp, x.device)
    if m and codes_kernel(kind, m, d) == "stream":
        chunk = min(STREAM_CHUNK, _pow2(kp))
        _ACT_STREAM_LAUNCH((m,), x, norm_weight if norm_weight is not None else scale, codes, scale, sums, d, kp,
                           x.stride(0), codes.stride(0), float(beta_scale), float(norm_eps), KIND=KINDS[kind],
                           HAS_NORM=norm_weight is not None, CHUNK=chunk, EPS_=EPS,
                           num_warps=max(1, min(STREAM_WARPS, chunk // 256)), num_stages=1)
    elif m:
        shift, key_bits = KEYS[x.dtype]
        _ACT_LAUNCH((m,), x, norm_weight if norm_weight is not None else scale, codes, scale, sums, d, kp,
                    x.stride(0), codes.stride(0), topk_count(d, topk_ratio), float(beta_scale), float(norm_eps),
                    KIND=KINDS[kind], HAS_NORM=norm_weight is not None, KEY_SHIFT=shift, KEY_BITS=key_bits,
                    EPS_=EPS, PDL=pdl_ok(x.device), **_whole_row_launch(kp))
    return codes, scale, sums


def norm_codes(x: torch.Tensor, weight: torch.Tensor, eps: float, kind: str, *, beta_scale: float = 1.0,
               residual: torch.Tensor | None = None):
    """The reference model's RMSNorm of rows ``x`` (of ``x + residual`` when given) and the activation codes of its
    output for a packed layer quantizing with ``kind`` (INT8 / INT4 range), in one launch: ``(y, codes)``, or
    ``(x + residual, y, codes)``; ``codes`` = (int8 codes (M, padded_k(D)), fp32 scales, int32 Σ codes). y and the
    sum are ``fused_layers.rms_norm`` / ``add_rms_norm``'s bit for bit (their row code and launch shape), the codes
    :func:`quantize_codes`' of y (INT8 bit for bit; INT4's mean is summed in another order)."""
    if kind not in FUSED_KINDS:
        raise ValueError(f"kind: expected one of {list(FUSED_KINDS)}, got {kind!r}")
    D = x.shape[-1]
    _check_norm_weight(weight, D)
    if D > MAX_ROW[kind]:
        raise ValueError(f"x: rows of {D} features exceed the kernel's {MAX_ROW[kind]} for {kind}")
    rows = _rows(x)
    add = residual is not None
    if add:
        _check_residual(x, residual)
    res = _rows(residual) if add else rows
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
    total = torch.empty(rows.shape, dtype=x.dtype, device=x.device) if add else out
    m, kp = rows.shape[0], padded_k(D)
    codes, scale, sums = _code_buffers(m, kp, x.device)
    if m:
        launch = _norm_launch(D)
        block = launch["BLOCK"]
        _NORM_CODES_LAUNCH((m,), rows, res, weight, total, out, codes, scale, sums, D, kp, rows.stride(0),
                           res.stride(0), total.stride(0), out.stride(0), codes.stride(0), float(eps),
                           float(beta_scale), ADD=add, KIND=FUSED_KINDS[kind], BLOCK=block,
                           TAIL=_pow2(kp - block) if kp > block else 0, EPS_=EPS, PDL=pdl_ok(x.device),
                           num_warps=launch["num_warps"], num_stages=1)
    y = out.view(*x.shape[:-1], D)
    return (total.view(x.shape), y, (codes, scale, sums)) if add else (y, (codes, scale, sums))


def glu_takes_codes(layer, m: int) -> bool:
    """True when ``layer`` (a PackedBitLinear) on ``m`` rows would run the whole-row codes kernel on its input
    (INT8 / INT4 range, not the streaming kernel): then :func:`glu_codes` can make those codes in the GLU's
    launch."""
    return (layer.activation in FUSED_KINDS and layer.in_features <= MAX_ROW[layer.activation] and m > 0
            and codes_kernel(layer.activation, m, layer.in_features) == "whole-row")


def glu_codes(gate: torch.Tensor, up: torch.Tensor, kind: str, layer):
    """``(act(gate) * up, codes)`` in one launch: the GLU output (``fused_layers.glu``'s bit for bit) and
    :func:`layer_codes` of it for ``layer`` (a PackedBitLinear reading it: its sub-norm and INT8 / INT4-range
    quantizer, the whole-row codes kernel's values bit for bit). gate/up (..., in_features), any row strides (the
    halves of a stacked gate/up output)."""
    check_glu(gate, up, kind)
    if layer.activation not in FUSED_KINDS:
        raise ValueError(f"layer: expected an INT8 / INT4-range layer ({list(FUSED_KINDS)}), got "
                         f"{layer.activation!r}")
    D = gate.shape[-1]
    if D != layer.in_features or D > MAX_ROW[layer.activation]:
        raise ValueError(f"gate: expected rows of layer.in_features={layer.in_features} features (at most "
                         f"{MAX_ROW[layer.activation]}), got {D}")
    g, u = _rows(gate), _rows(up)
    m, kp = g.shape[0], padded_k(D)
    y = torch.empty((m, D), dtype=gate.dtype, device=gate.device)
    codes, scale, sums = _code_buffers(m, kp, gate.device)
    norm = layer.norm
    if m:
        _GLU_CODES_LAUNCH((m,), g, u, y, norm.weight if norm is not None else scale, codes, scale, sums, D, kp,
                          g.stride(0), u.stride(0), codes.stride(0), float(layer.beta_scale),
                          float(norm.eps if norm is not None else 1e-5), RELU2=kind == "relu2",
                          KIND=FUSED_KINDS[layer.activation], HAS_NORM=norm is not None, EPS_=EPS,
                          PDL=pdl_ok(gate.device), **_whole_row_launch(kp))
    return y.view(gate.shape), (codes, scale, sums)


def matmul_codes(codes, scale, sums, packed, alpha_rows, bias, out_dtype, n: int, k: int,
                 config: dict | None = None) -> torch.Tensor:
    """(M, n) output of activation codes (M, padded_k(k)) times the packed (n, padded_k(k)/4) weight."""
    m = codes.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=codes.device)
    if m == 0:
        return out
    if codes.stride(-1) != 1 or codes.stride(0) % 64:
        # the kernels take the row stride in units of 16 elements (16 int32 words for the GEMV) and tell the
        # compiler it is a multiple of 16: a row stride that is not a multiple of 64 bytes would be floored
        codes = codes.contiguous()
    cfg = config or plan(m, n, k, _sm_count(codes.device))
    if cfg["kernel"] == "decode":
        return _decode_v3(cfg, out, codes.view(torch.int32), scale, sums, packed.view(torch.int32), alpha_rows, bias,
                          n)
    groups = padded_k(k) // GROUP
    split = cfg["split"] > 1
    mode = 1 if split else 0  # 1: partial sums to the workspace, then the epilogue kernel
    ws = _workspace(codes.device, m * n) if split else sums
    bias_arg = bias if bias is not None else alpha_rows
    grid = (_cdiv(n, cfg["BLOCK_N"]), cfg["split"], _cdiv(m, cfg["BLOCK_M"]))
    if cfg["kernel"] == "gemv":
        w_words, x_words = packed.view(torch.int32), codes.view(torch.int32)
        _GEMV_LAUNCH(grid, w_words, x_words, ws, sums, scale, alpha_rows, bias_arg, out, n, m, groups,
                     cfg["groups_per_split"], w_words.stride(0) // 16, x_words.stride(0) // 16, out.stride(0),
                     BLOCK_N=cfg["BLOCK_N"], BLOCK_M=cfg["BLOCK_M"], SPLIT=mode, HAS_BIAS=bias is not None,
                     USE_ASM=USE_ASM, STAGES=cfg["num_stages"], num_warps=cfg["num_warps"],
                     num_stages=cfg["num_stages"])
    else:
        pdl = gemm_launches_early(m, grid[0] * grid[1] * grid[2], out.device)
        _GEMM_LAUNCH(grid, packed, codes, ws, sums, scale, alpha_rows, bias_arg, out, n, m, groups,
                     cfg["groups_per_split"], packed.stride(0) // 16, codes.stride(0) // 16, out.stride(0),
                     BLOCK_N=cfg["BLOCK_N"], BLOCK_M=cfg["BLOCK_M"], SPLIT=mode, HAS_BIAS=bias is not None,
                     USE_ASM=USE_ASM, PDL=pdl, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                     launch_pdl=pdl)
    if mode == 1:
        bn, bm = EPILOGUE_TILE
        _EPILOGUE_LAUNCH((_cdiv(n, bn), _cdiv(m, bm)), ws, sums, scale, alpha_rows, bias_arg, out, n, m,
                         out.stride(0), BLOCK_N=bn, BLOCK_M=bm, HAS_BIAS=bias is not None, num_warps=4,
                         num_stages=1)
    return out


def _check_offsets(n: int, w_words: torch.Tensor) -> None:
    if n * w_words.stride(0) >= 2 ** 31:
        raise ValueError(f"packed: {n} rows of {w_words.stride(0)} int32 words exceed the decode GEMV's int32 "
                         "offsets (2^31 words)")


def _decode_v3(cfg: dict, out, codes_words, scale, sums, w_words, alpha_rows, bias, n: int):
    """One launch of ``_decode_gemv_v3_kernel``: a program per ``rows_per_program`` rows and token."""
    m = out.shape[0]
    _check_offsets(n, w_words)
    if w_words.shape[1] > V3_MAX_WORDS:
        raise ValueError(f"packed: rows of {w_words.shape[1]} int32 words exceed the v3 decode GEMV's "
                         f"{V3_MAX_WORDS} (its int32 accumulators)")
    rpp = cfg["rows_per_program"]
    pdl = pdl_ok(out.device)
    _DECODE_V3_LAUNCH((_cdiv(n, rpp), m), codes_words, sums, scale, w_words, alpha_rows,
                      bias if bias is not None else alpha_rows, out, n, m, w_words.shape[1] // 16, rpp,
                      codes_words.stride(0) // 16, w_words.stride(0) // 16, out.stride(0), BLOCK_N=cfg["BLOCK_N"],
                      KW=cfg["KW"], STAGES=cfg["num_stages"], HAS_BIAS=bias is not None, USE_ASM=USE_ASM,
                      PDL=pdl, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=pdl)
    return out


def layer_codes(x: torch.Tensor, layer):
    """(codes, scales, Σ codes) of rows ``x`` (M, in) for ``layer`` (a PackedBitLinear): its sub-norm and quantizer."""
    norm = layer.norm
    return quantize_codes(x, layer.activation, beta_scale=layer.beta_scale, topk_ratio=layer.topk_ratio,
                          norm_weight=None if norm is None else norm.weight, norm_eps=1e-5 if norm is None else norm.eps)


def packed_linear(x: torch.Tensor, layer, config: dict | None = None, codes=None) -> torch.Tensor:
    """The forward of ``layer`` (a PackedBitLinear) on rows ``x`` (M, in) with the kernels; ``codes``: the rows'
    :func:`layer_codes` when a sibling projection already computed them. Otherwise the codes kernel, then the
    matmul (the plan's: the v3 decode GEMV at 1 token and 2 of a narrow layer, else the tensor-core GEMM)."""
    codes, scale, sums = codes if codes is not None else layer_codes(x, layer)
    return matmul_codes(codes, scale, sums, layer.packed, layer.row_scale(), layer.bias, x.dtype,
                        layer.out_features, layer.in_features, config)
