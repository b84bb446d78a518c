"""Pinned host memory for ShadowKV is sized from /proc/meminfo minus a margin and refused with a MemoryError
naming the numbers (the GPU box's OOM killer ends a process silently). CPU: the meminfo reader is replaced."""

import pytest
import torch

from thrifty.kvcache import host as hostmem
from thrifty.kvcache import reference as ref

from script_module import load_script

GiB = 2**30


def fake_meminfo(monkeypatch, available, total=128 * GiB):
    monkeypatch.setattr(hostmem, "meminfo", lambda: {"MemTotal": total, "MemAvailable": available})


def test_meminfo_reads_this_machine():
    info = hostmem.meminfo()
    assert 0 < info["MemAvailable"] <= info["MemTotal"]


@pytest.mark.parametrize("total, margin", [(128 * GiB, 8 * GiB), (512 * GiB, int(0.05 * 512 * GiB))])
def test_budget_is_available_minus_the_margin(monkeypatch, total, margin):
    fake_meminfo(monkeypatch, available=100 * GiB, total=total)
    b = hostmem.host_budget()
    assert b.margin == margin and b.budget == 100 * GiB - margin
    assert f"{100:.1f} GiB" in b.explain() and f"{b.budget / GiB:.1f} GiB pinnable" in b.explain()
    fake_meminfo(monkeypatch, available=3 * GiB, total=total)
    assert hostmem.host_budget().budget == 0  # never negative


def test_too_large_a_request_raises_memory_error_with_the_numbers(monkeypatch):
    fake_meminfo(monkeypatch, available=20 * GiB)
    with pytest.raises(MemoryError, match=r"host values: needs 13\.00 GiB.*12\.00 GiB.*MemAvailable 20\.0 GiB"):
        hostmem.pinned_empty((13 * GiB,), torch.uint8, what="host values")
    t = hostmem.pinned_empty((3, 5), torch.bfloat16)  # fits: exact size, no power-of-two rounding
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and t.untyped_storage().nbytes() == 30


def test_cache_host_values_checked_against_the_budget(monkeypatch):
    fake_meminfo(monkeypatch, available=8 * GiB + 100)  # 100 bytes over the margin
    v = torch.randn(1, 2, 40, 8)
    with pytest.raises(MemoryError, match="host values"):
        ref._to_host(v, torch.device("cpu"), pin=True)
    fake_meminfo(monkeypatch, available=9 * GiB)
    out = ref._to_host(v, torch.device("cpu"), pin=True)
    assert torch.equal(out, v)


def load_benchmark():
    return load_script("benchmarks/shadowkv.py", "shadowkv_bench")


def test_benchmark_host_limit_and_batch_caps(monkeypatch):
    skv = load_benchmark()
    fake_meminfo(monkeypatch, available=48 * GiB)
    b = hostmem.host_budget()
    assert skv.host_limit_bytes(None, b) == 40 * GiB
    assert skv.host_limit_bytes(30, b) == 30 * GiB
    with pytest.raises(MemoryError, match=r"--host-gib: needs 41\.00 GiB"):
        skv.host_limit_bytes(41, b)
    # the host cap is floor(limit / per-sequence bytes): Llama-3-8B shape at 122K, bf16 values = 7.62 GiB/seq
    cfg_n, cfg_8 = skv.configs_for(124928, 36, smoke=False, outliers=48)
    per_seq = skv.host_seq_bytes(32, 8, 128, 124928, cfg_n)
    assert per_seq == 32 * 8 * 124928 * 128 * 2
    assert 40 * GiB // per_seq == 5
    assert skv.host_seq_bytes(32, 8, 128, 124928, cfg_8) == 32 * 8 * 124928 * (128 + 4)


def test_benchmark_arena_hands_out_exact_views(monkeypatch):
    skv = load_benchmark()
    fake_meminfo(monkeypatch, available=9 * GiB)
    arena = skv.HostArena(4096, hostmem.host_budget())
    a = arena.take((2, 3, 5), torch.bfloat16)
    b = arena.take((7,), torch.float32)
    assert a.shape == (2, 3, 5) and b.data_ptr() - arena.buf.data_ptr() == 256
    with pytest.raises(MemoryError, match="host arena"):
        arena.take((4096,), torch.float32)


def test_benchmark_stage_row_counts_misses_before_the_breakdown():
    """``--stages-only``: one layer at batch 1. The hit rate is read before the breakdown (whose repeated select
    hits everything: it read 1.0), and the timed fill re-does the last step's misses."""
    skv = load_benchmark()
    row = skv.stage_row(skv.TINY, 384, gen=16, hit_rate=0.5, device=torch.device("cpu"), smoke=True,
                        outliers=4)
    assert 0.0 < row["hit_rate"] < 1.0 and row["fill_rows"] > 0
    assert all(row[f"{s}_ms_per_layer"] > 0 for s in ("select", "fill", "attention"))
