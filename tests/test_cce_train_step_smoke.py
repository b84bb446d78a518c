"""benchmarks/cce.py --smoke on the CPU: the training-step comparison (stock loss, thrifty's, Liger's where
installed) runs end to end at a tiny Llama shape and merges into an earlier cce_<device>.json without losing its
rows and keys; a kernel run keeps the train-step rows and keys of the file it replaces."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from thrifty import bench  # noqa: E402

from script_module import load_script

ROOT = Path(__file__).resolve().parents[1]
KERNEL_ROW = {"shape": "D=2304 V=256000", "impl": "thrifty", "regime": "realistic", "tokens": 8192, "loss_grad_ms": 1.0}


def _earlier(folder: Path, summary: dict, rows: list, extra=None) -> Path:
    return bench.write_result("cce", rows, summary, device="cpu", results_dir=folder, extra=extra or {})


def _liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def test_train_step_smoke_merges_into_the_earlier_result(tmp_path):
    earlier = _earlier(tmp_path / "earlier", {"loss_grad_time_ratio_vs_apple_cce": 0.4,
                                              "train_step_ratio_vs_stock_1b": None}, [KERNEL_ROW],
                       extra={"n_tokens": 8192})
    out = tmp_path / "out"
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cce.py"), "--smoke", "--out", str(out),
                           "--merge-into", str(earlier)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = bench.read_result(out / "cce_cpu.json")
    summary, rows = doc["summary"], doc["rows"]
    # the earlier file's rows, keys and settings stay; its meta moves to extra.kernel_rows_meta
    assert KERNEL_ROW in rows and summary["loss_grad_time_ratio_vs_apple_cce"] == 0.4
    assert doc["extra"]["n_tokens"] == 8192 and "kernel_rows_meta" in doc["extra"]
    assert doc["extra"]["train_step"]["shape"] == "tiny" and doc["extra"]["train_step"]["meta"]["commit"] is not None
    step = [r for r in rows if r.get("section") == "train_step"]
    checks = {r["impl"]: r for r in step if r.get("what") == "check"}
    assert checks["stock"]["logits_materialized"] and not checks["thrifty"]["logits_materialized"]
    assert checks["thrifty"]["loss_rel_diff_vs_stock"] <= 2.0 ** -8
    assert checks["thrifty"]["grad_cos_vs_stock"] > 0.999
    timed = {(r["impl"], r["what"]) for r in step if "ms" in r}
    for impl in ("stock", "thrifty"):
        assert {(impl, "fwd+bwd"), (impl, "fwd+bwd+opt")} <= timed
    assert summary["train_step_ratio_vs_stock_tiny"] > 0 and summary["train_step_fwd_bwd_ratio_vs_stock_tiny"] > 0
    assert summary["train_step_peak_mib_thrifty_tiny"] is None  # CUDA allocator statistics only
    liger = [r for r in step if r["impl"] == "liger"]
    if _liger_installed():
        assert "liger" in checks and summary["train_step_ratio_vs_liger_tiny"] > 0, liger
    else:  # CPU CI: a row that says why, no numbers
        assert len(liger) == 1 and "not installed" in liger[0]["skipped"]
        assert summary["train_step_ratio_vs_liger_tiny"] is None
    assert (out / "cce_train_step_cpu.png").stat().st_size > 0


def test_kernel_run_keeps_the_train_step_rows_and_keys(tmp_path):
    """finalize (the kernel benchmark's writer) over an earlier file with a train step: those rows, keys and
    settings are carried, the kernel keys are this run's."""
    step_row = {"section": "train_step", "what": "fwd+bwd+opt", "impl": "thrifty", "ms": 100.0}
    earlier = _earlier(tmp_path / "earlier", {"loss_grad_time_ratio_vs_apple_cce": 0.4,
                                              "train_step_ratio_vs_stock_1b": 1.25,
                                              "train_step_peak_mib_thrifty_1b": 9000.0}, [KERNEL_ROW, step_row],
                       extra={"train_step": {"shape": "1b"}})
    cce = load_script("benchmarks/cce.py", "cce_bench_under_test")
    out = tmp_path / "out"
    cce.finalize([], 800.0, argparse.Namespace(out=str(out), merge_into=str(earlier)))
    doc = json.loads((out / "cce_cpu.json").read_text())
    assert doc["summary"]["train_step_ratio_vs_stock_1b"] == 1.25
    assert doc["summary"]["train_step_peak_mib_thrifty_1b"] == 9000.0
    assert doc["summary"]["loss_grad_time_ratio_vs_apple_cce"] is None  # this (empty) run's, not the earlier one's
    assert doc["rows"] == [step_row] and doc["extra"]["train_step"] == {"shape": "1b"}
