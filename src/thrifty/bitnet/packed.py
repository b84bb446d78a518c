"""PackedBitLinear: a trained BitLinear for inference, ternary weights packed 2 bits each (``pack.py``).

``y = ((Σ_k q_x[m, k]·t[n, k]) · s_x[m]) · α[n] (+ b[n])``: the integer dot of the activation codes (INT8 or
INT4-range per token, TopK+INT8, as the layer's recipe says) and the ternary codes, then the per-token activation
scale and the per-(sub-)matrix weight scale in fp32. The codes and scales are those of the training quantizers
(``reference.py``): ``q_x·s_x`` and ``α·t`` are the training forward's quantized operands bit for bit, and the
integer dot is exact, so the packed layer differs from ``BitLinear.forward`` only in where fp32 rounds.

Two paths, same values: PyTorch (any device; the oracle) and the Triton kernels (``packed_kernel.py``: CUDA, or
the CPU under ``TRITON_INTERPRET=1``). The kernel path's output equals the PyTorch path's bit for bit for INT8 and
TopK inputs; for INT4 the per-token mean is summed in another order, so a code may move at an exact half.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn as nn

from .._checks import check_choice, check_impl, check_positive_int, check_range, check_tensor
from ..layers import RMSNorm
from ..triton_utils import kernels_available
from . import reference as ref
from .bitlinear import BitLinear, SharedInput
from .pack import GROUP, pack_ternary, padded_k, unpack_ternary

PACKABLE = ("int8", "int4", "topk_int8")  # activations with integer codes; FP4 has no integer path
PADDING_BYTE = 0x55  # four code-1 fields: four zero weights


def ternary_codes(w: torch.Tensor, splits: Optional[Sequence[int]] = None):
    """(int8 codes −1/0/+1 of ``w``, fp32 α per sub-matrix): ``α·codes`` is ``reference.quantize_weight_ternary(w)``
    bit for bit (the same expressions, in the same order)."""
    wf = w.detach().float()
    parts = wf.split(list(splits), dim=0) if splits else (wf,)
    codes, alphas = [], []
    for part in parts:
        alpha = part.abs().mean()
        codes.append(ref.round_clip(part * (1.0 / (alpha + ref.EPS)), -1, 1).to(torch.int8))
        alphas.append(alpha)
    return torch.cat(codes, dim=0), torch.stack(alphas)


def activation_codes(x: torch.Tensor, kind: str, *, beta_scale: float = 1.0, topk_ratio: float = 0.5):
    """(int8 codes (M, D), fp32 scale (M,)) of the per-token quantizer ``kind`` on rows ``x`` (M, D):
    ``codes·scale`` is the reference quantizer's output in fp32 bit for bit. A token holding NaN or ±inf gets
    zero codes and a NaN scale (its output is NaN, as in training)."""
    check_choice("kind", kind, PACKABLE)
    xf = x.float()
    if kind == "topk_int8":
        xf = torch.where(ref.topk_mask(x, topk_ratio), xf, torch.zeros_like(xf))
    if kind == "int4":
        beta = xf.abs().mean(dim=-1, keepdim=True) * beta_scale
        q = ref.round_clip(xf * (ref.SQRT7 / (beta + ref.EPS)), -8, 7)
        scale = ref.divide(beta, ref.SQRT7)
    else:
        gamma = xf.abs().amax(dim=-1, keepdim=True)
        q = ref.round_clip(xf * (127.0 / (gamma + ref.EPS)), -128, 127)
        scale = ref.divide(gamma, 127.0)
    bad = (~torch.isfinite(x)).any(dim=-1, keepdim=True)
    codes = torch.where(bad, torch.zeros_like(q), q).to(torch.int8)
    return codes, torch.where(bad, torch.full_like(scale, float("nan")), scale).squeeze(-1)


def integer_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int64 ``a @ bᵀ`` of small-integer matrices (|values| ≤ 128) on any device: fp32 while every partial sum
    stays below 2^24 (all exactly representable, whatever the summation order), float64 beyond."""
    dtype = torch.float32 if a.shape[-1] * 128 < 2 ** 24 else torch.float64
    return (a.to(dtype) @ b.to(dtype).T).to(torch.int64)


def check_layer_packable(layer, name: str = "layer") -> None:
    """Refuses a layer that does not pack to its own outputs, with ``name`` leading the message: TypeError for
    anything but a :class:`BitLinear`, ValueError for an activation without integer codes (FP4) or a layer not
    fully switched to ternary (strength below 1)."""
    if not isinstance(layer, BitLinear):
        raise TypeError(f"{name}: expected a BitLinear, got {type(layer).__name__}")
    if layer.activation not in PACKABLE:
        raise ValueError(f"{name}: activation {layer.activation!r} has no integer packed path (expected one of "
                         f"{list(PACKABLE)}; recipe 'a4.8-fp4' quantizes to 'fp4')")
    if layer.strength != 1.0:
        raise ValueError(f"{name}: strength is {layer.strength}; only a fully converted layer (strength 1.0, "
                         "thrifty.bitnet.set_strength) packs to the same outputs")


class PackedBitLinear(nn.Module):
    """Inference twin of a trained :class:`BitLinear`: 2-bit packed ternary weights (``packed``, uint8), one fp32 α
    per sub-matrix (``alpha``), the sub-norm and bias if the layer had them; the activation is quantized on the fly
    by the layer's recipe. ``impl``: "auto" (Triton kernels on CUDA, PyTorch elsewhere), "reference" or "triton"
    (also on the CPU under TRITON_INTERPRET=1). Build it with :meth:`from_bitlinear`."""

    def __init__(self, in_features: int, out_features: int, *, activation: str = "int8", beta_scale: float = 1.0,
                 topk_ratio: float = 0.5, splits: Optional[Sequence[int]] = None, bias: bool = False,
                 sub_norm: bool = False, norm_eps: float = 1e-5, impl: str = "auto", device=None):
        super().__init__()
        check_positive_int("in_features", in_features)
        check_positive_int("out_features", out_features)
        check_choice("activation", activation, PACKABLE)
        check_range("beta_scale", beta_scale, 0.0, 1e3, lo_open=True)
        check_range("topk_ratio", topk_ratio, 0.0, 1.0, lo_open=True)
        splits = tuple(int(s) for s in splits) if splits else (out_features,)
        if sum(splits) != out_features or min(splits) < 1:
            raise ValueError(f"splits: expected positive sizes adding up to out_features={out_features}, got "
                             f"{list(splits)}")
        self.in_features, self.out_features = in_features, out_features
        self.activation, self.beta_scale, self.topk_ratio = activation, float(beta_scale), float(topk_ratio)
        self.splits = splits
        self.impl = check_impl(impl)
        n_bytes = padded_k(in_features) // 4
        self.register_buffer("packed", torch.full((out_features, n_bytes), PADDING_BYTE, dtype=torch.uint8,
                                                  device=device))
        self.register_buffer("alpha", torch.zeros(len(splits), dtype=torch.float32, device=device))
        # scales and bias stay fp32 whatever the default dtype (the epilogue computes in fp32)
        self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32, device=device) if bias else None)
        self.norm = RMSNorm(in_features, norm_eps).to(device) if sub_norm else None
        self.last_path: Optional[str] = None
        self.shared_input: Optional[SharedInput] = None  # siblings reading the same input (no sub-norm): q/k/v
        self._glu_handover = SharedInput(2)  # codes made by the GLU in front (glu_input), taken once by forward

    @classmethod
    def from_bitlinear(cls, layer: BitLinear, *, impl: str = "auto") -> "PackedBitLinear":
        """Packs ``layer``'s ternary weight (its training quantizer's codes and α) and copies its settings."""
        check_layer_packable(layer)
        new = cls(layer.in_features, layer.out_features, activation=layer.activation, beta_scale=layer.beta_scale,
                  topk_ratio=layer.topk_ratio, splits=layer.weight_splits, bias=layer.bias is not None,
                  sub_norm=layer.norm is not None, norm_eps=layer.norm.eps if layer.norm is not None else 1e-5,
                  impl=impl, device=layer.weight.device)
        codes, alpha = ternary_codes(layer.weight, layer.weight_splits)
        with torch.no_grad():
            new.packed.copy_(pack_ternary(codes))
            new.alpha.copy_(alpha)
            if layer.bias is not None:
                new.bias.copy_(layer.bias.detach().float())
            if layer.norm is not None:
                new.norm.weight.copy_(layer.norm.weight.detach())
        return new

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, activation={self.activation!r}, "
                f"sub_norm={self.norm is not None}, packed={tuple(self.packed.shape)} uint8")

    # ------------------------------------------------------------------------------------------------ parts

    def ternary(self) -> torch.Tensor:
        """int8 (out, in) ternary codes (unpacked)."""
        return unpack_ternary(self.packed, self.in_features)

    def row_scale(self) -> torch.Tensor:
        """fp32 (out,) weight scale of every output row (α of its sub-matrix). Cached until ``alpha`` changes: a
        decode step must not copy the split sizes to the GPU (a synchronous host-to-device copy) per layer."""
        key = (self.alpha.data_ptr(), self.alpha._version, self.alpha.device)
        cached = getattr(self, "_row_scale", None)
        if cached is None or cached[0] != key:
            sizes = torch.tensor(self.splits, device=self.alpha.device)
            cached = (key, self.alpha.repeat_interleave(sizes, output_size=self.out_features))
            self._row_scale = cached
        return cached[1]

    def quantize_input(self, x: torch.Tensor):
        """(int8 codes (M, in), fp32 scales (M,)) of the (sub-normed) rows of ``x`` (PyTorch path)."""
        rows = x.reshape(-1, self.in_features)
        if self.norm is not None:
            rows = self.norm(rows).to(rows.dtype)  # BitLinear's sub-norm: RMSNorm(x).to(x.dtype)
        return activation_codes(rows, self.activation, beta_scale=self.beta_scale, topk_ratio=self.topk_ratio)

    # ------------------------------------------------------------------------------------------------ forward

    def _use_kernels(self, x: torch.Tensor) -> bool:
        if self.impl == "reference":
            return False
        if self.impl == "triton":
            if not kernels_available(x.device):
                raise ValueError(f"impl: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU), got "
                                 f"{x.device}")
            return True
        return x.is_cuda and kernels_available(x.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x, min_ndim=1, floating=True)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: expected {self.in_features} features in the last dimension, got shape "
                             f"{tuple(x.shape)}")
        if x.device != self.packed.device:
            raise ValueError(f"x: expected a tensor on {self.packed.device}, got {x.device}")
        kernels = self._use_kernels(x)
        if kernels:
            from . import packed_kernel

            self.last_path = "triton"
            rows = x.reshape(-1, self.in_features)
            y = packed_kernel.packed_linear(rows, self, codes=self._input_codes(x, kernels))
            return y.view(*x.shape[:-1], self.out_features)
        self.last_path = "reference"
        y = self._forward_torch(x, self._input_codes(x, kernels))
        return y.view(*x.shape[:-1], self.out_features)

    def glu_input(self, gate: torch.Tensor, up: torch.Tensor, kind: str) -> Optional[torch.Tensor]:
        """The GLU output this layer reads, ``act(gate) * up`` (``kind`` as ``fused_layers.glu``), with this layer's
        activation codes made in the GLU's launch (``packed_kernel.glu_codes``; ``forward`` then takes them) where
        the kernels would quantize that output in a launch of its own: no autograd, the kernel path, an INT8 /
        INT4-range layer on the whole-row codes kernel (``packed_kernel.glu_takes_codes``: a decode step's 1 row).
        None elsewhere: the caller runs its own GLU. The reference model's MLP asks its down projection."""
        if torch.is_grad_enabled() or gate.shape[-1] != self.in_features or not self._use_kernels(gate):
            return None
        from . import packed_kernel

        if not packed_kernel.glu_takes_codes(self, gate.numel() // self.in_features):
            return None
        y, codes = packed_kernel.glu_codes(gate, up, kind, self)
        self._glu_handover.store(y, self.codes_key(True), codes, "packed")
        return y

    def codes_key(self, kernels: bool) -> tuple:
        """What quantized input this layer can reuse from ``shared_input``: the path's codes, its quantizer settings."""
        return ("packed", kernels, self.activation, self.beta_scale, self.topk_ratio)

    def _input_codes(self, x: torch.Tensor, kernels: bool):
        """The quantized input, computed once for sibling projections reading the same tensor (q/k/v, gate/up:
        ``shared_input``, set by :func:`thrifty.bitnet.pack` / ``packed_factory``; or written by the norm in front
        of a stacked projection, ``stacked.CodesRMSNorm``): fewer launches per layer."""
        shared = self.shared_input
        key = self.codes_key(kernels)
        hit = self._glu_handover.lookup(x, key) or (shared.lookup(x, key) if shared is not None else None)
        if hit is not None:
            return hit[0]
        if kernels:
            from . import packed_kernel

            codes = packed_kernel.layer_codes(x.reshape(-1, self.in_features), self)
        else:
            codes = self.quantize_input(x)
        if shared is not None:
            shared.store(x, key, codes, "packed")
        return codes

    def _forward_torch(self, x: torch.Tensor, codes=None) -> torch.Tensor:
        codes, scale = codes if codes is not None else self.quantize_input(x)
        acc = integer_matmul(codes, self.ternary())
        y = (acc.float() * scale[:, None]) * self.row_scale()[None, :]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


def packed_weight_bytes(layer: PackedBitLinear) -> int:
    """Bytes a forward reads for the weight: the packed codes and the fp32 scales."""
    return layer.packed.numel() + 4 * layer.alpha.numel()


assert GROUP % 16 == 0 and math.log2(GROUP).is_integer()  # kernels read a group as whole int32 words
