"""Fuzz specs of thrifty.parallel in one process: vocabulary-parallel cut cross-entropy in a one-rank gloo
group (argument checks, and NaN/inf/−0.0/subnormal inputs against float64 cross-entropy), RankData.
See tests/fuzz_registry.py. The group is made and destroyed around each call: nothing process-wide is left."""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import strategies as st

from fuzz_registry import ArgSpec, NumericSpec, assert_matches, tensors
from thrifty.parallel import RankData, vocab_parallel_cross_entropy

NAN, INF = math.nan, math.inf


@contextmanager
def _one_rank_group():
    if dist.is_initialized():  # someone else's group: use it, leave it
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _vp_loss(**kw):
    with _one_rank_group():
        return vocab_parallel_cross_entropy(**kw)


def _vp_valid():
    g = torch.Generator().manual_seed(0)
    return dict(e=torch.randn(4, 8, generator=g), c=torch.randn(16, 8, generator=g),
                targets=torch.randint(0, 16, (4,), generator=g), vocab_start=0, vocab_size=16, impl="reference")


VP_ARGS = ArgSpec(
    "parallel.vocab_parallel_cross_entropy", _vp_loss, valid=_vp_valid,
    bad={"vocab_start": [-1, 1, 1.5, True, None, "0"], "vocab_size": [None, 8, 20, 16.0],
         "reduction": ["avg"], "softcap": [NAN, INF, 0.0, -1.0], "z_loss": [NAN, INF, -1.0],
         "ignore_index": [1.5, True], "impl": ["cuda"], "shift": ["yes"],
         "e": [torch.randn(4, 9), torch.zeros(4, 8, dtype=torch.int32), [[1.0]]],
         "c": [torch.randn(16, 9), torch.randn(16, 8).double()],
         "targets": [torch.randint(0, 16, (5,)), torch.full((4,), 99), torch.zeros(4)]},
    mention={"c": "c", "vocab_size": "vocab"})


@st.composite
def vp_inputs(draw):
    N, D, V = draw(st.integers(0, 6), ), draw(st.integers(1, 8)), draw(st.integers(1, 12))
    pool = [NAN, INF, -INF, -0.0, 1e-40]
    e, c = draw(tensors((N, D), allowed_specials=pool)), draw(tensors((V, D), allowed_specials=pool))
    targets = torch.tensor(draw(st.lists(st.sampled_from([-100, *range(V)]), min_size=N, max_size=N)),
                           dtype=torch.int64)
    return dict(e=e, c=c, targets=targets)


def _check_vp(a, out):
    e, c, t = a["e"].double(), a["c"].double(), a["targets"]
    ref = F.cross_entropy(e @ c.T, t, reduction="none", ignore_index=-100) if len(t) else torch.zeros(0)
    assert out.shape == ref.shape
    bad = ~ref.isfinite()
    assert not out[bad].isfinite().any(), "a finite loss where the float64 reference is NaN/inf"
    assert_matches(out, ref, rtol=1e-4, atol=1e-4, where=~bad)


VP_NUMERIC = NumericSpec(
    "parallel.vocab_parallel_cross_entropy.one_rank", vp_inputs(),
    lambda a: _vp_loss(**a, vocab_start=0, vocab_size=a["c"].shape[0], reduction="none", impl="reference"),
    _check_vp, max_examples=15)

RANK_DATA_ARGS = ArgSpec(
    "parallel.RankData", RankData, valid=lambda: dict(data=object(), rank=0, world=2),
    bad={"rank": [2, -1, 1.5, True, None], "world": [0, -1, 1.5, None]}, mention={"world": "world"})

SPECS = [VP_ARGS, VP_NUMERIC, RANK_DATA_ARGS]
