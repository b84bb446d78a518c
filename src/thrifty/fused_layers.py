"""One-launch RMSNorm (alone or after the residual add), GLU activation and RoPE for the reference model's
inference calls (no autograd).

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


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as (rows, last dim) with a unit column stride (a view where it can be): what the kernels index."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _check_norm_weight(weight: torch.Tensor, D: int) -> None:
    if weight.shape != (D,):
        raise ValueError(f"weight: expected shape ({D},) for rows of {D}, got {tuple(weight.shape)}")


def _norm_launch(D: int) -> dict:
    block = triton.next_power_of_2(D)  # one program holds a whole row
    return dict(BLOCK=block, num_warps=4 if block <= 4096 else 8)


@triton.jit
def _store_rms_norm(x_in, W, Y_row, cols, inside, D, eps):
    """y = w * cast(x * rsqrt(mean(x^2) + eps)) of one loaded row ``x_in``, in fp32, the cast to x's dtype as the
    PyTorch form; returns the stored row (the packed BitNet layers quantize it in the same launch)."""
    x = x_in.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * rstd).to(x_in.dtype).to(tl.float32)
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    y = (w * normed).to(Y_row.dtype.element_ty)
    tl.store(Y_row + cols, y, mask=inside)
    return y


@triton.jit
def _rms_norm_kernel(X, W, Y, D, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    x_in = tl.load(X + row * stride_x + cols, mask=inside, other=0.0)
    _store_rms_norm(x_in, W, Y + row * stride_y, cols, inside, D, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype)`` over the last dimension, in
    the dtype PyTorch's product would give (``torch.result_type(weight, x)``)."""
    D = x.shape[-1]
    _check_norm_weight(weight, D)
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, D, rows.stride(0), out.stride(0), float(eps),
                                           **_norm_launch(D))
    return out.view(*x.shape[:-1], D)


@triton.jit
def _store_add(X_row, R_row, S_row, cols, inside):
    """s = x + r of one row, rounded to x's dtype (as the PyTorch sum), stored and returned."""
    x_in = tl.load(X_row + cols, mask=inside, other=0.0)
    r = tl.load(R_row + cols, mask=inside, other=0.0).to(tl.float32)
    s_in = (x_in.to(tl.float32) + r).to(x_in.dtype)
    tl.store(S_row + cols, s_in, mask=inside)
    return s_in


@triton.jit
def _add_rms_norm_kernel(X, R, W, S, Y, D, stride_x, stride_r, stride_s, stride_y, eps, BLOCK: tl.constexpr):
    """One row: s = x + r (rounded to x's dtype, as the PyTorch sum), then y = rms_norm(s)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    s_in = _store_add(X + row * stride_x, R + row * stride_r, S + row * stride_s, cols, inside)
    _store_rms_norm(s_in, W, Y + row * stride_y, cols, inside, D, eps)


def _check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual: expected {x.dtype} of shape {tuple(x.shape)}, got {residual.dtype} "
                         f"{tuple(residual.shape)}")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + residual, rms_norm(x + residual, weight, eps)) in one launch; the sum in x's dtype."""
    D = x.shape[-1]
    _check_residual(x, residual)
    _check_norm_weight(weight, D)
    rows, res = _rows(x), _rows(residual)
    total = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
    if rows.shape[0]:
        _add_rms_norm_kernel[(rows.shape[0],)](rows, res, weight, total, out, D, rows.stride(0), res.stride(0),
                                               total.stride(0), out.stride(0), float(eps), **_norm_launch(D))
    return total.view(x.shape), out.view(*x.shape[:-1], D)


@triton.jit
def _glu_values(G_row, U_row, cols, inside, RELU2: tl.constexpr):
    """act(gate) * up at ``cols`` of one row, in the gate's dtype: the activation rounded to the dtype, then the
    product, as the PyTorch form's two ops. RELU2: relu(g)^2 (BitNet's ReLU²GLU), else SiLU."""
    g_in = tl.load(G_row + cols, mask=inside, other=0.0)
    g = g_in.to(tl.float32)
    if RELU2:
        r = tl.maximum(g, 0.0)
        a = r * r
    else:
        a = g / (1.0 + tl.exp(-g))
    a = a.to(g_in.dtype).to(tl.float32)
    u = tl.load(U_row + cols, mask=inside, other=0.0).to(tl.float32)
    return (a * u).to(g_in.dtype)


@triton.jit
def _glu_kernel(G, U, Y, F, stride_g, stride_u, RELU2: tl.constexpr, BLOCK: tl.constexpr):
    """act(gate) * up for one block of one row (``_glu_values``)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < F
    y = _glu_values(G + row * stride_g, U + row * stride_u, cols, inside, RELU2)
    tl.store(Y + row * F + cols, y, mask=inside)


GLU_KINDS = ("silu", "relu2")


def check_glu(gate: torch.Tensor, up: torch.Tensor, kind: str) -> None:
    if kind not in GLU_KINDS:
        raise ValueError(f"kind: expected one of {GLU_KINDS}, got {kind!r}")
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"up: expected {gate.dtype} of shape {tuple(gate.shape)}, got {up.dtype} {tuple(up.shape)}")


def glu(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    """``act(gate) * up`` (kind "silu": F.silu; "relu2": relu(gate)**2) in one launch; rows may be strided
    views (the halves of a stacked gate/up output)."""
    check_glu(gate, up, kind)
    F = gate.shape[-1]
    g, u = _rows(gate), _rows(up)
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    if g.shape[0]:
        block = min(triton.next_power_of_2(F), 2048)
        _glu_kernel[(g.shape[0], triton.cdiv(F, block))](g, u, out, F, g.stride(0), u.stride(0),
                                                          RELU2=kind == "relu2", BLOCK=block, num_warps=4)
    return out.view(gate.shape)


@triton.jit
def _rope_row(x_row, c_row, COS, SIN, j, inside, HALF: tl.constexpr):
    """One row of rotate-half RoPE in fp32: (first half, second half) of x*cos + rotate_half(x)*sin, each product
    rounded on its own before the sum as in the PyTorch form (no fused multiply-add), and x's loaded dtype."""
    x1_in = tl.load(x_row + j, mask=inside, other=0.0)
    x1 = x1_in.to(tl.float32)
    x2 = tl.load(x_row + HALF + j, mask=inside, other=0.0).to(tl.float32)
    c1 = tl.load(COS + c_row + j, mask=inside, other=0.0)
    c2 = tl.load(COS + c_row + HALF + j, mask=inside, other=0.0)
    s1 = tl.load(SIN + c_row + j, mask=inside, other=0.0)
    s2 = tl.load(SIN + c_row + HALF + j, mask=inside, other=0.0)
    lo = tl.fma(-x2, s1, 0.0)  # a product rounded on its own: keeps the compiler from fusing it into the add
    hi = tl.fma(x1, s2, 0.0)
    return (tl.fma(x1, c1, 0.0) + lo).to(x1_in.dtype), (tl.fma(x2, c2, 0.0) + hi).to(x1_in.dtype)


@triton.jit
def _rope_kernel(X, COS, SIN, Y, H, T, sx_b, sx_h, sx_t, sc_b, sc_t, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """One (batch, head, position) row of rotate-half RoPE: y = x*cos + rotate_half(x)*sin in fp32, cast back."""
    pid = tl.program_id(0)
    t = pid % T
    h = (pid // T) % H
    b = pid // (T * H)
    j = tl.arange(0, BLOCK)
    inside = j < HALF
    x_row = X + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h + t.to(tl.int64) * sx_t
    c_row = b.to(tl.int64) * sc_b + t.to(tl.int64) * sc_t
    y1, y2 = _rope_row(x_row, c_row, COS, SIN, j, inside, HALF)
    y_row = Y + pid.to(tl.int64) * (2 * HALF)
    tl.store(y_row + j, y1, mask=inside)
    tl.store(y_row + HALF + j, y2, mask=inside)


@triton.jit
def _rope_qk_into_cache_kernel(Q, K, V, COS, SIN, POS, QO, KB, VB, HQ, HK, T, CAP,
                               sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                               skb_b, skb_h, skb_t, svb_b, svb_h, svb_t,
                               HALF: tl.constexpr, BLOCK: tl.constexpr):
    """One (batch, head, position) row: the first HQ heads rotate a query row into QO (contiguous); the next HK
    rotate a key row into the key buffer at its position and copy the value row into the value buffer there.
    Positions outside [0, CAP) write nothing (the callers check capacity on the host first)."""
    pid = tl.program_id(0)
    t = pid % T
    h = (pid // T) % (HQ + HK)
    b = pid // (T * (HQ + HK))
    j = tl.arange(0, BLOCK)
    inside = j < HALF
    c_row = t.to(tl.int64) * (2 * HALF)
    if h < HQ:
        x_row = Q + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h + t.to(tl.int64) * sq_t
        y1, y2 = _rope_row(x_row, c_row, COS, SIN, j, inside, HALF)
        y_row = QO + ((b.to(tl.int64) * HQ + h) * T + t) * (2 * HALF)
        tl.store(y_row + j, y1, mask=inside)
        tl.store(y_row + HALF + j, y2, mask=inside)
    else:
        hk = (h - HQ).to(tl.int64)
        pos = tl.load(POS + t).to(tl.int64)
        keep = inside & (pos >= 0) & (pos < CAP)
        x_row = K + b.to(tl.int64) * sk_b + hk * sk_h + t.to(tl.int64) * sk_t
        y1, y2 = _rope_row(x_row, c_row, COS, SIN, j, inside, HALF)
        kb_row = KB + b.to(tl.int64) * skb_b + hk * skb_h + pos * skb_t
        tl.store(kb_row + j, y1.to(KB.dtype.element_ty), mask=keep)
        tl.store(kb_row + HALF + j, y2.to(KB.dtype.element_ty), mask=keep)
        v_row = V + b.to(tl.int64) * sv_b + hk * sv_h + t.to(tl.int64) * sv_t
        vb_row = VB + b.to(tl.int64) * svb_b + hk * svb_h + pos * svb_t
        v1 = tl.load(v_row + j, mask=inside, other=0.0)
        v2 = tl.load(v_row + HALF + j, mask=inside, other=0.0)
        tl.store(vb_row + j, v1.to(VB.dtype.element_ty), mask=keep)
        tl.store(vb_row + HALF + j, v2.to(VB.dtype.element_ty), mask=keep)


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


def rope_qk_into_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One launch for a decode step's RoPE and cache write: returns ``rope(q, cos, sin)`` and writes
    ``rope(k, cos, sin)`` and ``v`` into ``keys`` / ``values`` (B, Hkv, capacity, Dh) at ``positions`` (T,), as
    ``keys.index_copy_(2, positions, rope(k).to(keys.dtype))`` (and ``values`` with v) would, bit for bit.
    q (B, Hq, T, Dh), k and v (B, Hkv, T, Dh): any strides with a unit last one (views of a stacked projection);
    ``cos``/``sin`` fp32 (T, Dh). Why: ``thrifty.kv.StaticKVCache`` in a graphed decode step otherwise runs four
    launches per layer here (two RoPEs, two copies), each ~1–2 µs of a step that is a few hundred launches."""
    B, HQ, T, Dh = q.shape
    HK = k.shape[1]
    if k.shape != (B, HK, T, Dh) or v.shape != k.shape:
        raise ValueError(f"k, v: expected two tensors of shape (B={B}, Hkv, T={T}, Dh={Dh}), got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k, v: expected q's dtype {q.dtype}, got {k.dtype} and {v.dtype}")
    if Dh % 2:
        raise ValueError(f"q: expected an even head_dim for rotate-half RoPE, got {Dh}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.shape != (T, Dh) or sin.shape != (T, Dh):
        raise ValueError(f"cos, sin: expected two fp32 tensors of shape ({T}, {Dh}), got {cos.dtype} "
                         f"{tuple(cos.shape)} and {sin.dtype} {tuple(sin.shape)}")
    if keys.ndim != 4 or keys.shape[:2] != (B, HK) or keys.shape[3] != Dh or values.shape != keys.shape:
        raise ValueError(f"keys, values: expected two buffers of shape ({B}, {HK}, capacity, {Dh}), got "
                         f"{tuple(keys.shape)} and {tuple(values.shape)}")
    if positions.shape != (T,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions: expected integer positions of shape ({T},), got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("keys, values: expected buffers with a unit last stride")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(B, HQ, T, Dh, dtype=q.dtype, device=q.device)
    if B * T:
        half = Dh // 2
        _rope_qk_into_cache_kernel[(B * (HQ + HK) * T,)](
            q, k, v, cos, sin, positions, out, keys, values, HQ, HK, T, keys.shape[2],
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2),
            HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1)
    return out


__all__ = ["rms_norm", "add_rms_norm", "glu", "GLU_KINDS", "rope", "rope_qk_into_cache"]
