"""The compressed linear layer: :class:`CompressedLinear` replaces each ``nn.Linear`` of a block; it holds no
weight, only (block, slot) in its block's pack, and reads the decoded weight from ``model.neuzip``
(:class:`~thrifty.neuzip.state.CompressedWeights`).

:class:`_CompressedLinearFn` keeps the input, not the weight: backward decodes the block again. It computes the
input gradient and the weight gradient with the same matrix products as autograd's ``F.linear`` (so a plain
model and a lossless compressed one give the same bits) and hands the weight gradient to the fused optimizer
(:mod:`thrifty.optim.lomo`) at once, through ``CompressedWeights.apply_update``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class _CompressedLinearFn(torch.autograd.Function):
    """y = x Wᵀ + b with W decoded from the block pack; backward decodes W again (it is never saved)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, module):
        ctx.module = module
        ctx.save_for_backward(x)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        m = ctx.module
        state = m.state
        w = state.weight(m.block, m.slot)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            # the products autograd runs for F.linear (x flattened to 2-D): same bits as a plain nn.Linear
            grad_x = g2.mm(w if w.dtype == g2.dtype else w.to(g2.dtype))
            grad_x = grad_x.view(*grad.shape[:-1], w.shape[1])
        if state.optimizer is not None:
            # autograd's mm backward for the column-major W.t(): (gᵀx), no transposes of the result
            grad_w = g2.t().mm(x.reshape(-1, x.shape[-1]))
            state.apply_update(m.block, m.slot, grad_w)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, None, grad_b, None


class CompressedLinear(nn.Module):
    """An ``nn.Linear`` whose weight lives in its block's NeuZip pack (slot ``slot`` of block ``block``)."""

    def __init__(self, in_features: int, out_features: int, bias: Optional[nn.Parameter], state, block: int,
                 slot: int, name: str):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias
        self.block, self.slot, self.name = block, slot, name
        self.__dict__["state"] = state  # a plain attribute, not a submodule

    @property
    def weight(self) -> torch.Tensor:
        """The decoded weight (a view into the block buffer, valid until another block is decoded into it)."""
        return self.state.weight(self.block, self.slot)

    def forward(self, x):
        w = self.state.weight(self.block, self.slot)
        if torch.is_grad_enabled() and (x.requires_grad or self.state.optimizer is not None):
            return _CompressedLinearFn.apply(x, w, self.bias, self)
        return F.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, slot={self.slot}"
