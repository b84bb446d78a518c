"""The spec in plain PyTorch: linear + cross-entropy, chunked over tokens so that at most ``chunk_size`` rows of
fp32 logits are alive at once (forward and backward), on any device.

The custom autograd function saves only the inputs and the per-token log-sum-exp; backward recomputes each
chunk's logits. fp32 accumulation throughout (inputs are upcast per chunk; C once per pass).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _spec

DEFAULT_LOGITS_PER_CHUNK = 1 << 24  # 64 MiB of fp32 logits per chunk


def _chunks(n: int, chunk_size: int):
    for start in range(0, n, chunk_size):
        yield slice(start, min(n, start + chunk_size))


class _ChunkedLinearCE(torch.autograd.Function):
    """Per-token losses (fp32, one per valid row) of rows ``rows`` of ``e2d`` against ``targets``."""

    @staticmethod
    def forward(ctx, e2d, c, bias, rows, targets, softcap, label_smoothing, z_loss, chunk_size):
        acc = torch.float64 if c.dtype == torch.float64 else torch.float32
        c32 = c.to(acc)
        b32 = None if bias is None else bias.to(acc)
        V = c.shape[0]
        losses = torch.empty(rows.numel(), dtype=acc, device=e2d.device)
        lse = torch.empty_like(losses)
        for sl in _chunks(rows.numel(), chunk_size):
            z = _spec.softcap_fn(torch.nn.functional.linear(e2d[rows[sl]].to(acc), c32, b32), softcap)
            lse[sl] = torch.logsumexp(z, dim=1)
            z_t = z.gather(1, targets[sl, None]).squeeze(1)
            z_sum = z.sum(1) if label_smoothing else None
            losses[sl] = _spec.token_loss(lse[sl], z_t, z_sum, V, label_smoothing, z_loss)
        ctx.save_for_backward(e2d, c, bias, rows, targets, lse)
        ctx.opts = (softcap, label_smoothing, z_loss, chunk_size)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        e2d, c, bias, rows, targets, lse = ctx.saved_tensors
        softcap, ls, z_loss, chunk_size = ctx.opts
        need_e, need_c, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        de, dc, db = accumulate_grads(e2d, c, bias, rows, targets, lse, grad_losses, softcap=softcap,
                                      label_smoothing=ls, z_loss=z_loss, chunk_size=chunk_size,
                                      need_e=need_e, need_c=need_c, need_b=need_b)
        cast = lambda x, like: None if x is None else x.to(like.dtype)  # noqa: E731
        return cast(de, e2d), cast(dc, c), (cast(db, bias) if need_b else None), None, None, None, None, None, None


def accumulate_grads(e2d, c, bias, rows, targets, lse, weights, *, softcap, label_smoothing, z_loss, chunk_size,
                     need_e, need_c, need_b):
    """dE, dC, db (in ``lse``'s dtype, None where not needed) of Σ weights·loss over ``rows``, chunk by chunk,
    recomputing the logits. ``lse`` is the forward's (under vocabulary parallelism the global one, ``c`` a slice);
    a negative target means its column is not in ``c`` (another rank owns it)."""
    acc = lse.dtype
    c32 = c.to(acc)
    b32 = None if bias is None else bias.to(acc)
    V = c.shape[0]
    de = torch.zeros(e2d.shape, dtype=acc, device=e2d.device) if need_e else None
    dc = torch.zeros(c.shape, dtype=acc, device=c.device) if need_c else None
    db = torch.zeros(V, dtype=acc, device=c.device) if need_b else None
    for sl in _chunks(rows.numel(), chunk_size):
        e32 = e2d[rows[sl]].to(acc)
        z = _spec.softcap_fn(torch.nn.functional.linear(e32, c32, b32), softcap)
        g = torch.exp(z - lse[sl, None]) * (1.0 + 2.0 * z_loss * lse[sl, None])
        owned = targets[sl] >= 0
        g[owned.nonzero().squeeze(1), targets[sl][owned]] -= 1.0 - label_smoothing
        if label_smoothing:
            g -= label_smoothing / V
        if softcap is not None:
            g *= 1.0 - (z / softcap) ** 2
        g *= weights[sl, None].to(acc)
        if need_e:
            de.index_add_(0, rows[sl], g @ c32)
        if need_c:
            dc += g.T @ e32
        if need_b:
            db += g.sum(0)
    return de, dc, db


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
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Cross-entropy of ``e @ c.T (+ bias)`` against ``targets`` without all the logits alive at once.

    e: (..., D) hidden states; c: (V, D) classifier; targets: (...) int, ``ignore_index`` marks tokens that
    count for nothing. ``shift=True`` is the causal-LM shift (e[..., t] predicts targets[..., t+1]).
    Returns an fp32 scalar (mean over valid tokens, 0 when none is valid; or sum), or per-token fp32 losses of
    e's leading shape with 0 at ignored tokens (reduction="none"). NaN in e gives NaN loss (not masked).
    """
    e, c, bias = _spec.autocast_inputs(e, c, bias)
    _spec.validate(e, c, targets, bias, ignore_index, reduction, softcap, shift, label_smoothing, z_loss)
    prep = _spec.prepare(e, c, targets, ignore_index, shift)
    if chunk_size is None:
        chunk_size = max(1, DEFAULT_LOGITS_PER_CHUNK // c.shape[0])
    with torch.autocast(e.device.type, enabled=False):  # the chunks' matmuls stay fp32
        losses = _ChunkedLinearCE.apply(
            prep.e2d, c, bias, prep.rows, prep.targets, softcap, float(label_smoothing), float(z_loss),
            int(chunk_size))
    return _spec.reduce(losses, prep, reduction, losses.dtype)  # fp32 (fp64 for fp64 inputs)


def naive_linear_cross_entropy(e, c, targets, *, bias=None, ignore_index=-100, reduction="mean", softcap=None,
                               shift=False, label_smoothing=0.0, z_loss=0.0, dtype=None):
    """The obvious implementation: all logits, ``F.cross_entropy``. ``dtype`` (e.g. float64) upcasts first:
    the oracle for tests. Same conventions as :func:`linear_cross_entropy` (0 for mean over no token)."""
    _spec.validate(e, c, targets, bias, ignore_index, reduction, softcap, shift, label_smoothing, z_loss)
    prep = _spec.prepare(e, c, targets, ignore_index, shift)
    dtype = dtype or torch.float32
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    z = _spec.softcap_fn(torch.nn.functional.linear(cast(prep.e2d[prep.rows]), cast(c), cast(bias)), softcap)
    if z.dtype not in (torch.float32, torch.float64):
        z = z.float()
    per_token = torch.nn.functional.cross_entropy(z, prep.targets, reduction="none", label_smoothing=label_smoothing)
    if z_loss:
        per_token = per_token + z_loss * torch.logsumexp(z, 1) ** 2
    return _spec.reduce(per_token, prep, reduction, per_token.dtype)
