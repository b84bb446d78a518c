"""benchmarks/bitnet_step.py --smoke on the CPU (kernels under the Triton interpreter): the script must not rot."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from script_module import load_script
from test_train_cuda_graph import stand_in_graphs  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]


def smoke_env() -> dict:
    return {**os.environ, "TRITON_INTERPRET": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)}


def test_bitnet_step_smoke(tmp_path):
    env = smoke_env()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bitnet_step.py"), "--smoke", "--out",
                           str(tmp_path), "--device", "cpu"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(tmp_path.glob("bitnet_step_*.json")).read_text())
    for key in ("train_step_time_ratio_a48_vs_fp", "train_step_time_ratio_b158_vs_fp", "topk_over_int8_time",
                "topk_over_int8_gpu_time"):
        assert result["summary"][key] > 0, key
    assert {r["variant"] for r in result["rows"] if r["what"] == "step"} == {
        "fp", "b1.58", "a4.8", "a4.8 (reference quantizers)"}
    assert next(tmp_path.glob("bitnet_step_*.png")).stat().st_size > 0


def test_baseline_src_times_the_other_trees_quantizers(tmp_path):
    """--baseline-src: the quantizer rows of the tree it names (a copy of src/ here), from a subprocess that
    imported that copy, next to this tree's; --quantizers-only skips the training steps."""
    shutil.copytree(ROOT / "src" / "thrifty", tmp_path / "old" / "thrifty",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bitnet_step.py"), "--smoke", "--out", str(out),
                           "--device", "cpu", "--quantizers-only", "--baseline-src", str(tmp_path / "old")],
                          cwd=ROOT, env=smoke_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(out.glob("bitnet_step_*.json")).read_text())
    rows = result["rows"]
    assert not [r for r in rows if "error" in r], rows
    assert not [r for r in rows if r.get("what") == "step"]
    trees = {r["tree"]: r["thrifty_src"] for r in rows}
    assert trees == {"this": str(ROOT / "src"), "baseline": str(tmp_path / "old")}
    assert all(r["exact"] for r in rows if r["kind"] == "topk_int8")
    for d in (33, 130):
        assert result["summary"][f"topk_gpu_speedup_vs_baseline_d{d}"] > 0


def test_step_times_give_eager_and_graph_rows(stand_in_graphs):
    """On CUDA every variant is timed eagerly and as a graph in the same rounds; the unsuffixed ratios are the
    graph's. The graph trainers here record StandInGraphs (CPU), reference quantizers (fast off the GPU)."""
    import argparse
    
    import torch

    bench = load_script("benchmarks/bitnet_step.py", "bitnet_step_under_test")
    args = argparse.Namespace(preset="tiny", vocab_size=256, batch_size=1, seq_len=8, warmup=1, reps=2, rounds=2,
                              cuda_graph=True)
    rows, summary = bench.step_times(args, torch.device("cpu"), "reference")
    graphed = [r for r in rows if r["path"] == "cuda_graph"]
    assert [r["variant"] for r in graphed] == [name + bench.GRAPH_TAG for name, _, _ in bench.VARIANTS]
    assert len(stand_in_graphs) == len(bench.VARIANTS) and all(g.replays >= 2 for g in stand_in_graphs)
    assert summary["train_step_path"] == "cuda_graph"
    for key in ("train_step_time_ratio_a48_vs_fp", "train_step_time_ratio_b158_vs_fp", "step_ms_fp"):
        assert summary[key] == summary[key + "_cuda_graph"] and summary[key + "_eager"] > 0
    assert summary["cuda_graph_speedup_a48"] == pytest.approx(
        next(r["step_ms"] for r in rows if r["variant"] == "a4.8") / next(r["step_ms"] for r in graphed
                                                                          if r["variant"] == "a4.8 (cuda graph)"))
