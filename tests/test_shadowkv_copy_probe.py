"""benchmarks/shadowkv_copy_probe.py: ``--trials``/``--pick`` select the ablation's prompts, the default keeps
the old prompts, and the exact-key fields of a layer equal the rebuilt-key ones when the rank keeps every key."""

import math
import random
from types import SimpleNamespace

import torch

from thrifty.kvcache.needle import make_needle_task

from script_module import load_script

def _module():
    return load_script("benchmarks/shadowkv_copy_probe.py", "shadowkv_copy_probe")


def _encode(s):
    return [ord(ch) % 97 + 1 for ch in s]


def test_probe_tasks_follow_the_ablation_order():
    P = _module()
    filler = [random.Random(3).randrange(1, 500) for _ in range(4000)]
    got = P.probe_tasks(_encode, filler, 600, [0.1, 0.3], 2, random.Random(1), 7)
    ref = P.abl.needle_tasks(_encode, filler, 600, ["single", "multikey"], [0.1, 0.3], 2, random.Random(1), 7)
    assert [d for d, _ in got] == [0.1, 0.1, 0.3, 0.3]
    for (_, a), b in zip(got, ref[:4]):  # the ablation draws its single prompts first
        assert torch.equal(a.input_ids, b.input_ids) and a.answers == b.answers
    # --trials 1 (the default) keeps the old probe's prompts: one per depth, drawn in turn
    rng = random.Random(0)
    old = [make_needle_task("single", _encode, filler, 600, d, rng, filler_sub=7) for d in (0.3, 0.5)]
    new = P.probe_tasks(_encode, filler, 600, [0.3, 0.5], 1, random.Random(0), 7)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, (_, b) in zip(old, new))


def test_probe_layer_exact_keys_at_full_rank():
    P = _module()
    torch.manual_seed(0)
    H, G, D, T0, A, c = 2, 2, 8, 160, 3, 8
    T = T0 + A
    k, v = torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    pos = torch.arange(T, dtype=torch.float32)[:, None] / (10000 ** (torch.arange(D // 2) / (D // 2)))
    cos = torch.cat((pos.cos(), pos.cos()), -1)
    sin = torch.cat((pos.sin(), pos.sin()), -1)
    q = torch.randn(1, H * G, A, D)
    needle = [50, 51, 52, 53, 54]
    targets = [[], [50], [51]]
    for rank, same in ((H * D, True), (3, False)):
        args = SimpleNamespace(chunk=c, outliers=2, rank=rank, local=1, budget=32)
        out = P.probe_layer(q, k, v, cos, sin, T0, needle, targets, args)
        assert out["dense_needle"].shape == (A, H)
        for m in P.METHODS:
            assert (out[f"{m}_needle_kept"] <= out["dense_needle"] + 1e-6).all()
        assert torch.equal(out["quest_needle_p"], out["quest_needle_p_exactK"])
        close = torch.allclose(out["shadowkv_err"], out["shadowkv_err_exactK"], atol=1e-4)
        assert close == same
        # the read chunk's mean logit is its landmark logit; the best token logit bounds it
        assert (out["read_max_logit"] >= out["read_mean_logit"]).all()
        assert set(out["read_chunk"].unique().tolist()) <= {n // c for n in needle}
    assert math.isfinite(float(out["shadowkv_err"].sum()))
