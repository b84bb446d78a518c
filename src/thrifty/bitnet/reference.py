"""BitNet a4.8 quantizers in plain PyTorch: the spec, the CPU path and the oracle of the Triton kernels.

Formulas of arXiv 2411.04965 (BitNet a4.8) and 2402.17764 (b1.58), with RoundClip(x, a, b) = min(max(round(x), a), b)
and ``round`` half-to-even (``torch.round``; the kernels round the same way):

* weights, absmean ternary per tensor (per original sub-matrix of a fused projection):
  ``α = mean|W|``, ``Q_w(W) = α · RoundClip(W / (α + ε), −1, 1)``
* INT8 activations, per-token absmax: ``γ = max|x|``, ``Q(x) = (γ / 127) · RoundClip(127 x / (γ + ε), −128, 127)``
* INT4 activations, per-token absmean: ``β = mean|x|``, ``Q(x) = (β / √7) · RoundClip(√7 x / (β + ε), −8, 7)``
  (``beta_scale`` multiplies β: the paper's all-INT4 ablation uses β = 2·mean|x| for the FFN-down input)
* FP4 E2M1, per-token MinMax: ``γ = max|x|``, ``s = γ / 6``, ``Q(x) = s · RoundE2M1(6·x / (γ + ε))`` on the grid
  {0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6} (round to nearest, ties to the even mantissa, as hardware converts)
* TopK + INT8 (attention-output input, Eq. 1): keep the ``k = ceil(ratio · D)`` largest ``|x|`` of each token
  (among entries tied at the k-th value, the lowest indices), zero the rest, then INT8 of the kept values.

Every quantizer is applied with the straight-through estimator: forward ``Q(x)``, backward the identity (also
through the TopK mask, as Q-Sparse and the a4.8 paper do). The arithmetic is fp32 whatever the input dtype (the
result is cast back), and the scale is applied as ``x · (q_max / (stat + ε))`` — the order the kernels use, so the
two agree bit for bit under the interpreter. An all-zero token quantizes to zeros (ε keeps the division finite);
NaN or ±inf in a token makes that token all NaN (its scale is undefined). Tokens of zero features (D = 0) give the
empty result. The arithmetic being fp32, a float32 token holding values within a few ulp of the largest float may
overflow: INT4's mean|x| becomes inf (the token comes out NaN), and the rescale ``q · (γ/127)`` may round to ±inf.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

EPS = 1e-5
SQRT7 = math.sqrt(7.0)
ACTIVATIONS = ("int8", "int4", "fp4", "topk_int8", "none")


def round_clip(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """RoundClip(x, lo, hi) = min(max(round(x), lo), hi); clipping first is the same for integer bounds."""
    return torch.round(torch.clamp(x, lo, hi))


def divide(t: torch.Tensor, c: float) -> torch.Tensor:
    """``t / c`` rounded once, on every device. Why not ``t / c``: PyTorch's CUDA kernel multiplies by the reciprocal
    of a Python-number divisor (two roundings), so γ/127 came out one ulp off for ~6% of tokens on the H200 while the
    CPU and the Triton quantizers divide; a 0-dim tensor divisor takes the dividing kernel."""
    return t / torch.full((), c, dtype=t.dtype, device=t.device)


def _nan_rows(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A token holding a NaN or an infinity comes out all NaN (clamp would otherwise hide it in the rounded codes)."""
    bad = (~torch.isfinite(x)).any(dim=-1, keepdim=True)
    return torch.where(bad, torch.full_like(y, float("nan")), y)


def quantize_weight_ternary(w: torch.Tensor, splits: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Absmean ternary fake-quantization of a (out, in) weight; ``splits`` partitions the output rows of a
    fused projection (e.g. q, k, v sizes) so that each original sub-matrix keeps its own α."""
    wf = w.float()
    parts = wf.split(list(splits), dim=0) if splits else (wf,)
    out = []
    for part in parts:
        alpha = part.abs().mean()
        out.append(alpha * round_clip(part * (1.0 / (alpha + EPS)), -1, 1))
    return (out[0] if len(out) == 1 else torch.cat(out, dim=0)).to(w.dtype)


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """Per-token absmax INT8 fake-quantization (last dimension = features)."""
    if x.shape[-1] == 0:  # no features: nothing to reduce (amax of an empty row has no value)
        return x.clone()
    xf = x.float()
    gamma = xf.abs().amax(dim=-1, keepdim=True)
    q = round_clip(xf * (127.0 / (gamma + EPS)), -128, 127)
    return _nan_rows(xf, q * divide(gamma, 127.0)).to(x.dtype)


def quantize_int4(x: torch.Tensor, beta_scale: float = 1.0) -> torch.Tensor:
    """Per-token absmean INT4 fake-quantization: (β/√7)·RoundClip(√7·x/(β+ε), −8, 7), β = beta_scale·mean|x|."""
    xf = x.float()
    beta = xf.abs().mean(dim=-1, keepdim=True) * beta_scale
    q = round_clip(xf * (SQRT7 / (beta + EPS)), -8, 7)
    return (q * divide(beta, SQRT7)).to(x.dtype)


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest FP4 E2M1 value (ties to even mantissa), magnitudes clipped to 6. Steps are 0.5 below 2, 1 in
    [2, 4) and 2 in [4, 6]; ``torch.round`` (half to even) on the scaled value gives the even-mantissa tie."""
    a = v.abs().clamp(max=6.0)
    r = torch.where(a < 2.0, torch.round(a * 2.0) * 0.5,
                    torch.where(a < 4.0, torch.round(a), torch.round(a * 0.5) * 2.0))
    return torch.copysign(r, v)


def quantize_fp4(x: torch.Tensor) -> torch.Tensor:
    """Per-token MinMax FP4 (E2M1) fake-quantization: the token's max|x| maps to the largest code, 6."""
    if x.shape[-1] == 0:
        return x.clone()
    xf = x.float()
    gamma = xf.abs().amax(dim=-1, keepdim=True)
    q = round_e2m1(xf * (6.0 / (gamma + EPS)))
    return _nan_rows(xf, q * divide(gamma, 6.0)).to(x.dtype)


def topk_count(dim: int, ratio: float) -> int:
    """How many entries of a token TopK keeps: ceil(ratio · dim), at least 1."""
    return max(1, math.ceil(ratio * dim - 1e-9))


def topk_mask(x: torch.Tensor, ratio: float = 0.5) -> torch.Tensor:
    """Boolean mask of exactly k = ceil(ratio·D) entries per token: those with |x| above the k-th largest |x|,
    then the entries equal to it in index order until k are kept (ties do happen: GQA heads sharing a KV head
    give identical attention outputs at the first position)."""
    k = topk_count(x.shape[-1], ratio)
    mag = x.float().abs()
    threshold = mag.topk(k, dim=-1).values[..., -1:]
    above = mag > threshold
    tied = mag == threshold
    room = k - above.sum(-1, keepdim=True)
    return above | (tied & (tied.cumsum(-1) <= room))


def quantize_topk_int8(x: torch.Tensor, ratio: float = 0.5) -> torch.Tensor:
    """TopK sparsification per token, then per-token absmax INT8 of what is kept (a4.8 Eq. 1)."""
    if x.shape[-1] == 0:
        return x.clone()
    kept = quantize_int8(torch.where(topk_mask(x, ratio), x, torch.zeros_like(x)))
    return _nan_rows(x.float(), kept.float()).to(x.dtype)


def quantize_activation(x: torch.Tensor, kind: str, *, beta_scale: float = 1.0, topk_ratio: float = 0.5):
    """The forward value of activation quantizer ``kind`` (one of :data:`ACTIVATIONS`)."""
    if kind == "int8":
        return quantize_int8(x)
    if kind == "int4":
        return quantize_int4(x, beta_scale)
    if kind == "fp4":
        return quantize_fp4(x)
    if kind == "topk_int8":
        return quantize_topk_int8(x, topk_ratio)
    if kind == "none":
        return x
    raise ValueError(f"activation: expected one of {list(ACTIVATIONS)}, got {kind!r}")


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, q):
        return q

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def ste(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Straight-through estimator: exactly the value of ``q`` (no ``x + (q - x)`` rounding), the gradient of the
    identity with respect to ``x``."""
    return _StraightThrough.apply(x, q.detach())


def bitlinear_reference(x, weight, *, activation: str, bias=None, norm_weight=None, norm_eps: float = 1e-5,
                        weight_splits=None, beta_scale: float = 1.0, topk_ratio: float = 0.5):
    """The BitLinear forward as explicit float math (tests compare the module to this):
    ``y = Q_a(RMSNorm(x)) · Q_w(W)ᵀ + b`` with STE on both quantizers."""
    if norm_weight is not None:
        xf = x.float()
        x = (norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps)).to(x.dtype))
    xq = ste(x, quantize_activation(x, activation, beta_scale=beta_scale, topk_ratio=topk_ratio))
    wq = ste(weight, quantize_weight_ternary(weight, weight_splits))
    return torch.nn.functional.linear(xq, wq, bias)
