"""benchmarks/kv_decode_ab.py --smoke on the CPU (kernels under the Triton interpreter): the A/B of the family's
decode kernel against the two kernels it replaced runs, and both callers get the old kernels' outputs bit for bit
(the interpreter has no FMA contraction, so the same operations in the same order give the same bits)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "90291a8"  # main before thrifty.kv had one decode kernel: its two kernels are the A/B's "old"


def _run(tmp_path, *extra):
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kv_decode_ab.py"), "--smoke", "--results-dir",
                           str(tmp_path), *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(tmp_path.glob("kv_decode_ab_*.json")).read_text())


def _old_src(tmp_path) -> Path:
    """src/ of BEFORE, from this repository's history (skips where the history is not there: a shallow clone)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE, "src"], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"commit {BEFORE} is not in this checkout's history")
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    return tmp_path / "src"


def test_kv_decode_ab_smoke_matches_the_old_kernels(tmp_path):
    result = _run(tmp_path / "out", "--old-src", str(_old_src(tmp_path)))
    rows = result["rows"]
    assert {r["kind"] for r in rows} == {"shadowkv", "quantized"}
    for r in rows:
        assert r["identical"], r
        assert r["err_new"] < 2e-2 and r["new_gpu_us"] > 0 and r["old_gpu_us"] > 0, r
    assert result["summary"]["quantized_all_identical"] is True


def test_kv_decode_ab_smoke_without_an_old_tree(tmp_path):
    rows = _run(tmp_path)["rows"]
    assert rows and all("old_gpu_us" not in r and r["err_new"] < 2e-2 for r in rows)
