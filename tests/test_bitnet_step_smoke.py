"""benchmarks/bitnet_step.py --smoke on the CPU (kernels under the Triton interpreter): the script must not rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bitnet_step_smoke(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)}
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
