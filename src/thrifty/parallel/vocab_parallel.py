"""Vocabulary-parallel cut cross-entropy: the classifier's rows (the vocabulary) are split over the ranks of a
tensor-parallel group; the hidden states and the targets are the same on every rank.

Per rank (the same fused work as single-process CCE, on its slice ``[start, start + V_local)``):
  forward   the slice's log-sum-exp ``lse_r`` and, where the target falls in the slice, its logit ``z_r``
            (thrifty.loss.forward.lse_forward on CUDA; a chunked torch pass otherwise), never the logits;
  combine   ONE all-gather of the pairs (lse_r, z_r): 2 fp32 numbers per valid token per rank. Then on every
            rank ``lse = logsumexp_r lse_r``, ``z_t = sum_r z_r``, ``loss = lse - z_t (+ z_loss * lse**2)``;
  backward  the same gradient-tile kernels (thrifty.loss.backward.linear_ce_backward) with the GLOBAL lse and
            the slice-local target (-1 where another rank owns it): ``dC_r`` and ``dbias_r`` are exact and stay
            local (no communication); ``dE`` is a partial sum over the slice, all-reduced (SUM, N x D in e's
            dtype) across the group when ``reduce_e_grad`` (the default; turn it off when the caller's own
            tensor-parallel region already all-reduces the gradient of the replicated hidden states).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from .._checks import check_impl
from ..loss import _spec
from ..loss.cce import CCEKernelConfig, check_config
from ..loss.reference import accumulate_grads
from ..triton_utils import kernels_available


# torch 2.13 renames all_gather_into_tensor (deprecated there) to all_gather_single; the GPU box runs 2.11
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather_stats(lse_r: torch.Tensor, z_r: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The one collective of the forward: every rank's (lse_r, z_r) -> global (lse, z_target)."""
    world = dist.get_world_size(group)
    mine = torch.stack([lse_r, z_r]).contiguous()  # fp32 (fp64 for the float64 reference)
    out = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
    _all_gather_flat(out, mine.view(-1), group=group)
    out = out.view(world, 2, -1)
    return torch.logsumexp(out[:, 0], dim=0), out[:, 1].sum(0)


def _reference_stats(e2d, c, bias, rows, tgt, softcap, chunk):
    """Chunked torch: per valid row, lse over the slice and the slice's target logit (0 when not owned)."""
    acc = torch.float64 if c.dtype == torch.float64 else torch.float32
    c32, b32 = c.to(acc), None if bias is None else bias.to(acc)
    lse = torch.empty(rows.numel(), dtype=acc, device=e2d.device)
    z_t = torch.zeros_like(lse)
    for s in range(0, rows.numel(), chunk):
        sl = slice(s, min(rows.numel(), s + chunk))
        z = _spec.softcap_fn(torch.nn.functional.linear(e2d[rows[sl]].to(acc), c32, b32), softcap)
        lse[sl] = torch.logsumexp(z, dim=1) if c.shape[0] else torch.full_like(lse[sl], float("-inf"))
        owned = tgt[sl] >= 0
        z_t[sl] = torch.where(owned, z.gather(1, tgt[sl].clamp(min=0)[:, None]).squeeze(1) if c.shape[0] else 0.0, 0.0)
    return lse, z_t


class _VocabParallelCE(torch.autograd.Function):
    """Per-token fp32 losses of the valid rows (identical on every rank of the group)."""

    @staticmethod
    def forward(ctx, e2d, c, bias, rows, tgt, softcap, z_loss, group, impl, reduce_e_grad, opts):
        if impl == "triton":
            from ..loss.forward import lse_forward

            lse_r, z_r, _ = lse_forward(e2d, c, bias, rows, tgt, softcap)
        else:
            lse_r, z_r = _reference_stats(e2d, c, bias, rows, tgt, softcap, opts["chunk"])
        lse, z_t = _gather_stats(lse_r, z_r, group)
        ctx.save_for_backward(e2d, c, bias, rows, tgt, lse)
        ctx.cfg = (softcap, z_loss, group, impl, reduce_e_grad, opts)
        return _spec.token_loss(lse, z_t, None, 1, 0.0, z_loss)

    @staticmethod
    def backward(ctx, grad_losses):
        e2d, c, bias, rows, tgt, lse = ctx.saved_tensors
        softcap, z_loss, group, impl, reduce_e_grad, opts = ctx.cfg
        need_e, need_c, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if impl == "triton":
            from ..loss.backward import linear_ce_backward

            de, dc, db = linear_ce_backward(
                e2d, c, bias, rows, tgt, lse.float(), grad_losses.float().contiguous(), softcap=softcap,
                label_smoothing=0.0, z_loss=z_loss, filter_eps=opts["config"].filter_threshold(e2d.dtype),
                scratch_in_dc=opts["config"].scratch_in_dc, tiles=opts["config"].tiles, need_e=need_e,
                need_c=need_c or need_b)
        else:
            de, dc, db = accumulate_grads(e2d, c, bias, rows, tgt, lse, grad_losses, softcap=softcap,
                                          label_smoothing=0.0, z_loss=z_loss, chunk_size=opts["chunk"],
                                          need_e=need_e, need_c=need_c, need_b=need_b)
            de = None if de is None else de.to(e2d.dtype)
            dc = None if dc is None else dc.to(c.dtype)
            db = None if db is None else db.to(bias.dtype)
        if need_e and reduce_e_grad:
            dist.all_reduce(de, group=group)  # the only collective of the backward
        return (de, dc if need_c else None, db if need_b else None) + (None,) * 8


def _slice_of(c: torch.Tensor, vocab_start: Optional[int], group):
    """(local classifier, start, group) from a Shard(0) DTensor or from explicit arguments."""
    if isinstance(c, DTensor):
        mesh = c.device_mesh
        if mesh.ndim != 1 or not (type(c.placements[0]) is Shard and c.placements[0].dim == 0):
            raise ValueError(f"c: expected a DTensor sharded on dim 0 (vocabulary) over a 1-D mesh, got "
                             f"placements {c.placements} on a {mesh.ndim}-D mesh")
        from .checkpoint import chunk_rows

        start = chunk_rows(c.shape[0], mesh.size())[mesh.get_local_rank()][0]
        return c.to_local(), start, c.shape[0], mesh.get_group()
    if vocab_start is None:
        raise ValueError("vocab_start: required when c is a plain tensor (this rank's first vocabulary row)")
    return c, vocab_start, None, group


def vocab_parallel_cross_entropy(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: Optional[int] = None,
    vocab_size: Optional[int] = None,
    group=None,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    softcap: Optional[float] = None,
    shift: bool = False,
    z_loss: float = 0.0,
    reduce_e_grad: bool = True,
    impl: str = "auto",
    config: Optional[CCEKernelConfig] = None,
) -> torch.Tensor:
    """Cross-entropy of ``e @ C.T`` where this rank holds rows ``[vocab_start, vocab_start + c.shape[0])`` of
    the full classifier C (V = ``vocab_size`` rows over the ranks of ``group``, default the world).

    ``c`` is either that local slice (give ``vocab_start``, ``vocab_size``) or a DTensor sharded on dim 0
    (a ``ColwiseParallel`` lm_head): slice, start, size and group are read from it and its gradient comes back
    as a DTensor. ``e`` (..., D) and ``targets`` (...) (global vocabulary ids) must be identical on all ranks.
    Every rank returns the same loss (fp32). Conventions (shift, ignore_index, reduction, softcap, z_loss) as
    :func:`thrifty.loss.linear_cross_entropy`; label smoothing is not offered here. ``impl``: "triton" (the
    CCE kernels; CUDA, or CPU under TRITON_INTERPRET=1), "reference" (chunked torch), "auto" (triton on CUDA).
    ``config``: a :class:`thrifty.loss.CCEKernelConfig` for the Triton kernels, as in linear_cross_entropy
    (filtering and the vocabulary sort are local to each slice).
    """
    check_impl(impl)
    config = check_config(config)
    if not dist.is_initialized():
        raise RuntimeError("vocab_parallel_cross_entropy: no process group (torch.distributed.init_process_group)")
    c_local, start, size_from_c, group = _slice_of(c, vocab_start, group)
    vocab_size = vocab_size if vocab_size is not None else size_from_c
    if vocab_size is None:
        raise ValueError("vocab_size: required when c is a plain tensor (the full vocabulary size)")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size: expected an int, got {type(vocab_size).__name__}")
    if dist.get_world_size(group) == 1 and vocab_size != c_local.shape[0]:
        # one rank must hold every row; else targets in the missing rows would count a logit of 0, silently
        raise ValueError(f"vocab_size: a one-rank group holds the whole vocabulary: expected c's "
                         f"{c_local.shape[0]} rows, got {vocab_size}")
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= vocab_size - c_local.shape[0]:
        raise ValueError(f"vocab_start: expected an int in [0, {vocab_size - c_local.shape[0]}] "
                         f"(vocab_size - rows of c), got {start!r}")
    if isinstance(bias, DTensor):
        bias = bias.to_local()
    e, c_local, bias = _spec.autocast_inputs(e, c_local, bias)
    _spec.validate(e, c_local, targets, bias, ignore_index, reduction, softcap, shift, 0.0, z_loss)
    if impl == "auto":
        impl = "triton" if e.device.type == "cuda" and kernels_available(e.device) else "reference"
    if impl == "triton" and not kernels_available(e.device):
        raise ValueError(f"impl='triton': Triton kernels cannot run on {e.device}; use impl='reference'")
    if impl == "triton" and e.dtype == torch.float64:
        raise TypeError("e: impl='triton' supports float16, bfloat16 and float32; use impl='reference' for float64")
    prep = _spec.prepare(e, c_local, targets, ignore_index, shift, vocab_size=vocab_size)
    local_t = prep.targets - start
    local_t = torch.where((local_t >= 0) & (local_t < c_local.shape[0]), local_t, torch.full_like(local_t, -1))
    opts = dict(chunk=max(1, (1 << 22) // max(c_local.shape[0], 1)), config=config)
    e2d = prep.e2d if prep.e2d.stride(-1) == 1 else prep.e2d.contiguous()
    with torch.autocast(e.device.type, enabled=False):
        losses = _VocabParallelCE.apply(e2d, c_local.contiguous(), None if bias is None else bias.contiguous(),
                                        prep.rows, local_t.contiguous(), softcap, float(z_loss), group, impl,
                                        bool(reduce_e_grad), opts)
    return _spec.reduce(losses, prep, reduction, losses.dtype)


def vocab_parallel_lm_loss(hidden: torch.Tensor, classifier_weight: torch.Tensor, labels: torch.Tensor, **kw):
    """The reference model's loss seam for a tensor-parallel (Shard(0) DTensor) classifier: labels aligned with
    the hidden positions, -100 ignored, scalar mean. ``kw`` goes to :func:`vocab_parallel_cross_entropy`."""
    return vocab_parallel_cross_entropy(hidden, classifier_weight, labels, **kw)
