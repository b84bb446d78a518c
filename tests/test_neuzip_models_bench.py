"""CPU smoke run of benchmarks/neuzip_models.py's training part (tiny model, 3 steps per variant): every code path
of the Table 1 rows runs, and lossless NeuZip keeps the losses of the same optimizer bit for bit."""

import json
from pathlib import Path

from script_module import load_script

def _bench_module():
    return load_script("benchmarks/neuzip_models.py", "neuzip_models_bench")


def test_neuzip_models_training_smoke(capsys):
    mod = _bench_module()
    assert mod.main(["--smoke", "--skip-infer", "--check-identity"]) == 0
    out = capsys.readouterr().out
    path = Path(out.strip().splitlines()[-1].split("wrote ", 1)[1])
    doc = json.loads(path.read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert not [r for r in rows.values() if "error" in r], rows
    assert doc["summary"]["train_loss_identical"] == 1
    assert "train_speed_ratio_vs_vanilla" in doc["summary"]
    assert rows["LOMO AdamW 8-bit states + NeuZip lossless"]["weights_ratio_vs_bf16"] < 0.75
    # the deterministic pair ran, and every row has its profiled step split into phases
    assert doc["summary"]["train_loss_identical_deterministic"] == 1
    assert "LOMO AdamW 8-bit states + NeuZip lossless [deterministic]" in rows
    packed = rows["LOMO AdamW 8-bit states + NeuZip lossless"]
    assert packed["phase_reencode_calls"] > 0 and packed["phase_update_calls"] > 0 and packed["phase_decode_calls"] > 0
    assert all(r["phase_step_ms"] > 0 and "phase_backward_host_ms" in r for r in rows.values())
    assert "phase_update_calls" not in rows["vanilla AdamW"]


def test_neuzip_models_real_text_identity_smoke():
    """The real-text identity rows: a small trained-shape model, LOMO AdamW 8-bit states on the corpus's train
    split without and with NeuZip lossless: both losses lists exist, and they are equal."""
    import pytest
    import torch

    from thrifty.models import LlamaForCausalLM, preset
    from thrifty.paths import data_dir

    if not (data_dir() / "corpus" / "manifest.json").is_file():
        pytest.skip("no prepared corpus (thrifty setup)")
    mod = _bench_module()
    base = LlamaForCausalLM(preset("tiny")).init_weights(seed=0).to(torch.bfloat16)
    args = mod.argparse.Namespace(smoke=True)
    rows = mod.real_text_identity_rows(args, torch.device("cpu"), base)
    assert [r.get("error") for r in rows] == [None, None]
    assert len(rows[0]["losses"]) == 2 and rows[0]["losses"][0] > 0
    summary = mod._real_text_summary(rows)
    assert summary["train_loss_identical_real_text"] == 1 and summary["train_loss_max_gap_real_text"] == 0
