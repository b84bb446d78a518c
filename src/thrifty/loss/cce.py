"""Public entry points: ``linear_cross_entropy`` (dispatch), the Triton autograd function, an ``nn.Module`` and
the model's loss seam ``lm_loss(hidden, weight, labels)``."""

from __future__ import annotations

from typing import Optional

import torch

from .._checks import check_impl
from ..triton_utils import interpreting, kernels_available
from . import _spec, reference

EXTRA_IMPLS = ("torch",)  # beyond the library's IMPLS: the naive PyTorch loss (all logits), a test oracle


class _TritonLinearCE(torch.autograd.Function):
    """Per-token fp32 losses of the valid rows; backward runs the filtered, vocabulary-sorted kernels."""

    @staticmethod
    def forward(ctx, e2d, c, bias, rows, targets, softcap, label_smoothing, z_loss, opts):
        from .forward import lse_forward, lse_forward_gemm

        opts = dict(opts)
        forward_config = opts.pop("forward_config")
        # needs_input_grad says requires_grad even under torch.no_grad(); the dispatch recorded the grad mode
        need_c = opts.pop("grad_enabled") and (ctx.needs_input_grad[1] or ctx.needs_input_grad[2])
        # dC is allocated here when the GEMM forward can use its bytes as scratch, and handed to the backward
        ctx.dc = _gemm_forward_scratch(c, rows.numel()) if need_c and forward_config is None else None
        if ctx.dc is not None:
            lse, z_t, z_sum = lse_forward_gemm(e2d, c, bias, rows, targets, softcap, ctx.dc)
        else:
            lse, z_t, z_sum = lse_forward(e2d, c, bias, rows, targets, softcap, config=forward_config)
        ctx.save_for_backward(e2d, c, bias, rows, targets, lse)
        ctx.opts = (softcap, label_smoothing, z_loss, opts)
        return _spec.token_loss(lse, z_t, z_sum, c.shape[0], label_smoothing, z_loss)

    @staticmethod
    def backward(ctx, grad_losses):
        from .backward import linear_ce_backward

        e2d, c, bias, rows, targets, lse = ctx.saved_tensors
        softcap, ls, z_loss, opts = ctx.opts
        dc_buffer, ctx.dc = ctx.dc, None
        de, dc, db = linear_ce_backward(
            e2d, c, bias, rows, targets, lse, grad_losses.float().contiguous(), softcap=softcap,
            label_smoothing=ls, z_loss=z_loss, need_e=ctx.needs_input_grad[0],
            need_c=ctx.needs_input_grad[1] or ctx.needs_input_grad[2], dc=dc_buffer, **opts)
        return de, (dc if ctx.needs_input_grad[1] else None), db, None, None, None, None, None, None


def _gemm_forward_scratch(c, nv):
    """The dC buffer (uninitialised, c's shape) when the GEMM forward pays at this hidden size and fits its
    chunks in it, else None."""
    from .forward import gemm_chunk_cols, gemm_min_cols, gemm_min_d

    V, D = c.shape
    cols = gemm_chunk_cols(c.numel() * c.element_size(), nv, V)
    if nv == 0 or D < gemm_min_d(interpreting()) or not (cols == V or cols >= gemm_min_cols(interpreting())):
        return None
    return torch.empty_like(c, memory_format=torch.contiguous_format)


def _torch_impl(e, c, targets, bias, ignore_index, reduction, softcap, shift, label_smoothing, z_loss):
    """Plain linear + F.cross_entropy (all N x V logits), same conventions; the baseline."""
    return reference.naive_linear_cross_entropy(
        e, c, targets, bias=bias, ignore_index=ignore_index, reduction=reduction, softcap=softcap, shift=shift,
        label_smoothing=label_smoothing, z_loss=z_loss)


def linear_cross_entropy(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    softcap: Optional[float] = None,
    shift: bool = False,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    impl: str = "auto",
    filter_eps=None,
    sort_vocab: bool = True,
    chunk_bytes: Optional[int] = None,
    e_grad_fp32: bool = True,
    scratch_in_dc: bool = True,
    kernel_config: Optional[dict] = None,
) -> torch.Tensor:
    """Cross-entropy of the logits ``e @ c.T (+ bias)`` against ``targets``, never holding all the logits.

    Arguments follow ``torch.nn.functional.linear_cross_entropy(input, linear_weight, target)`` positionally;
    ``bias`` is its ``linear_bias``. e: (..., D) float; c: (V, D), same dtype; targets: (...) int in [0, V) or
    ``ignore_index``. ``shift=True``: e[..., t] predicts targets[..., t+1] (causal LM; no copy of e).
    ``softcap``: logits become softcap*tanh(logits/softcap). ``z_loss``: adds z_loss*lse**2 per token.
    Under autocast, e, c and bias are cast to the autocast dtype first (fp32 master weights work).
    Returns fp32: the mean over valid tokens (0 if there are none, unlike torch's NaN), the sum, or
    (reduction="none") e's leading shape with 0 at ignored positions. NaN in e propagates to a NaN loss.

    impl: "auto" (Triton kernels on CUDA, the chunked reference elsewhere), "triton" (CUDA, or the CPU only
    under TRITON_INTERPRET=1), "reference" (chunked PyTorch), "torch" (naive, all logits).
    Kernel options: ``filter_eps`` (None, the default: exact gradients; "auto" = eps(dtype)/32 as apple CCE, or a
    number: gradient tiles whose every |element| is below it are skipped -- faster on flat softmaxes, but it
    drops the small push-down gradient of rarely-seen tokens; pre-training a 30M model from scratch with "auto"
    was 0.09-0.13 nats worse over the first 50 steps, NOTES.md; ignored with label smoothing),
    ``sort_vocab`` (with filtering: cluster the tokens that matter), ``scratch_in_dc`` (default True: the
    gradient tiles and the fp32 dE accumulator live in the rows of dC not yet written, so the backward needs
    only one small extra buffer; not with a sorted vocabulary), ``chunk_bytes`` (that extra gradient-tile
    buffer: default 8 MiB with ``scratch_in_dc`` -- 12 MiB where dE + dC < ~0.9 GiB --, else 64 MiB), ``e_grad_fp32`` (accumulate dE in fp32 -- in
    dC's free rows while they hold it, then in place; a separate Nv x D fp32 scratch without ``scratch_in_dc``;
    False accumulates in e's dtype throughout),
    ``kernel_config`` ({"forward": {...}, "backward": {...}} block sizes, see forward_config/backward_config;
    "dense_above": kept-tile fraction above which a vocabulary chunk's dE/dC GEMMs go to cuBLAS, default 0.3).
    """
    check_impl(impl, EXTRA_IMPLS)
    e, c, bias = _spec.autocast_inputs(e, c, bias)
    _spec.validate(e, c, targets, bias, ignore_index, reduction, softcap, shift, label_smoothing, z_loss)
    with torch.autocast(e.device.type, enabled=False):  # fp32 statistics stay fp32 inside
        return _dispatch(e, c, targets, bias, ignore_index, reduction, softcap, shift, label_smoothing, z_loss,
                         impl, filter_eps, sort_vocab, chunk_bytes, e_grad_fp32, scratch_in_dc, kernel_config)


def _dispatch(e, c, targets, bias, ignore_index, reduction, softcap, shift, label_smoothing, z_loss, impl,
              filter_eps, sort_vocab, chunk_bytes, e_grad_fp32, scratch_in_dc, kernel_config):
    if impl == "auto":
        impl = "triton" if e.device.type == "cuda" and kernels_available(e.device) else "reference"
    if impl == "reference":
        return reference.linear_cross_entropy(
            e, c, targets, bias=bias, ignore_index=ignore_index, reduction=reduction, softcap=softcap, shift=shift,
            label_smoothing=label_smoothing, z_loss=z_loss)
    if impl == "torch":
        return _torch_impl(e, c, targets, bias, ignore_index, reduction, softcap, shift, label_smoothing, z_loss)
    if not kernels_available(e.device):
        hint = "" if e.device.type != "cpu" else " (on the CPU set TRITON_INTERPRET=1 before importing thrifty)"
        raise ValueError(f"impl='triton': Triton kernels cannot run on {e.device}{hint}; use impl='reference'")
    if e.dtype == torch.float64:
        raise TypeError("e: impl='triton' supports float16, bfloat16 and float32; use impl='reference' for float64")
    prep = _spec.prepare(e, c, targets, ignore_index, shift)
    e2d = prep.e2d if prep.e2d.stride(1) == 1 else prep.e2d.contiguous()
    if filter_eps == "auto":
        from .backward import default_filter_eps

        filter_eps = default_filter_eps(e.dtype)
    kernel_config = kernel_config or {}
    if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0):
        raise ValueError(f"chunk_bytes: expected a positive int or None, got {chunk_bytes!r}")
    opts = dict(filter_eps=filter_eps, sort_vocab=sort_vocab, chunk_bytes=chunk_bytes, e_grad_fp32=e_grad_fp32,
                scratch_in_dc=bool(scratch_in_dc),
                config=kernel_config.get("backward"), forward_config=kernel_config.get("forward"),
                dense_above=kernel_config.get("dense_above", 0.3), grad_enabled=torch.is_grad_enabled())
    losses = _TritonLinearCE.apply(
        e2d, c.contiguous(), None if bias is None else bias.contiguous(), prep.rows, prep.targets, softcap,
        float(label_smoothing), float(z_loss), opts)
    return _spec.reduce(losses, prep, reduction, torch.float32)


class LinearCrossEntropy(torch.nn.Module):
    """Module form: ``LinearCrossEntropy(reduction=..., ...)(e, c, targets, bias=None)``."""

    def __init__(self, *, ignore_index: int = -100, reduction: str = "mean", softcap: Optional[float] = None,
                 shift: bool = False, label_smoothing: float = 0.0, z_loss: float = 0.0, impl: str = "auto", **kernel_opts):
        super().__init__()
        _spec.validate_options(ignore_index, reduction, softcap, shift, label_smoothing, z_loss)
        check_impl(impl, EXTRA_IMPLS)
        self.kw = dict(ignore_index=ignore_index, reduction=reduction, softcap=softcap, shift=shift,
                       label_smoothing=label_smoothing, z_loss=z_loss, impl=impl, **kernel_opts)

    def forward(self, e, c, targets, bias=None):
        return linear_cross_entropy(e, c, targets, bias=bias, **self.kw)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.kw.items())


def lm_loss(hidden_states: torch.Tensor, classifier_weight: torch.Tensor, labels: torch.Tensor, **kw) -> torch.Tensor:
    """The model's loss seam: hidden (B, T, D), classifier (V, D), labels (B, T) already aligned with the hidden
    positions (no shift), -100 ignored; returns the scalar mean. ``kw`` goes to :func:`linear_cross_entropy`."""
    kw.setdefault("ignore_index", -100)
    return linear_cross_entropy(hidden_states, classifier_weight, labels, **kw)


__all__ = ["linear_cross_entropy", "LinearCrossEntropy", "lm_loss", "interpreting"]
