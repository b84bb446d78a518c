"""Public entry points: ``linear_cross_entropy`` (dispatch) and its ``CCEKernelConfig``, the Triton autograd
function, an ``nn.Module`` and the model's loss seam ``lm_loss(hidden, weight, labels)``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .._checks import check_bool, check_choice, check_config as _check_config, check_impl
from ..triton_utils import interpreting, kernels_available
from . import _spec, reference

EXTRA_IMPLS = ("torch",)  # beyond the library's IMPLS: the naive PyTorch loss (all logits), a test oracle


@dataclass(frozen=True)
class CCEKernelConfig:
    """What the Triton kernels may trade for speed (``impl="triton"``, or ``"auto"`` on CUDA); the defaults are
    exact gradients near the memory bound dE + dC. The reference and torch paths ignore it: they are exact and
    keep their own chunking. Figures: loss+grad, bf16, 8192 tokens, H100 (NOTES.md, v6 and v7 tables).

    filter_eps: None (default): exact gradients. "auto": gradient tiles whose every |element| is below
        eps(dtype)/32 (apple CCE's threshold) are skipped, after sorting the vocabulary by mean logit so that
        the skipped tiles cluster; a positive number: that threshold instead. Faster where softmaxes are flat
        (random 256k logits: 54.9 vs 74.5 ms), slower where they are peaky (realistic 256k: 78.4 vs 73.5 ms, every
        tile kept), and it drops the small push-down gradient of rarely-seen tokens: pre-training a 30M model
        from scratch was 0.085-0.13 nats worse over the first 50 steps. The sorted vocabulary needs a separate
        64 MiB tile buffer (peak +156-173 MiB over the bound at 256k). Off under label smoothing (it puts -ls/V
        on every element).
    scratch_in_dc: True (default): the gradient tiles and the fp32 dE accumulator live in the rows of dC not
        yet written, so the backward needs one 8-12 MiB extra buffer. From ~V/8 tokens per call only the
        accumulator's right half fits there (its left half lives in dE's own bytes); from ~V/4 that half is a
        separate Nv x D/2 fp32 buffer (+9 MiB at 8192 tokens, D=576, V=49152). False: a
        separate 64 MiB tile buffer and an Nv x D fp32 dE accumulator (peak over the bound +136 MiB at 256k,
        +82 MiB at D=576 V=49152), for fewer, larger vocabulary chunks: 4.47 vs 5.37 ms at SmolLM2's D=576
        V=49152, 61.6 vs 65.6 ms at 128k, 71.8 vs 73.5 ms at 256k. For small vocabularies when memory does not
        matter.
    forward: "auto" (default): the Gluon Hopper LSE kernel (``gluon_tile.lse_forward_gluon``: one persistent
        warp-specialized pass over the whole vocabulary, no scratch) where it applies (sm_90 GPU, bf16 inputs, no
        bias, its partial buffer within the classifier's size), else the "gemm" rule. "gemm": training calls at
        large hidden sizes take the GEMM forward (cuBLAS logits chunks in dC's bytes, then a row pass: 69.4 vs
        72.7 ms at 256k, N=8192, H200, v8), the rest the fused kernel (the rule before the Gluon forward).
        "fused": the fused kernel always (the backward then allocates dC itself). ``benchmarks/cce.py`` times
        the three in one run (``thrifty_gemm_fwd`` and ``thrifty_fused_fwd`` rows), the data behind
        ``forward.gemm_min_d`` / ``gemm_min_cols`` and the Gluon route.
    tiles: "auto" (default): the backward's gradient tiles come from the Gluon Hopper kernel
        (``gluon_tile.py``) where it applies (sm_90 GPU, bf16 inputs, no bias, no filtering), else from the Triton
        tile kernel. "triton": the Triton tile kernel always; ``benchmarks/cce.py`` times both in one run
        (``thrifty_triton_tiles`` rows).
    """

    filter_eps: Union[float, str, None] = None
    scratch_in_dc: bool = True
    forward: str = "auto"
    tiles: str = "auto"

    def __post_init__(self):
        eps = self.filter_eps
        if isinstance(eps, str):
            if eps != "auto":
                raise ValueError(f"filter_eps: expected None, 'auto' or a positive number, got {eps!r}")
        elif eps is not None:
            if isinstance(eps, bool) or not isinstance(eps, (int, float)):
                raise TypeError(f"filter_eps: expected None, 'auto' or a positive number, got {type(eps).__name__}")
            if not (math.isfinite(eps) and eps > 0):
                raise ValueError(f"filter_eps: expected None, 'auto' or a positive finite number, got {eps}")
        check_bool("scratch_in_dc", self.scratch_in_dc)
        check_choice("forward", self.forward, ("auto", "gemm", "fused"))
        check_choice("tiles", self.tiles, ("auto", "triton"))

    def filter_threshold(self, dtype: torch.dtype) -> Optional[float]:
        """The tile-skip threshold for inputs of ``dtype`` (None: exact)."""
        if self.filter_eps == "auto":
            from .backward import default_filter_eps

            return default_filter_eps(dtype)
        return None if self.filter_eps is None else float(self.filter_eps)


DEFAULT_CONFIG = CCEKernelConfig()


# thrifty.CCEConfig is optimize()'s, easily passed here by mistake
_LOOKALIKE = ("CCEConfig", "its z_loss, label_smoothing and softcap are arguments of linear_cross_entropy")


def check_config(config) -> CCEKernelConfig:
    """``config`` or the defaults; a TypeError naming ``config`` for anything else."""
    return _check_config(config, CCEKernelConfig, DEFAULT_CONFIG, "thrifty.loss.CCEKernelConfig", _LOOKALIKE)


class _TritonLinearCE(torch.autograd.Function):
    """Per-token fp32 losses of the valid rows; backward runs the chunked gradient-tile kernels."""

    @staticmethod
    def forward(ctx, e2d, c, bias, rows, targets, softcap, label_smoothing, z_loss, config, grad_enabled):
        from .forward import lse_forward, lse_forward_gemm
        from .gluon_tile import lse_forward_gluon

        # needs_input_grad says requires_grad even under torch.no_grad(); the dispatch recorded the grad mode
        need_c = grad_enabled and (ctx.needs_input_grad[1] or ctx.needs_input_grad[2])
        ctx.dc = None
        if _gluon_forward(e2d, c, bias, rows.numel(), config):
            # no scratch: the backward allocates dC itself when it starts, as on the fused route; the peak
            # (dE + dC + the tile buffers, in the backward) is the GEMM route's
            lse, z_t, z_sum = lse_forward_gluon(e2d, c, rows, targets, softcap)
        else:
            if need_c and config.forward != "fused":
                # dC allocated here when the GEMM forward can use its bytes as scratch, and handed to the backward
                ctx.dc = _gemm_forward_scratch(c, rows.numel())
            if ctx.dc is not None:
                lse, z_t, z_sum = lse_forward_gemm(e2d, c, bias, rows, targets, softcap, ctx.dc)
            else:
                lse, z_t, z_sum = lse_forward(e2d, c, bias, rows, targets, softcap)
        ctx.save_for_backward(e2d, c, bias, rows, targets, lse)
        ctx.opts = (softcap, label_smoothing, z_loss, config)
        return _spec.token_loss(lse, z_t, z_sum, c.shape[0], label_smoothing, z_loss)

    @staticmethod
    def backward(ctx, grad_losses):
        from .backward import linear_ce_backward

        e2d, c, bias, rows, targets, lse = ctx.saved_tensors
        softcap, ls, z_loss, config = ctx.opts
        dc_buffer, ctx.dc = ctx.dc, None
        de, dc, db = linear_ce_backward(
            e2d, c, bias, rows, targets, lse, grad_losses.float().contiguous(), softcap=softcap,
            label_smoothing=ls, z_loss=z_loss, filter_eps=config.filter_threshold(e2d.dtype),
            scratch_in_dc=config.scratch_in_dc, tiles=config.tiles, need_e=ctx.needs_input_grad[0],
            need_c=ctx.needs_input_grad[1] or ctx.needs_input_grad[2], dc=dc_buffer)
        return de, (dc if ctx.needs_input_grad[1] else None), db, None, None, None, None, None, None, None


def _gluon_forward(e2d, c, bias, nv, config) -> bool:
    """Whether this call's LSE comes from the Gluon kernel (``gluon_tile.gluon_lse_ok``: forward="auto", bf16, no
    bias, sm_90); a seam the CPU tests patch to reach the route's wiring."""
    from .gluon_tile import gluon_lse_ok

    return gluon_lse_ok(e2d, c, bias=bias, nv=nv, forward=config.forward)


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
    config: Optional[CCEKernelConfig] = None,
) -> torch.Tensor:
    """Cross-entropy of the logits ``e @ c.T (+ bias)`` against ``targets``, never holding all the logits.

    Arguments follow ``torch.nn.functional.linear_cross_entropy(input, linear_weight, target)`` positionally;
    ``bias`` is its ``linear_bias``. e: (..., D) float; c: (V, D), same dtype; targets: (...) int in [0, V) or
    ``ignore_index``. ``shift=True``: e[..., t] predicts targets[..., t+1] (causal LM; no copy of e).
    ``softcap``: logits become softcap*tanh(logits/softcap). ``label_smoothing`` as torch's cross_entropy.
    ``z_loss``: adds z_loss*lse**2 per token.
    Under autocast, e, c and bias are cast to the autocast dtype first (fp32 master weights work).
    Returns fp32: the mean over valid tokens (0 if there are none, unlike torch's NaN), the sum, or
    (reduction="none") e's leading shape with 0 at ignored positions. NaN in e propagates to a NaN loss.

    impl: "auto" (Triton kernels on CUDA, the chunked reference elsewhere), "triton" (CUDA, or the CPU only
    under TRITON_INTERPRET=1), "reference" (chunked PyTorch), "torch" (naive, all logits).
    config: a :class:`CCEKernelConfig` for the Triton kernels (default: exact gradients, minimal memory):
    ``CCEKernelConfig(filter_eps="auto")`` skips negligible gradient tiles (faster on flat softmaxes, worse
    early in pre-training), ``CCEKernelConfig(scratch_in_dc=False)`` trades ~64 MiB + Nv x D x 4 bytes for
    speed at small vocabularies.
    """
    check_impl(impl, EXTRA_IMPLS)
    config = check_config(config)
    e, c, bias = _spec.autocast_inputs(e, c, bias)
    _spec.validate(e, c, targets, bias, ignore_index, reduction, softcap, shift, label_smoothing, z_loss)
    with torch.autocast(e.device.type, enabled=False):  # fp32 statistics stay fp32 inside
        return _dispatch(e, c, targets, bias, ignore_index, reduction, softcap, shift, label_smoothing, z_loss,
                         impl, config)


def _dispatch(e, c, targets, bias, ignore_index, reduction, softcap, shift, label_smoothing, z_loss, impl, config):
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
    losses = _TritonLinearCE.apply(
        e2d, c.contiguous(), None if bias is None else bias.contiguous(), prep.rows, prep.targets, softcap,
        float(label_smoothing), float(z_loss), config, torch.is_grad_enabled())
    return _spec.reduce(losses, prep, reduction, torch.float32)


class LinearCrossEntropy(torch.nn.Module):
    """Module form: ``LinearCrossEntropy(reduction=..., ...)(e, c, targets, bias=None)``."""

    def __init__(self, *, ignore_index: int = -100, reduction: str = "mean", softcap: Optional[float] = None,
                 shift: bool = False, label_smoothing: float = 0.0, z_loss: float = 0.0, impl: str = "auto",
                 config: Optional[CCEKernelConfig] = None):
        super().__init__()
        _spec.validate_options(ignore_index, reduction, softcap, shift, label_smoothing, z_loss)
        check_impl(impl, EXTRA_IMPLS)
        check_config(config)
        self.kw = dict(ignore_index=ignore_index, reduction=reduction, softcap=softcap, shift=shift,
                       label_smoothing=label_smoothing, z_loss=z_loss, impl=impl, config=config)

    def forward(self, e, c, targets, bias=None):
        return linear_cross_entropy(e, c, targets, bias=bias, **self.kw)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.kw.items())


def lm_loss(hidden_states: torch.Tensor, classifier_weight: torch.Tensor, labels: torch.Tensor, **kw) -> torch.Tensor:
    """The model's loss seam: hidden (B, T, D), classifier (V, D), labels (B, T) already aligned with the hidden
    positions (no shift), -100 ignored; returns the scalar mean. ``kw`` goes to :func:`linear_cross_entropy`."""
    kw.setdefault("ignore_index", -100)
    return linear_cross_entropy(hidden_states, classifier_weight, labels, **kw)


__all__ = ["linear_cross_entropy", "CCEKernelConfig", "LinearCrossEntropy", "lm_loss", "interpreting"]
