"""Sibling projections as one packed matrix: ``stack_projections(model)`` stacks the rows of q/k/v (and of
gate/up) into one :class:`PackedBitLinear` and turns each sibling into a :class:`ProjectionSlice` of its output.

Why: at decode time a packed GEMV is latency-bound (5–10× its byte floor at one token, NOTES.md), so three
launches over 4096×4096, 1024×4096, 1024×4096 cost more than one over the stacked 6144×4096; per Llama layer 7
matmul launches become 4. The result is the same bit for bit: each sibling keeps its α (the stacked layer's
``splits``), the activation is quantized once per token either way, and the integer dot products and the fp32
epilogue of a row do not depend on which other rows share its launch.

Inference only, in memory (like :func:`~thrifty.bitnet.pack`): the stacked layer is registered on the parent
module (``qkv_proj`` / ``gate_up_proj``); ``export`` writes each sibling as its own layer (``q_proj``, ...), so the
file is the one the unstacked model gives and loads into a model built unstacked.

In the reference model's decoder blocks the RMSNorm in front of a stacked INT8 projection (``input_layernorm``
before q/k/v, ``post_attention_layernorm`` before gate/up) becomes a :class:`CodesRMSNorm`: its launch also writes
the activation codes the projection would otherwise make with a second launch (the codes kernel, which the
1-token v3 decode GEMV and the GEMM read).
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch
import torch.nn as nn

from ..layers import RMSNorm
from .bitlinear import SharedInput
from .packed import PackedBitLinear

SIBLINGS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# decoder block attribute of the norm in front of a stacked projection, and of the module holding that projection
NORM_BEFORE = {"qkv_proj": ("input_layernorm", "self_attn"), "gate_up_proj": ("post_attention_layernorm", "mlp")}


class _StackedOutput:
    """The stacked layer's output for the current input, computed by the first sibling that asks and dropped once
    every sibling has read it (no activation outlives its forward)."""

    def __init__(self, layer: PackedBitLinear, members: int):
        self.layer, self.members = layer, members
        self._entry: Optional[list] = None  # [x, x._version, y, reads left]

    def read(self, x: torch.Tensor) -> torch.Tensor:
        e = self._entry
        if e is None or e[0] is not x or e[1] != x._version:
            e = self._entry = [x, x._version, self.layer(x), self.members]
        y = e[2]
        e[3] -= 1
        if e[3] <= 0:
            self._entry = None
        return y


class ProjectionSlice(nn.Module):
    """One sibling's rows ``[start, end)`` of a stacked projection's output (a view: a last-dim slice)."""

    def __init__(self, stacked: _StackedOutput, start: int, end: int, in_features: int):
        super().__init__()
        self.__dict__["stacked"] = stacked  # not a submodule: the parent holds the stacked layer once
        self.start, self.end = start, end
        self.in_features, self.out_features = in_features, end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stacked.read(x)[..., self.start: self.end]

    def extra_repr(self) -> str:
        return f"rows [{self.start}, {self.end}) of the stacked projection"

    @property
    def stacked_layer(self) -> PackedBitLinear:
        return self.stacked.layer

    def unstacked(self) -> PackedBitLinear:
        """This sibling as its own PackedBitLinear (its rows' codes, α and bias): what ``export`` writes."""
        layer = self.stacked.layer
        bounds = [0, *itertools.accumulate(layer.splits)]
        first, last = bounds.index(self.start), bounds.index(self.end)  # siblings' splits were concatenated
        own = PackedBitLinear(self.in_features, self.out_features, activation=layer.activation,
                              beta_scale=layer.beta_scale, topk_ratio=layer.topk_ratio,
                              splits=layer.splits[first:last], bias=layer.bias is not None, impl=layer.impl,
                              device=layer.packed.device)
        with torch.no_grad():
            own.packed.copy_(layer.packed[self.start: self.end])
            own.alpha.copy_(layer.alpha[first:last])
            if layer.bias is not None:
                own.bias.copy_(layer.bias[self.start: self.end])
        return own


class CodesRMSNorm(RMSNorm):
    """The RMSNorm in front of a stacked INT8 projection: where the projection would quantize the norm's output with
    the codes kernel (its decode GEMV and GEMM read ready codes), the norm's one launch writes the codes too
    (``packed_kernel.norm_codes``: y is the plain fused norm's bit for bit, the codes the codes kernel's) and hands
    them to the projection through its ``shared_input``. Elsewhere (autograd, the CPU's PyTorch form) it is the
    plain norm. INT8 only: INT4's mean would be summed
    in another order than the codes kernel's, so a code could move at an exact half and the stacked model would
    no longer be the unstacked one bit for bit."""

    def __init__(self, norm: RMSNorm, consumer: PackedBitLinear):
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = norm.weight  # the same parameter: state dict and any tying unchanged
        self.__dict__["consumer"] = consumer  # not a submodule: its parent module holds it
        self.slot = SharedInput(2)  # stored by the norm, taken once by the projection
        consumer.shared_input = self.slot

    def _writes_codes(self, x: torch.Tensor) -> bool:
        c = self.consumer
        return self._fused(x) and x.shape[-1] == c.in_features and c._use_kernels(x)

    def _hand_over(self, y: torch.Tensor, codes) -> torch.Tensor:
        self.slot.store(y, self.consumer.codes_key(True), codes, "packed")
        return y

    def forward(self, x):
        if not self._writes_codes(x):
            return super().forward(x)
        from .packed_kernel import norm_codes

        y, codes = norm_codes(x, self.weight, self.eps, "int8", beta_scale=self.consumer.beta_scale)
        return self._hand_over(y, codes)

    def add_and_norm(self, x, residual):
        if not (self._writes_codes(x) and residual.dtype == x.dtype and residual.shape == x.shape):
            return super().add_and_norm(x, residual)
        from .packed_kernel import norm_codes

        total, y, codes = norm_codes(x, self.weight, self.eps, "int8", beta_scale=self.consumer.beta_scale,
                                     residual=residual)
        return total, self._hand_over(y, codes)


def _norms_write_codes(model: nn.Module) -> None:
    """Every decoder block's plain RMSNorm in front of a stacked INT8 projection becomes a :class:`CodesRMSNorm`."""
    for block in list(model.modules()):
        for fused_name, (norm_name, holder_name) in NORM_BEFORE.items():
            norm = getattr(block, norm_name, None)
            consumer = getattr(getattr(block, holder_name, None), fused_name, None)
            if type(norm) is RMSNorm and isinstance(consumer, PackedBitLinear) and consumer.activation == "int8":
                setattr(block, norm_name, CodesRMSNorm(norm, consumer))


def stack_layers(layers: list) -> PackedBitLinear:
    """One PackedBitLinear whose rows are ``layers``' stacked in order (same input width, recipe settings, impl
    and device; no sub-norm, since each sibling would norm the same input again; all or none with a bias)."""
    first = layers[0]
    settings = lambda m: (m.in_features, m.activation, m.beta_scale, m.topk_ratio, m.impl,  # noqa: E731
                          m.packed.device, m.bias is not None)
    if any(not isinstance(m, PackedBitLinear) for m in layers):
        raise TypeError("layers: expected PackedBitLinear layers (call thrifty.bitnet.pack first)")
    if any(settings(m) != settings(first) for m in layers) or any(m.norm is not None for m in layers):
        raise ValueError("layers: siblings differ in input width, activation settings, impl, device or bias, or "
                         "have a sub-norm; they cannot share one launch")
    out = sum(m.out_features for m in layers)
    splits = [s for m in layers for s in m.splits]
    stacked = PackedBitLinear(first.in_features, out, activation=first.activation, beta_scale=first.beta_scale,
                              topk_ratio=first.topk_ratio, splits=splits, bias=first.bias is not None,
                              impl=first.impl, device=first.packed.device)
    with torch.no_grad():
        stacked.packed.copy_(torch.cat([m.packed for m in layers]))
        stacked.alpha.copy_(torch.cat([m.alpha for m in layers]))
        if first.bias is not None:
            stacked.bias.copy_(torch.cat([m.bias for m in layers]))
    return stacked


def stack_projections(model: nn.Module) -> int:
    """In place: every module holding packed q/k/v (or gate/up) siblings gets one stacked layer for them
    (``qkv_proj`` / ``gate_up_proj``) and the siblings become :class:`ProjectionSlice` views of its output; a
    decoder block's norm in front of a stacked INT8 projection becomes a :class:`CodesRMSNorm`. Returns how many
    groups were stacked; ValueError when there is none."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    groups = 0
    for parent in list(model.modules()):
        for fused_name, names in SIBLINGS.items():
            layers = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, PackedBitLinear) for m in layers) or hasattr(parent, fused_name):
                continue
            stacked = stack_layers(layers)
            output = _StackedOutput(stacked, len(layers))
            parent.add_module(fused_name, stacked)
            start = 0
            for name, layer in zip(names, layers):
                setattr(parent, name, ProjectionSlice(output, start, start + layer.out_features, layer.in_features))
                start += layer.out_features
            groups += 1
    if not groups:
        raise ValueError("model: no packed q/k/v or gate/up siblings found (call thrifty.bitnet.pack first)")
    _norms_write_codes(model)
    return groups


__all__ = ["stack_projections", "ProjectionSlice", "stack_layers", "CodesRMSNorm"]
