"""benchmarks/shadowkv_needle.py --smoke (CPU, tiny random Llama, the real tokenizer and corpus): the script runs
end to end and writes the result schema, the summary keys and the plot."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from thrifty import bench
from thrifty.paths import data_dir

ROOT = Path(__file__).resolve().parents[1]
needs_data = pytest.mark.skipif(
    not ((data_dir() / "corpus" / "manifest.json").is_file() and (data_dir() / "smollm2-135m" / "tokenizer.json").is_file()),
    reason="needs the corpus and the SmolLM2 tokenizer under THRIFTY_DATA")


@needs_data
def test_needle_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "shadowkv_needle.py"), "--smoke", "--out",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = bench.read_result(tmp_path / "shadowkv_needle_cpu-smoke.json")
    assert (tmp_path / "shadowkv_needle_cpu-smoke.png").stat().st_size > 1000
    s = doc["summary"]
    for key in ("needle_acc_dense", "needle_acc_shadowkv", "needle_acc_quest", "needle_gap_vs_dense_points",
                "needle_acc_shadowkv_b32", "needle_acc_quest_b64", "needle_gap_vs_quest_points_b64"):
        assert 0 <= abs(s[key]) <= 100, key
    assert s["needle_gap_vs_dense_points"] == pytest.approx(100 * (s["needle_acc_shadowkv"] - s["needle_acc_dense"]))
    rows = doc["rows"]
    assert len(rows) == 3 * 5  # single@0.5, multikey, multivalue x (dense + 2 budgets x 2 selectors)
    assert {(r["method"], r["budget"]) for r in rows} == {("dense", None), ("shadowkv", 32), ("shadowkv", 64),
                                                          ("quest", 32), ("quest", 64)}
    assert all(r["n"] == 2 and 0 <= r["accuracy"] <= 1 for r in rows)
    assert doc["extra"]["timings_s"]["decode_steps"] > 0
