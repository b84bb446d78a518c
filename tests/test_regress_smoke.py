"""benchmarks/regress.py on the CPU (--smoke: tiny sizes, Triton interpreter): the script must not rot.

Every section runs once, split over two calls to stay under a minute on two cores (each worker is a fresh
Python that imports torch, 2-4 s): neuzip with a baseline (this checkout standing in for the old tree) and
repeated (new, old, new again), the other five sections without one. The whole smoke with a baseline takes
about 90 s on two busy cores.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from thrifty import bench

from script_module import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "regress.py"


def _load():
    return load_script(SCRIPT, "regress_under_test")


def _run(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path), *args], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = bench.read_result(tmp_path / "regress_cpu.json")
    assert (tmp_path / "regress_cpu.png").is_file() or not any("new_over_old" in r for r in doc["rows"])
    return doc, proc.stdout


def _values(doc):
    return {r["figure"]: r for r in doc["rows"]}


def test_smoke_with_baseline_and_repeat(tmp_path):
    doc, out = _run(tmp_path, "--baseline", str(ROOT), "--baseline-commit", "self", "--sections", "neuzip",
                    "--repeat", "neuzip")
    rows = _values(doc)
    for fig in ("neuzip_ratio", "neuzip_copy_gbs", "neuzip_decode_gbs", "neuzip_copy_call_us", "neuzip_decode_call_us"):
        assert rows[fig].get("error") is None, rows[fig]
        assert rows[fig]["old"] > 0 and rows[fig]["new"] > 0
        assert doc["summary"][f"{fig}_vs_baseline"] == pytest.approx(rows[fig]["new"] / rows[fig]["old"])
    assert rows["neuzip_ratio"]["new_over_old"] == pytest.approx(1.0)  # the same tree compresses the same way
    assert rows["neuzip_decode_gbs"]["anchor"] == "neuzip_copy_gbs" and "new_vs_anchor" in rows["neuzip_decode_gbs"]
    assert len(rows["neuzip_decode_gbs"]["new_runs"]) == 2  # new, old, new again
    assert doc["extra"]["baseline_commit"] == "self"
    assert {"neuzip/new", "neuzip/old", "neuzip/new2"} <= set(doc["extra"]["section_wall_s"])
    old_notes = doc["extra"]["trees"]["old"][0]["notes"]
    assert old_notes["env"]["TRITON_ALLOW_NON_CONSTEXPR_GLOBALS"] == "1"
    assert old_notes["thrifty_file"].startswith(str(ROOT / "src"))
    assert "new/old" in out


def test_smoke_other_sections_without_baseline(tmp_path):
    doc, out = _run(tmp_path, "--sections", "attention,cce,bitnet,shadowkv,e2e")
    rows = _values(doc)
    measured = ["attn_d64_gqa_8k_tflops", "attn_d64_gqa_8k_kernel_tflops", "attn_d128_gqa_32k_tflops",
                "cce_loss_grad_ms", "cce_compile_loss_grad_ms", "bitnet_int8_gbs", "bitnet_int4_gbs",
                "bitnet_topk_int8_gbs", "bitnet_fp_step_ms", "bitnet_a48_step_ms", "shadowkv_step_ms",
                "shadowkv_dense_step_ms", "e2e_prefill_8k_ms", "e2e_prefill_8k_sdpa_ms", "e2e_decode_4k_ms_per_token",
                "e2e_train_2k_ms", "e2e_train_2k_cce_only_ms"]
    for fig in measured:
        assert rows[fig].get("error") is None, rows[fig]
        assert rows[fig]["new"] > 0 and rows[fig]["old"] is None
        assert fig in doc["summary"] and f"{fig}_vs_baseline" not in doc["summary"]
    assert "needs CUDA" in rows["cce_apple_loss_grad_ms"]["error"]  # an error row; the section went on
    assert doc["extra"]["baseline"] is None


def test_merge_ratios_and_errors():
    mod = _load()
    row = lambda label, fig, value, **kw: dict(section="s", figure=fig, unit="ms", value=value,  # noqa: E731
                                               higher_is_better=False, spread_pct=2.0, **kw)
    runs = [dict(label="new", rows=[row("new", "a", 10.0, kind="anchor"), row("new", "f", 5.0, anchor="a")]),
            dict(label="old", rows=[row("old", "a", 11.0, kind="anchor"), row("old", "f", 6.0, anchor="a"),
                                    dict(section="s", figure="g", error="boom")]),
            dict(label="new2", rows=[row("new2", "a", 10.0, kind="anchor"), row("new2", "f", 4.0, anchor="a")])]
    rows = {r["figure"]: r for r in mod.merge(runs)}
    f = rows["f"]
    assert f["new"] == pytest.approx(4.5) and f["old"] == 6.0 and f["new_over_old"] == pytest.approx(0.75)
    assert f["change_pct"] == pytest.approx(100 * (1 / 0.75 - 1))  # lower is better: faster is positive
    assert f["aba_pct"] == pytest.approx(100 * 1.0 / 4.5)
    assert f["new_vs_anchor"] == pytest.approx(0.45) and f["old_vs_anchor"] == pytest.approx(6 / 11)
    assert rows["g"]["error"] == "old: boom" and rows["g"]["new"] is None
    assert mod._short_anchor(dict(figure="attn_d64_8k_tflops", anchor="attn_d64_8k_cudnn_tflops")) == "cudnn"
