"""Is an N-rank training step the 1-process step? A short, well-posed comparison for sharded training.

Comparing whole loss curves is not well posed: after a loss spike (large learning rate from random init) the
trajectories of two runs that differ only in the reduction order of bf16/fp32 sums separate by up to a nat and
later re-converge, so a long curve cannot tell rounding from a bug. The equivalence phase is instead a few steps
from the same initial weights, on the same global batches, at a constant learning rate small enough that the
run stays in its smooth regime (chosen per model size, a priori). Three things are compared per step/parameter:

- the loss, to ``LOSS_TOL_NATS``: a sharding bug that changes the trajectory (a missed reduction, a wrong
  average) moves it;
- the pre-clip gradient norm of the first ``GRAD_NORM_STEPS`` steps, to ``GRAD_NORM_RTOL`` relative: AdamW (and
  clipping) are blind to a uniform gradient scale, so a sum-instead-of-mean or one rank's gradients doubled
  barely moves the loss; the norm moves by 1.5-2x at the first step already. Only the first steps are judged:
  there both runs hold the same weights up to rounding (step 1: identical; step 2: one update apart). Later the
  norm is chaotic even without any technique: on 2 H200s (2fcb084, 135m, lr 1e-4) it swung 23.8 -> 4.1 -> 7.0
  from step to step, and from step 3 on the 2-rank norms left the 1-process ones by 3.7% (plain), 60% (CCE),
  92% (BitNet) while the losses agreed to 0.02 nats and steps 1-2 to 0.4%. Every step's difference is still
  reported (``grad_norm_max_rel_diff_all_steps``);
- each parameter's update ``||w_K - w_0||``, to ``UPDATE_NORM_RTOL`` relative: a parameter (or one rank's
  shard of it) that the optimizer never updates has a smaller (or zero) update. AdamW's update magnitude is
  ~lr per element whatever the gradient's rounding noise, so its norm over a tensor is stable bit-noise-wise.

The loss tolerance assumes the 1-process run reproduces itself far better than ``LOSS_TOL_NATS``. On a GPU it
need not: flash attention's backward adds dQ with atomics (not bit-reproducible), and BitNet's ternary codes
turn such last-bit differences into code flips that grow step by step (1b a4.8 on 2 H200s, 0525885: the
2-rank losses left the 1-process ones by 0.073 nats at step 10, after 0.016 at step 9, while the gradient
norms of steps 1-2 and every update norm agreed). ``compare(..., repeat=...)`` therefore takes a second
1-process run of the same phase (same code, same batches, another GPU): its own largest loss gap from the
first, the *run-to-run noise*, widens the loss tolerance to ``NOISE_FACTOR`` x that gap where it exceeds
``LOSS_TOL_NATS``. The gradient-norm and update-norm checks, which catch the sharding bugs that matter, are
judged as before. ``benchmarks/multi_gpu.py`` also runs its equivalence phase on SDPA's math backend, which is
bit-reproducible: there the repeat matched the reference exactly in every recipe (66d08d3, 2 H200s), the 2-rank
runs stayed within 0.009 nats, and the repeat remains the guard for kernels that still add with atomics.
"""

from __future__ import annotations

import math

import torch

from .._checks import check_positive_int

LOSS_TOL_NATS = 0.02  # bf16 reduction-order noise over a few smooth steps is ~1e-3; a real bug moves more
GRAD_NORM_RTOL = 0.05  # noise ~1e-3 relative; one rank's gradients x2 gives ~1.5x, a missed 1/N gives N x
GRAD_NORM_STEPS = 2  # the steps whose gradient norm is judged (see the module docstring)
UPDATE_NORM_RTOL = 0.10  # a shard not updated on one of 2 ranks shrinks the update norm to ~0.71x
NOISE_FACTOR = 2.0  # the 2-rank run and a repeat are two draws of the same run-to-run spread around the reference


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (its norm is a Partial/Replicate DTensor); a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _trainable(model: torch.nn.Module):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def record_steps(trainer, steps: int) -> dict:
    """Runs ``steps`` training steps; returns their losses, pre-clip gradient norms and every trainable
    parameter's update norm ``||w_after - w_before||`` (global over ranks for sharded parameters)."""
    check_positive_int("steps", steps)
    before = {n: p.detach().clone() for n, p in _trainable(trainer.model)}  # one copy of the (sharded) weights
    losses, grad_norms = [], []
    for _ in range(steps):
        row = trainer.train_step()
        losses.append(float(row["loss"]))
        grad_norms.append(float(row["grad_norm"]))
    updates = {n: float(_full(torch.linalg.vector_norm((p.detach() - before[n]).float())))
               for n, p in _trainable(trainer.model)}
    return {"losses": losses, "grad_norms": grad_norms, "update_norms": updates}


def _check_record(name: str, rec) -> None:
    if not isinstance(rec, dict) or not {"losses", "grad_norms", "update_norms"} <= set(rec):
        raise ValueError(f"{name}: expected a record_steps() dict with losses, grad_norms, update_norms")
    if not rec["losses"] or len(rec["losses"]) != len(rec["grad_norms"]):
        raise ValueError(f"{name}: expected as many losses as gradient norms (at least one step), got "
                         f"{len(rec['losses'])} and {len(rec['grad_norms'])}")


def _rel(a: float, b: float) -> float:
    """|a - b| relative to b; 0 when both are 0 (a frozen row set, or nothing to update)."""
    if a == b:
        return 0.0
    return abs(a - b) / abs(b) if b != 0 else math.inf


def _worst(diffs) -> float:
    """The largest difference; NaN anywhere counts as the worst (Python's max would skip it by position)."""
    diffs = list(diffs)
    return math.nan if any(d != d for d in diffs) else max(diffs, default=0.0)


def _check_same_phase(name: str, rec: dict, ref: dict) -> None:
    _check_record(name, rec)
    if len(rec["losses"]) != len(ref["losses"]):
        raise ValueError(f"{name}: {len(rec['losses'])} steps, ref: {len(ref['losses'])}; expected the same phase")
    if set(rec["update_norms"]) != set(ref["update_norms"]):
        odd = sorted(set(rec["update_norms"]) ^ set(ref["update_norms"]))[:5]
        raise ValueError(f"{name}: trainable parameters differ from ref's (e.g. {odd})")


def _loss_gap(rec: dict, ref: dict) -> float:
    return _worst(abs(a - b) for a, b in zip(rec["losses"], ref["losses"]))


def compare(many: dict, ref: dict, *, repeat: dict | None = None, loss_tol: float = LOSS_TOL_NATS,
            grad_rtol: float = GRAD_NORM_RTOL, update_rtol: float = UPDATE_NORM_RTOL) -> dict:
    """The N-rank record against the 1-process record of the same phase: the largest differences (the gradient
    norm's over the first ``GRAD_NORM_STEPS`` steps, and over all steps for information), the worst parameter,
    and ``ok`` (every judged one within its tolerance; a NaN anywhere judged is not ok). ``repeat``: a second
    1-process record of the same phase; the loss tolerance is then ``max(loss_tol, NOISE_FACTOR x`` its loss gap
    from ``ref``) (the module docstring says why), and ``loss_noise`` / ``loss_tol`` report both."""
    _check_record("ref", ref)
    _check_same_phase("many", many, ref)
    noise = 0.0
    if repeat is not None:
        _check_same_phase("repeat", repeat, ref)
        noise = _loss_gap(repeat, ref)
        if noise != noise:
            raise ValueError("repeat: a NaN loss; a repeat that does not run cleanly cannot measure the noise")
        loss_tol = max(loss_tol, NOISE_FACTOR * noise)
    loss = _loss_gap(many, ref)
    grad_all = [_rel(a, b) for a, b in zip(many["grad_norms"], ref["grad_norms"])]
    grad = _worst(grad_all[:GRAD_NORM_STEPS])
    upd = {n: _rel(many["update_norms"][n], ref["update_norms"][n]) for n in ref["update_norms"]}
    upd_max = _worst(upd.values())
    worst = next((n for n, d in upd.items() if d == upd_max or d != d), None) if upd else None
    ok = loss <= loss_tol and grad <= grad_rtol and upd_max <= update_rtol  # False for NaN
    return {"loss_max_abs_diff": loss, "loss_noise": noise, "loss_tol": loss_tol, "grad_norm_max_rel_diff": grad,
            "grad_norm_max_rel_diff_all_steps": _worst(grad_all), "update_norm_max_rel_diff": upd_max,
            "worst_parameter": worst, "steps": len(ref["losses"]), "ok": bool(ok)}
