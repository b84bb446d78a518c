"""What every implementation shares: argument checks, the flattening/shift/ignore preparation, the per-token
loss formula and the reduction. Keeping these in one place is what makes the implementations interchangeable.

Per-token loss for a valid token i with target t (z = logits after bias and softcap, lse = logsumexp(z)):

    loss_i = (1 - ls) * (lse - z_t) + ls * (lse - mean_j z_j) + z_loss * lse**2

(``ls`` = label_smoothing; the smoothing term is torch's ``F.cross_entropy(label_smoothing=ls)``). Its gradient
with respect to z_j is ``p_j * (1 + 2*z_loss*lse) - (1 - ls) * [j == t] - ls / V``; with a softcap s,
z = s*tanh(x/s) and dz/dx = 1 - (z/s)**2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .._checks import check_choice, check_range, check_same_device, check_tensor

REDUCTIONS = ("mean", "sum", "none")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class Prepared:
    """Inputs flattened to the valid tokens: no copy of ``e`` (kernels and chunks index rows through ``rows``)."""

    e2d: torch.Tensor  # (N, D) view of e (a copy only when e could not be viewed)
    rows: torch.Tensor  # (Nv,) int64 indices into e2d of the tokens whose loss counts
    targets: torch.Tensor  # (Nv,) int64 target of each of those tokens
    out_shape: tuple  # shape of reduction="none" output (e's leading shape)
    n_total: int  # N


def autocast_inputs(e, c, bias):
    """Under autocast, run at the autocast dtype (a trainer's fp32 master lm_head weight meets bf16 hidden
    states); the casts are differentiable, so grads come back in each input's own dtype."""
    if not (isinstance(e, torch.Tensor) and isinstance(c, torch.Tensor)):
        return e, c, bias
    kind = e.device.type
    if not torch.amp.is_autocast_available(kind) or not torch.is_autocast_enabled(kind):  # meta: validate refuses
        return e, c, bias
    dtype = torch.get_autocast_dtype(kind)
    cast = lambda x: x if x is None or not x.is_floating_point() else x.to(dtype)  # noqa: E731
    return cast(e), cast(c), cast(bias) if isinstance(bias, torch.Tensor) else bias


def validate(e, c, targets, bias, ignore_index, reduction, softcap, shift, label_smoothing, z_loss) -> None:
    check_tensor("e", e, min_ndim=2, floating=True)
    check_tensor("c", c, ndim=2, floating=True)
    check_tensor("targets", targets, integer=True)
    if bias is not None:
        check_tensor("bias", bias, ndim=1, floating=True)
    for name, x in (("e", e), ("c", c), ("bias", bias)):
        if type(x).__name__ == "DTensor":  # a kernel would read only this rank's shard
            raise ValueError(
                f"{name}: got a sharded DTensor. An FSDP2 lm_head must be all-gathered first: shard with "
                f"thrifty.parallel.shard_model (the [norm, lm_head] unit) or call the loss through "
                f"thrifty.parallel.run_with_gathered_head; a tensor-parallel classifier needs "
                f"thrifty.parallel.vocab_parallel_cross_entropy")
    check_same_device(e=e, c=c, targets=targets, bias=bias)
    if e.device.type == "meta":  # no values to compute a loss from; the kernels would fail deep inside
        raise ValueError("e: a tensor on the meta device has no values; move e, c and targets to cpu or cuda "
                         "(after materialising a meta-initialised model)")
    if c.dtype != e.dtype:
        raise TypeError(f"c: expected the dtype of e ({e.dtype}), got {c.dtype}")
    if bias is not None and bias.dtype != e.dtype:
        raise TypeError(f"bias: expected the dtype of e ({e.dtype}), got {bias.dtype}")
    if e.shape[-1] == 0:
        raise ValueError(f"e: expected a hidden size > 0, got shape {tuple(e.shape)}")
    if c.shape[1] != e.shape[-1]:
        raise ValueError(f"c: expected shape (V, {e.shape[-1]}) to match e's last dim, got {tuple(c.shape)}")
    if bias is not None and bias.shape[0] != c.shape[0]:
        raise ValueError(f"bias: expected shape ({c.shape[0]},), got {tuple(bias.shape)}")
    if tuple(targets.shape) != tuple(e.shape[:-1]):
        raise ValueError(f"targets: expected shape {tuple(e.shape[:-1])} (e without its last dim), got {tuple(targets.shape)}")
    validate_options(ignore_index, reduction, softcap, shift, label_smoothing, z_loss)


def validate_options(ignore_index, reduction, softcap, shift, label_smoothing, z_loss) -> None:
    """The scalar options (also checked when a LinearCrossEntropy module is built)."""
    check_choice("reduction", reduction, REDUCTIONS)
    if softcap is not None:
        check_range("softcap", softcap, 0.0, float("inf"), lo_open=True)
    if not isinstance(shift, bool):
        raise TypeError(f"shift: expected a bool, got {type(shift).__name__}")
    check_range("label_smoothing", label_smoothing, 0.0, 1.0)
    check_range("z_loss", z_loss, 0.0, float("inf"))
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")


def prepare(e, c, targets, ignore_index, shift, vocab_size: Optional[int] = None) -> Prepared:
    """Flattens, applies the causal shift to the (small) targets instead of slicing e, drops ignored tokens.
    ``vocab_size`` (default c.shape[0]): the range targets are checked against (a vocabulary-parallel c holds
    only a slice).

    With ``shift``, position t of e predicts targets[..., t+1]; the last position of each sequence predicts
    nothing (its loss is 0 in reduction="none"). The host sync for ``nonzero`` also serves the range check.
    """
    if shift:
        pad = torch.full_like(targets[..., :1], ignore_index)
        targets = torch.cat([targets[..., 1:], pad], dim=-1)
    out_shape = tuple(e.shape[:-1])
    e2d = e.reshape(-1, e.shape[-1])
    t = targets.reshape(-1).long()
    valid = t != ignore_index
    V = c.shape[0] if vocab_size is None else vocab_size
    bad = valid & ((t < 0) | (t >= V))
    if bool(bad.any()):
        first = t[bad][0].item()
        raise ValueError(f"targets: expected values in [0, {V}) or ignore_index={ignore_index}, got {first}")
    rows = valid.nonzero().squeeze(1)
    return Prepared(e2d=e2d, rows=rows, targets=t[rows], out_shape=out_shape, n_total=e2d.shape[0])


def token_loss(lse, z_target, z_sum, V, label_smoothing, z_loss):
    """Per-token loss from the three per-row statistics (fp32)."""
    loss = (1.0 - label_smoothing) * (lse - z_target)
    if label_smoothing:
        loss = loss + label_smoothing * (lse - z_sum / V)
    if z_loss:
        loss = loss + z_loss * lse * lse
    return loss


def reduce(per_token: torch.Tensor, prep: Prepared, reduction: str, dtype: torch.dtype) -> torch.Tensor:
    """mean over valid tokens (0, not NaN, when none is valid: a fully masked batch must not poison training),
    sum, or none (e's leading shape, 0 at ignored tokens). Differentiable: the grads of the per-token losses
    reach the implementation's backward."""
    if reduction == "none":
        out = per_token.new_zeros(prep.n_total).index_put((prep.rows,), per_token)
        return out.view(prep.out_shape).to(dtype)
    total = per_token.sum()
    if reduction == "mean":
        total = total / max(per_token.numel(), 1)
    return total.to(dtype)


def softcap_fn(x: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    return x if softcap is None else softcap * torch.tanh(x / softcap)
