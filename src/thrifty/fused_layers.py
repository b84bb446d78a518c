"""One-launch RMSNorm and RoPE for the reference model's inference calls (no autograd).

Why: written in plain PyTorch, an RMSNorm is ~8 kernels (cast, square, mean, add, rsqrt, two products, cast) and
a RoPE ~8 (negate, concatenate, two casts, two products, add, cast). A decode step of a 32-layer model runs ~45
kernels per layer, most of them these, and on the GPU each costs ~2 µs whatever its size (bitnet NOTES, "Decode
of the whole 7B-shaped model"). These kernels do the same fp32 arithmetic in one launch each. They have no
backward: ``layers.RMSNorm`` and ``models.llama.RotaryEmbedding`` call them only on CUDA with gradients off,
and the PyTorch forms stay the spec, the CPU path and the training path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, W, Y, D, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    """One row: y = w * cast(x * rsqrt(mean(x^2) + eps)) in fp32, the cast to x's dtype as the PyTorch form."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    x_in = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=inside, other=0.0)
    x = x_in.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * rstd).to(x_in.dtype).to(tl.float32)
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(Y + row.to(tl.int64) * stride_y + cols, (w * normed).to(Y.dtype.element_ty), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype)`` over the last dimension, in
    the dtype PyTorch's product would give (``torch.result_type(weight, x)``)."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"weight: expected shape ({D},) for rows of {D}, got {tuple(weight.shape)}")
    rows = x.reshape(-1, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(D)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, D, rows.stride(0), out.stride(0), float(eps),
                                           BLOCK=block, num_warps=4 if block <= 4096 else 8)
    return out.view(*x.shape[:-1], D)


@triton.jit
def _rope_kernel(X, COS, SIN, Y, H, T, sx_b, sx_h, sx_t, sc_b, sc_t, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """One (batch, head, position) row of rotate-half RoPE: y = x*cos + rotate_half(x)*sin in fp32, cast back.
    The two products are rounded before the sum, as in the PyTorch form (no fused multiply-add)."""
    pid = tl.program_id(0)
    t = pid % T
    h = (pid // T) % H
    b = pid // (T * H)
    j = tl.arange(0, BLOCK)
    inside = j < HALF
    x_row = X + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h + t.to(tl.int64) * sx_t
    c_row = b.to(tl.int64) * sc_b + t.to(tl.int64) * sc_t
    x1_in = tl.load(x_row + j, mask=inside, other=0.0)
    x1 = x1_in.to(tl.float32)
    x2 = tl.load(x_row + HALF + j, mask=inside, other=0.0).to(tl.float32)
    c1 = tl.load(COS + c_row + j, mask=inside, other=0.0)
    c2 = tl.load(COS + c_row + HALF + j, mask=inside, other=0.0)
    s1 = tl.load(SIN + c_row + j, mask=inside, other=0.0)
    s2 = tl.load(SIN + c_row + HALF + j, mask=inside, other=0.0)
    y_row = Y + pid.to(tl.int64) * (2 * HALF)
    lo = tl.fma(-x2, s1, 0.0)  # a product rounded on its own: keeps the compiler from fusing it into the add
    hi = tl.fma(x1, s2, 0.0)
    tl.store(y_row + j, (tl.fma(x1, c1, 0.0) + lo).to(x1_in.dtype), mask=inside)
    tl.store(y_row + HALF + j, (tl.fma(x2, c2, 0.0) + hi).to(x1_in.dtype), mask=inside)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x (B, H, T, Dh), any strides with a unit last one, with fp32 ``cos``/``sin`` of
    shape (T, Dh) or (B, T, Dh); returns a contiguous (B, H, T, Dh) tensor in x's dtype."""
    B, H, T, Dh = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.shape != sin.shape:
        raise ValueError(f"cos, sin: expected two fp32 tensors of one shape, got {cos.dtype} {tuple(cos.shape)} "
                         f"and {sin.dtype} {tuple(sin.shape)}")
    if cos.shape[-2:] != (T, Dh) or cos.ndim not in (2, 3) or (cos.ndim == 3 and cos.shape[0] != B):
        raise ValueError(f"cos: expected shape ({T}, {Dh}) or ({B}, {T}, {Dh}), got {tuple(cos.shape)}")
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(B, H, T, Dh, dtype=x.dtype, device=x.device)
    if out.numel():
        half = Dh // 2
        sc_b = cos.stride(0) if cos.ndim == 3 else 0
        _rope_kernel[(B * H * T,)](x, cos, sin, out, H, T, x.stride(0), x.stride(1), x.stride(2), sc_b,
                                   cos.stride(-2), HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1)
    return out


__all__ = ["rms_norm", "rope"]
