"""The LOMO AdamW update of one parameter in one Triton launch (the GPU path of :mod:`thrifty.optim.lomo`).

Why: the torch-op update makes ~10 fp32 passes over each parameter (bf16 states) and ~40 with 8-bit states
(dequantize: gather + scale; requantize: abs, amax, divide, log2, round, clamp, where, cast; each pass a launch
and a fp32 temporary). Measured on the H200 at 1.07B parameters (commit a305afd): 8-bit states cost 215 ms per
step over bf16 states. Here each element is read once and written once: weight + gradient + states in, weight +
states out, ~10 B/param with 8-bit states (~2.5 ms per step at 1.07B on 4 TB/s), ~12 B with bf16 states.

Two kernels:

* ``_adamw_kernel``: states stored as float32 or bfloat16 (any float dtype), a 1-D tile of ``BLOCK`` values;
* ``_adamw8_kernel``: 8-bit states (:mod:`thrifty.optim.state8`), a 2-D tile of ``ROWS`` state blocks of
  ``QBLOCK`` values each: codes dequantized by the same float32 table as state8 (exact), updated, and
  requantized with the block's new absmax in the same pass.

The math is the torch path's, in float32, in the same order (decay, lerp, v·b2 + (1-b2)·g², sqrt(v)/sqrt(bc2)
+ eps, w + step·m/denom, one rounding to the weight dtype). The bits can still differ from the torch ops in the
last fp32 place (the compilers contract a·b + c into FMAs differently; the GPU's log2 is an approximation), so
the tests bound the difference: weights within one ulp of their dtype, float32 states within 4 ulp, bf16 states
one ulp, 8-bit codes within one level. Lossless NeuZip training stays bit-identical on the GPU because the plain
model and the compressed one run this same kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import FastLauncher
from . import state8

BLOCK = 1024  # values per program, float states (4 warps: 8 values per thread)
TILE8 = 1024  # values per program, 8-bit states (whole state blocks; one block when a block is larger)
# read inside the kernels: the compiler accepts module globals only as constexprs
SIGNED_TOP = tl.constexpr(state8.SIGNED_LEVELS)
UNSIGNED_TOP = tl.constexpr(state8.UNSIGNED_LEVELS)


@triton.jit
def _adam_math(w, g, m, v, decay_mul, lerp_w, lerp_small, b2, one_minus_b2, sqrt_bc2, eps, step_size,
               HAS_DECAY: tl.constexpr):
    """(w, m, v) after one AdamW step, float32; the torch path's order of operations."""
    if HAS_DECAY:
        w = w * decay_mul
    d = g - m
    m = tl.where(lerp_small != 0.0, m + lerp_w * d, g - d * (1.0 - lerp_w))  # torch.lerp's two forms
    v = v * b2 + one_minus_b2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), sqrt_bc2) + eps
    w = w + step_size * tl.div_rn(m, denom)  # IEEE division, as torch
    return w, m, v


@triton.jit
def _store_rounded(ptr, x, mask):
    """Stores float32 ``x`` in the pointer's dtype, rounded to nearest even. bfloat16 by integer arithmetic
    (torch's own rounding): the interpreter's float->bf16 cast truncates, or rounds half up without carrying
    into the exponent, so a kernel tested there would not show the GPU's bits."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)  # NaN stays a (quiet) NaN
        tl.store(ptr, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_kernel(w_ptr, g_ptr, m_ptr, v_ptr, n, decay_mul, lerp_w, lerp_small, b2, one_minus_b2, sqrt_bc2,
                  eps, step_size, HAS_DECAY: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    w, m, v = _adam_math(w, g, m, v, decay_mul, lerp_w, lerp_small, b2, one_minus_b2, sqrt_bc2, eps, step_size,
                         HAS_DECAY)
    _store_rounded(w_ptr + offs, w, ok)
    _store_rounded(m_ptr + offs, m, ok)
    _store_rounded(v_ptr + offs, v, ok)


@triton.jit
def _code_level(x, per_octave, TOP: tl.constexpr, SIGNED: tl.constexpr):
    """(level j as float32, block scale) of rows of x: state8.quantize_into's arithmetic, per row of the tile."""
    mag = tl.abs(x)
    absmax = tl.max(mag, axis=1)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0  # tl.max drops NaNs; state8's amax propagates them
    scale = tl.where(has_nan, float("nan"), absmax)
    den = tl.where(has_nan | (absmax <= 0), 1.0, absmax)  # state8: where(absmax > 0, absmax, 1), NaN > 0 false
    u = tl.div_rn(mag, den[:, None])
    pos = u > 0
    t = tl.log2(tl.where(pos, u, 1.0)) * per_octave + TOP  # log2 of 1 (not of 0): no -inf, no warning
    j = tl.floor(t + 0.5)
    j = tl.where(pos, j, 0.0)  # state8: log2(0) = -inf -> 0
    j = tl.where(u == u, j, 0.0)  # NaN -> 0
    j = tl.minimum(tl.maximum(j, 0.0), TOP)
    if SIGNED:
        j = tl.where(j < 1, 0.0, j)  # under half a step below the smallest level: 0
    else:
        j = tl.where(pos, tl.maximum(j, 1.0), 0.0)  # a positive v keeps the smallest level (never 0)
    return j, scale


@triton.jit
def _adamw8_kernel(w_ptr, g_ptr, mq_ptr, vq_ptr, ms_ptr, vs_ptr, mt_ptr, vt_ptr, n, decay_mul, lerp_w, lerp_small,
                   b2, one_minus_b2, sqrt_bc2, eps, step_size, m_per_octave, v_per_octave,
                   HAS_DECAY: tl.constexpr, QBLOCK: tl.constexpr, ROWS: tl.constexpr):
    """One program = ROWS state blocks of QBLOCK values: codes + scales in, weight + codes + scales out."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    ok = offs < n
    row_ok = rows * QBLOCK < n
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    mq = tl.load(mq_ptr + offs, mask=ok, other=0).to(tl.int32)
    vq = tl.load(vq_ptr + offs, mask=ok, other=0).to(tl.int32)
    mag = tl.load(mt_ptr + tl.abs(mq))  # state8's float32 table: the same values as its dequantize
    m = tl.where(mq < 0, -mag, mag) * tl.load(ms_ptr + rows, mask=row_ok, other=0.0)[:, None]
    v = tl.load(vt_ptr + vq) * tl.load(vs_ptr + rows, mask=row_ok, other=0.0)[:, None]
    w, m, v = _adam_math(w, g, m, v, decay_mul, lerp_w, lerp_small, b2, one_minus_b2, sqrt_bc2, eps, step_size,
                         HAS_DECAY)
    _store_rounded(w_ptr + offs, w, ok)
    jm, sm = _code_level(m, m_per_octave, SIGNED_TOP, True)
    jv, sv = _code_level(v, v_per_octave, UNSIGNED_TOP, False)
    tl.store(mq_ptr + offs, tl.where(m < 0, -jm, jm).to(tl.int8), mask=ok)
    tl.store(vq_ptr + offs, jv.to(tl.uint8), mask=ok)
    tl.store(ms_ptr + rows, sm, mask=row_ok)
    tl.store(vs_ptr + rows, sv, mask=row_ok)


_LAUNCH = FastLauncher(_adamw_kernel)
_LAUNCH8 = FastLauncher(_adamw8_kernel)


def tile8(state_block: int) -> tuple[int, int]:
    """(state blocks per program, warps) of the 8-bit kernel: TILE8 values (or one larger block), ~8 a thread."""
    rows = max(1, TILE8 // state_block)
    return rows, max(4, min(16, rows * state_block // 256))


def adamw_update(weight: torch.Tensor, grad: torch.Tensor, state: dict, *, lr: float, betas: tuple, eps: float,
                 decay: float, step: int, state_block: int) -> None:
    """One AdamW step of ``weight`` (contiguous, in place) with ``grad``; ``state``: the FusedOptimizer's dict
    (float states ``exp_avg``/``exp_avg_sq`` shaped like the weight, or 8-bit codes + ``*_scale``), updated in
    place. ``step`` counts from 1 (bias correction)."""
    n = weight.numel()
    if n == 0:
        return
    b1, b2 = betas
    lerp_w = 1.0 - b1
    # lerp_small as a float: Triton would turn an int 1 into a constexpr (another compiled variant)
    scalars = (1.0 - lr * decay, lerp_w, float(abs(lerp_w) < 0.5), b2, 1.0 - b2, (1.0 - b2 ** step) ** 0.5, eps,
               -lr / (1.0 - b1 ** step))
    g = grad.reshape(-1) if grad.is_contiguous() else grad.contiguous().reshape(-1)
    w = weight.view(-1)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if m.dtype != torch.int8:
        _LAUNCH((triton.cdiv(n, BLOCK),), w, g, m.view(-1), v.view(-1), n, *scalars, HAS_DECAY=decay != 0.0,
                BLOCK=BLOCK, num_warps=4, num_stages=1)
        return
    rows, warps = tile8(state_block)
    tables = (state8._table(True, w.device), state8._table(False, w.device))
    _LAUNCH8((triton.cdiv(state8.num_blocks(n, state_block), rows),), w, g, m, v, state["exp_avg_scale"],
             state["exp_avg_sq_scale"], *tables, n, *scalars, state8._per_octave(True), state8._per_octave(False),
             HAS_DECAY=decay != 0.0, QBLOCK=state_block, ROWS=rows, num_warps=warps, num_stages=1)


__all__ = ["adamw_update", "tile8", "BLOCK", "TILE8"]
