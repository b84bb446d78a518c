"""Triton kernels of :class:`~thrifty.bitnet.packed.PackedBitLinear` (sm_90 target; the CPU interpreter in tests).

A forward is two launches (three more when the K loop is split):

1. ``_act_codes_kernel``, one program per token: the optional sub-norm and the recipe's quantizer (INT8 absmax,
   INT4-range absmean, TopK+INT8) with the arithmetic of ``quant_kernel._quantize_rows_kernel`` (its helpers),
   writing int8 codes (zero-padded to whole 256-weight groups), the fp32 scale and Σ codes of the token.
2. the matmul, weights unpacked in registers, ``acc = Σ c·x`` with the *codes* ``c = w + 1`` (the −1 is the
   per-token ``Σ x`` subtracted once in the epilogue), then ``((acc − Σx)·s_x)·α (+ b)`` in fp32:

   * ``_gemv_kernel`` (1–4 tokens): CUDA cores. The packed row is read as int32 words; ``(word >> 2i) &
     0x03030303`` is 4 consecutive codes as bytes, multiplied with 4 int8 activations by one ``dp4a``: 3
     instructions per 4 weights and token, per-lane accumulators reduced once at the end.
   * ``_gemm_kernel`` (more tokens; decode 5–16 and prefill): int8 tensor cores, ``tl.dot(int8, int8) → int32``
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

from ..triton_utils import FastLauncher, interpreting
from .pack import GROUP, SLICE, padded_k
from .quant_kernel import KEYS, MAX_ROW, _as_float, _cast, _div_rn, _round_half_even, _topk_keep
from .reference import EPS, topk_count

KINDS = {"int8": 0, "int4": 1, "topk_int8": 2}  # the codes of quant_kernel.KINDS
USE_ASM = not interpreting()  # inline PTX (dp4a, packed decode) on the GPU; plain Triton ops in the interpreter
# compiled (not interpreted) kernels: products that an add follows are spelled mul.rn, which LLVM never contracts
# into an FMA (Triton's enable_fp_fusion does: one rounding where PyTorch rounds twice). Fixed at import, as the
# kernels themselves are; a constexpr global (not a kernel argument) so that USE_ASM stays free to toggle on the GPU
COMPILED_ = tl.constexpr(not interpreting())
GEMV_MAX_TOKENS = 4  # up to here CUDA-core dp4a; beyond, tensor cores
NAN_BITS = tl.constexpr(0x7F800000)  # |x| bit patterns at or above this are ±inf or NaN
SQRT7_ = tl.constexpr(2.6457513110645907)
GROUP_ = tl.constexpr(GROUP)  # weights per packed group (kernels read constexprs, never plain module globals)
SLICE_ = tl.constexpr(SLICE)  # weights per 2-bit field of a group = bytes per row and group
WORDS_ = tl.constexpr(SLICE // 4)  # int32 words per row and group


@triton.jit
def _act_codes_kernel(x_ptr, w_ptr, codes_ptr, scale_ptr, sum_ptr, D, KP, stride_x, stride_c, k_keep, beta_scale,
                      norm_eps, KIND: tl.constexpr, HAS_NORM: tl.constexpr, KEY_SHIFT: tl.constexpr,
                      KEY_BITS: tl.constexpr, BLOCK_D: tl.constexpr, EPS_: tl.constexpr):
    """Codes, scale and Σ codes of one token (the values of quant_kernel's input kernel, before the rescale)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    x_in = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    x = x_in.to(tl.float32)
    if HAS_NORM:  # BitLinear's sub-norm, as quant_kernel computes it
        rstd = _div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(tl.sum(x * x, axis=0), _as_float(D)) + norm_eps))
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        x = _cast(_cast(x * rstd, x_in.dtype).to(tl.float32) * w, x_in.dtype).to(tl.float32)
    bits = tl.where(inside, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
    top = tl.max(bits, axis=0)
    if KIND == 1:  # INT4 range, absmean
        # mean·beta_scale rounded on its own: ``beta + EPS_`` below would otherwise compile to one FMA
        beta = _mul_rn(tl.math.div_rn(tl.sum(bits.to(tl.float32, bitcast=True), axis=0), _as_float(D)),
                       beta_scale, COMPILED_)
        q = _round_half_even(tl.minimum(tl.maximum(x * _div_rn(SQRT7_, beta + EPS_), -8.0), 7.0))
        scale = tl.math.div_rn(beta, tl.full([], SQRT7_, tl.float32))
    else:
        if KIND == 2:
            x = tl.where(_topk_keep(bits >> KEY_SHIFT, inside, k_keep, D, KEY_BITS), x, 0.0)
        gamma = top.to(tl.float32, bitcast=True)
        q = _round_half_even(tl.minimum(tl.maximum(x * _div_rn(127.0, gamma + EPS_), -128.0), 127.0))
        scale = tl.math.div_rn(gamma, tl.full([], 127.0, tl.float32))
    bad = top >= NAN_BITS
    codes = tl.where(inside & (top < NAN_BITS), q, 0.0).to(tl.int32)
    tl.store(codes_ptr + row * stride_c + cols, codes.to(tl.int8), mask=cols < KP)
    tl.store(scale_ptr + row, tl.where(bad, float("nan"), scale))
    tl.store(sum_ptr + row, tl.sum(codes, axis=0))


@triton.jit
def _mul_rn(a, b, COMPILED: tl.constexpr):
    """``a·b`` rounded to fp32 on its own when an add follows (as PyTorch computes it): a plain product followed by
    an add compiles to one FMA (Triton's enable_fp_fusion), ``mul.rn.f32`` is never contracted. PTX rather than
    libdevice's mul_rn, which Triton builds with flush-to-zero (PyTorch keeps subnormals). NumPy never contracts."""
    if COMPILED:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


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
    row_ok = rows < N
    tok_ok = toks < M
    sx = tl.load(sum_ptr + toks, mask=tok_ok, other=0)
    s = tl.load(scale_ptr + toks, mask=tok_ok, other=0.0)
    a = tl.load(alpha_ptr + rows, mask=row_ok, other=0.0)
    y = (acc - sx[None, :]).to(tl.float32) * s[None, :]
    if HAS_BIAS:  # (y·α) rounded before + b, as PyTorch does: a plain product here compiles to an FMA
        y = _mul_rn(y, a[:, None], COMPILED_) + tl.load(bias_ptr + rows, mask=row_ok, other=0.0)[:, None]
    else:
        y = y * a[:, None]
    ptrs = out_ptr + toks.to(tl.int64)[None, :] * stride_out + rows[:, None]
    tl.store(ptrs, _cast(y, out_ptr.dtype.element_ty), mask=row_ok[:, None] & tok_ok[None, :])


@triton.jit
def _split_k_reduce(total, rows, toks, N, M, ws_ptr, lock_ptr, sum_ptr, scale_ptr, alpha_ptr, bias_ptr, out_ptr,
                    stride_out, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Adds this K-slice's partial sums to the int32 workspace (integer atomics: exact in any order). SPLIT == 2:
    the last program of the tile to arrive (a per-tile counter; barrier + acq_rel atomic, CUTLASS's split-K
    semaphore pattern) takes the sums back with atomic exchanges (read at L2, left zero), resets the counter and
    runs the epilogue, so no second launch is needed. SPLIT == 1: ``_splitk_epilogue_kernel`` does it."""
    mask = (rows < N)[:, None] & (toks < M)[None, :]
    ws = ws_ptr + toks.to(tl.int64)[None, :] * N + rows[:, None]
    tl.atomic_add(ws, total, mask=mask, sem="relaxed")
    if SPLIT == 2:
        tl.debug_barrier()  # every thread's partial sums are issued before the tile's counter moves
        tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
        if arrived == tl.num_programs(1) - 1:
            acc = tl.atomic_xchg(ws, tl.zeros_like(total), mask=mask)
            tl.atomic_xchg(lock_ptr + tile, 0)
            _epilogue(acc, rows, toks, N, M, sum_ptr, scale_ptr, alpha_ptr, bias_ptr, out_ptr, stride_out, HAS_BIAS)


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, ws_ptr, lock_ptr, sum_ptr, scale_ptr, alpha_ptr, bias_ptr, out_ptr, N, M, n_groups,
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
        _split_k_reduce(total, rows, toks, N, M, ws_ptr, lock_ptr, sum_ptr, scale_ptr, alpha_ptr, bias_ptr, out_ptr,
                        stride_out, SPLIT, HAS_BIAS)
    else:
        _epilogue(total, rows, toks, N, M, sum_ptr, scale_ptr, alpha_ptr, bias_ptr, out_ptr, stride_out, HAS_BIAS)


@triton.jit
def _gemm_kernel(w_ptr, x_ptr, ws_ptr, lock_ptr, sum_ptr, scale_ptr, alpha_ptr, bias_ptr, out_ptr, N, M, n_groups,
                 groups_per_split, w_row16, x_row16, stride_out, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                 SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr):
    """Int8 tensor cores, swap-AB: acc[n, m] += W_field(BLOCK_N, 64) @ Xᵀ_field(64, BLOCK_M) per 2-bit field."""
    # row strides come in units of 16 elements (rows are whole groups): the compiler then knows every row is
    # 16-byte aligned, so loads vectorize and the tensor-core loop pipelines (cp.async)
    stride_w = w_row16 * 16
    stride_x = x_row16 * 16
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    k = tl.arange(0, SLICE_)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w + k[None, :]
    x_cols = x_ptr + toks.to(tl.int64)[None, :] * stride_x + k[:, None]
    row_ok = (rows < N)[:, None]
    tok_ok = (toks < M)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
    g_start = tl.program_id(1) * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, n_groups)
    for g in range(g_start, g_end):
        packed = tl.load(w_rows + g * SLICE_, mask=row_ok, other=0)
        for field in tl.static_range(4):
            xt = tl.load(x_cols + g * GROUP_ + field * SLICE_, mask=tok_ok, other=0)
            acc = tl.dot(_decode_field(packed, field, USE_ASM), xt, acc, out_dtype=tl.int32)
    if SPLIT:
        _split_k_reduce(acc, rows, toks, N, M, ws_ptr, lock_ptr, sum_ptr, scale_ptr, alpha_ptr, bias_ptr, out_ptr,
                        stride_out, SPLIT, HAS_BIAS)
    else:
        _epilogue(acc, rows, toks, N, M, sum_ptr, scale_ptr, alpha_ptr, bias_ptr, out_ptr, stride_out, HAS_BIAS)


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
_GEMV_LAUNCH = FastLauncher(_gemv_kernel)
_GEMM_LAUNCH = FastLauncher(_gemm_kernel)
_EPILOGUE_LAUNCH = FastLauncher(_splitk_epilogue_kernel)
EPILOGUE_TILE = (64, 16)  # (BLOCK_N, BLOCK_M) of the split-K epilogue
_WORKSPACES: dict = {}  # device -> int32 buffer kept all zero between calls (the split-K epilogue re-zeroes it)
_LOCKS: dict = {}  # device -> int32 per-tile arrival counters of the fused split-K epilogue, kept zero likewise


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the H100's, so that the interpreter exercises the splits the GPU would take


def plan(m: int, n: int, k: int, sms: int = 132) -> dict:
    """Kernel, tile, K split and launch options for an (m tokens) × (n, k) product, from the shape alone.

    Decode (m ≤ 16) reads the weight once and is bandwidth-bound: it wants ~4 resident programs per SM with
    several loads in flight each, so the K loop is split until there are ≥ 4·SMs programs (keeping ≥ 2 groups
    per program). Prefill is compute-bound: 128 × 128 tiles, split only when the tiles cannot fill the GPU."""
    groups = padded_k(k) // GROUP
    if m <= GEMV_MAX_TOKENS:
        kernel, block_n, block_m, warps, stages = "gemv", 32, _pow2(m), 4, 4
    elif m <= 64:
        kernel, block_n, block_m, warps, stages = "gemm", 64, max(16, _pow2(m)), 4, 4
    else:
        kernel, block_n, block_m, warps, stages = "gemm", 128, 128, 8, 3
    tiles = _cdiv(n, block_n) * _cdiv(m, block_m)
    split = 1
    target = 4 * sms if m <= 64 else 2 * sms
    while tiles * split < target and groups // (split * 2) >= 2:
        split *= 2
    per_split = _cdiv(groups, split)
    # fused_epilogue: the last K-slice of a tile applies the scales (one launch instead of two); off until the
    # GPU benchmark has checked its exactness and timed it (benchmarks/bitnet_kernels.py's sweep)
    return dict(kernel=kernel, BLOCK_N=block_n, BLOCK_M=block_m, split=_cdiv(groups, per_split),
                groups_per_split=per_split, num_warps=warps, num_stages=stages, fused_epilogue=False)


def _workspace(device: torch.device, numel: int, pool: dict | None = None) -> torch.Tensor:
    """An all-zero int32 buffer of at least ``numel`` per device (the kernels leave it zero). One stream: two
    matmuls running concurrently on different streams would share it."""
    pool = _WORKSPACES if pool is None else pool
    buf = pool.get(device)
    if buf is None or buf.numel() < numel:
        buf = torch.zeros(max(numel, 1 << 16), dtype=torch.int32, device=device)
        pool[device] = buf
    return buf


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
    codes = torch.empty((m, kp), dtype=torch.int8, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    sums = torch.empty(m, dtype=torch.int32, device=x.device)
    if m:
        shift, key_bits = KEYS[x.dtype]
        block = _pow2(kp)
        _ACT_LAUNCH((m,), x, norm_weight if norm_weight is not None else scale, codes, scale, sums, d, kp,
                    x.stride(0), codes.stride(0), topk_count(d, topk_ratio), float(beta_scale), float(norm_eps),
                    KIND=KINDS[kind], HAS_NORM=norm_weight is not None, KEY_SHIFT=shift, KEY_BITS=key_bits,
                    BLOCK_D=block, EPS_=EPS, num_warps=max(1, min(16, block // 512)), num_stages=3)
    return codes, scale, sums


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
    groups = padded_k(k) // GROUP
    split = cfg["split"] > 1
    mode = (2 if cfg.get("fused_epilogue") else 1) if split else 0
    ws = _workspace(codes.device, m * n) if split else sums
    tiles = _cdiv(n, cfg["BLOCK_N"]) * _cdiv(m, cfg["BLOCK_M"])
    locks = _workspace(codes.device, tiles, _LOCKS) if mode == 2 else sums
    bias_arg = bias if bias is not None else alpha_rows
    grid = (_cdiv(n, cfg["BLOCK_N"]), cfg["split"], _cdiv(m, cfg["BLOCK_M"]))
    if cfg["kernel"] == "gemv":
        w_words, x_words = packed.view(torch.int32), codes.view(torch.int32)
        _GEMV_LAUNCH(grid, w_words, x_words, ws, locks, sums, scale, alpha_rows, bias_arg, out, n, m, groups,
                     cfg["groups_per_split"], w_words.stride(0) // 16, x_words.stride(0) // 16, out.stride(0),
                     BLOCK_N=cfg["BLOCK_N"], BLOCK_M=cfg["BLOCK_M"], SPLIT=mode, HAS_BIAS=bias is not None,
                     USE_ASM=USE_ASM, STAGES=cfg["num_stages"], num_warps=cfg["num_warps"],
                     num_stages=cfg["num_stages"])
    else:
        _GEMM_LAUNCH(grid, packed, codes, ws, locks, sums, scale, alpha_rows, bias_arg, out, n, m, groups,
                     cfg["groups_per_split"], packed.stride(0) // 16, codes.stride(0) // 16, out.stride(0),
                     BLOCK_N=cfg["BLOCK_N"], BLOCK_M=cfg["BLOCK_M"], SPLIT=mode, HAS_BIAS=bias is not None,
                     USE_ASM=USE_ASM, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if mode == 1:
        bn, bm = EPILOGUE_TILE
        _EPILOGUE_LAUNCH((_cdiv(n, bn), _cdiv(m, bm)), ws, sums, scale, alpha_rows, bias_arg, out, n, m,
                         out.stride(0), BLOCK_N=bn, BLOCK_M=bm, HAS_BIAS=bias is not None, num_warps=4,
                         num_stages=1)
    return out


def layer_codes(x: torch.Tensor, layer):
    """(codes, scales, Σ codes) of rows ``x`` (M, in) for ``layer`` (a PackedBitLinear): its sub-norm and quantizer."""
    norm = layer.norm
    return quantize_codes(x, layer.activation, beta_scale=layer.beta_scale, topk_ratio=layer.topk_ratio,
                          norm_weight=None if norm is None else norm.weight, norm_eps=1e-5 if norm is None else norm.eps)


def packed_linear(x: torch.Tensor, layer, config: dict | None = None, codes=None) -> torch.Tensor:
    """The forward of ``layer`` (a PackedBitLinear) on rows ``x`` (M, in) with the kernels; ``codes``: the rows'
    :func:`layer_codes` when a sibling projection already computed them."""
    codes, scale, sums = codes if codes is not None else layer_codes(x, layer)
    return matmul_codes(codes, scale, sums, layer.packed, layer.row_scale(), layer.bias, x.dtype,
                        layer.out_features, layer.in_features, config)
