"""Plain layers shared by the reference model and the techniques that rebuild its layers (BitNet's sub-norms).
They live below both so that neither package imports the other for them."""

from __future__ import annotations

import torch
import torch.nn as nn

# The attention seam's contract for static caches (``thrifty.kv.StaticKVCache``): keys handed out with this
# attribute set hold empty slots, and the attribute is a boolean mask broadcastable to (B, H, Tq, Tk), True
# where a key exists. Seams that honour it carry ``reads_key_mask = True``. It lives here, below the reference
# model, the KV-cache family and the attention package, which all read it.
KEY_MASK_ATTR = "_thrifty_key_mask"


def fused_inference(x: torch.Tensor) -> bool:
    """Where the reference model's layers take ``thrifty.fused_layers``: inference (no autograd: the kernels have
    no backward) on the GPU. The PyTorch forms stay the spec, the CPU path and the training path."""
    return x.is_cuda and not torch.is_grad_enabled()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def _fused(self, x) -> bool:
        """Inference on the GPU with a plain weight: one Triton launch instead of ~8 PyTorch ops (no autograd)."""
        return fused_inference(x) and type(self.weight.data) is torch.Tensor

    def add_and_norm(self, x, residual):
        """(x + residual, this norm of it): the residual add and the norm in one launch where ``_fused``."""
        if self._fused(x) and residual.dtype == x.dtype and residual.shape == x.shape:
            from .fused_layers import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps)
        total = x + residual
        return total, self(total)

    def forward(self, x):
        if self._fused(x):
            from .fused_layers import rms_norm

            return rms_norm(x, self.weight, self.eps)
        # normalize in fp32 like HF, then cast back before the scale
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
