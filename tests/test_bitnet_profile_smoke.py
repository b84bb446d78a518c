"""benchmarks/bitnet_profile.py --smoke on the CPU (kernels under the Triton interpreter): the script runs, and
its counts say what the code does (every BitLinear on the Triton path, SharedInput quantizing q/k/v and gate/up
once: 4 input kernels per layer forward, one ternary kernel per projection, one norm backward per sub-norm)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bitnet_profile_smoke(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bitnet_profile.py"), "--smoke", "--out",
                           str(tmp_path), "--device", "cpu"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "bitnet_profile_cpu.json").read_text())
    steps = {r["recipe"]: r for r in result["rows"] if r["what"] == "step"}
    assert set(steps) == {"fp", "b1.58", "a4.8"}
    for r in steps.values():
        assert r["step_ms"] > 0 and r["aten_ops"] > 0 and r["fwd_host_ms"] > 0 and r["loss_finite"], r
    assert {r["recipe"] for r in result["rows"] if r["what"] == "diff"} == {"a4.8 - b1.58", "b1.58 - fp"}
    assert any(r["what"] == "kernel" and r["recipe"] == "a4.8" and r["calls"] > 0 for r in result["rows"])
    per = result["extra"]["per_recipe"]
    layers = 2  # the tiny preset
    assert per["fp"]["triton_launches_fwd"] == 0 and per["fp"]["bitlinear_paths"] == {}
    for recipe in ("b1.58", "a4.8"):
        counts = per[recipe]
        assert set(counts["bitlinear_paths"]) == {f"{p}:triton" for p in (
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}, counts["bitlinear_paths"]
        kernels = counts["triton_launches_by_kernel"]
        # SharedInput hit for q/k/v and gate/up: 4 quantizer launches per layer (a4.8's o_proj: the TopK kernel)
        topk = kernels.get("fwd:_topk_int8_kernel", 0)
        assert kernels["fwd:_quantize_rows_kernel"] + topk == 4 * layers, kernels
        assert topk == (layers if recipe == "a4.8" else 0), kernels
        assert kernels["fwd:_ternary_kernel"] == 7 * layers, kernels
        assert kernels["bwd:_norm_backward_kernel"] == 2 * layers, kernels
        assert counts["nonzero_or_mask"] == 0
    # the fused recipes have no more host syncs than fp beyond AdamW's per-parameter step counter on the CPU
    # (one .item() per parameter; the sub-norm weights are 2 per layer)
    assert per["b1.58"]["item_syncs"] == per["fp"]["item_syncs"] + 2 * layers
