"""CPU smoke run of benchmarks/neuzip_models.py's training part (tiny model, 3 steps per variant): every code path
of the Table 1 rows runs, and lossless NeuZip keeps the losses of the same optimizer bit for bit."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_neuzip_models_training_smoke(capsys):
    spec = importlib.util.spec_from_file_location("neuzip_models_bench", ROOT / "benchmarks" / "neuzip_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
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
