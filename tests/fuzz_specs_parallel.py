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

from fuzz_registry import ArgSpec, FileSpec, NumericSpec, assert_matches, tensors
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
         "targets": [torch.randint(0, 16, (5,)), torch.full((4,), 99), torch.zeros(4)],
         "config": [{"filter_eps": "auto"}]},
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


# ------------------------------------------------------------------------------ sharded checkpoints (world 1)
def _sharded_state(seed):
    from thrifty.models import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(cfg).init_weights(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def _sharded_write(seed, path):
    from thrifty.parallel import save_sharded

    model, opt = _sharded_state(seed)
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    save_sharded(path, model, opt, rank=0, world=1)


def _snapshot(model, opt):
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        state.update({f"opt.{names[id(p)]}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    return state


def _sharded_read(path):
    from thrifty.parallel import load_sharded

    model, opt = _sharded_state(99)  # other weights: a load that does not restore everything shows
    load_sharded(path, model, opt)
    return _snapshot(model, opt)


def _sharded_same(seed, state):
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp(prefix="thrifty-fuzz-")) / "ckpt"
    _sharded_write(seed, d)
    want = _sharded_read(d)
    return want.keys() == state.keys() and all(
        want[k].dtype == state[k].dtype and want[k].shape == state[k].shape and
        torch.equal(want[k].reshape(-1).view(torch.uint8), state[k].reshape(-1).view(torch.uint8)) for k in want)


SHARDED_CHECKPOINT = FileSpec("parallel.save_sharded", st.integers(0, 3), _sharded_write, _sharded_read,
                              _sharded_same, max_examples=10)
SPECS.append(SHARDED_CHECKPOINT)
