"""Regression tests of issue #22 ("nothing lost, nothing silent"): one per class of problem found; each failed
before its fix. The property-based suite (tests/test_fuzz.py) covers the same ground with random inputs."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from thrifty import neuzip
from thrifty.attention import SageConfig, accuracy_metrics, exact_attention, sage_attention
from thrifty.loss import linear_cross_entropy
from thrifty.models import LlamaForCausalLM
from thrifty.models.llama import LlamaConfig
from thrifty.train import Trainer, TrainConfig
from thrifty.triton_utils import interpreting

NAN = math.nan
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1)


# ---------------------------------------------------------------------------------- checks let NaN through
@pytest.mark.parametrize("make", [
    lambda: TrainConfig(grad_clip=NAN), lambda: TrainConfig(lr=NAN), lambda: TrainConfig(betas=(NAN, 0.9)),
    lambda: TrainConfig(betas=(0.9,)), lambda: TrainConfig(seed=-1),
    lambda: LlamaConfig(**TINY, rope_theta=NAN), lambda: LlamaConfig(**TINY, rope_theta=-1.0),
    lambda: LlamaConfig(**TINY, rms_norm_eps=-1e-5), lambda: LlamaConfig(**TINY, head_dim=0),
    lambda: LlamaConfig(**TINY, head_dim=-2),
], ids=["grad_clip", "lr", "betas-nan", "betas-len", "seed", "rope_theta-nan", "rope_theta-neg", "rms_norm_eps",
        "head_dim-0", "head_dim-neg"])
def test_configs_refuse_nan_and_bad_fields_by_name(make):
    with pytest.raises((ValueError, TypeError)) as info:
        make()
    name = info.value.args[0].split(":")[0].split("[")[0]
    assert name in ("grad_clip", "lr", "betas", "seed", "rope_theta", "rms_norm_eps", "head_dim")


@pytest.mark.parametrize("kw", [dict(label_smoothing=NAN), dict(z_loss=math.inf), dict(softcap=NAN)])
def test_loss_options_refuse_nan(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long), **kw)


# ------------------------------------------------------------------------------------------ neuzip files
def test_neuzip_file_holds_empty_zero_d_and_every_safetensors_dtype(tmp_path):
    from thrifty.neuzip.format import _DTYPE_NAMES

    entries = {"empty": neuzip.compress(torch.zeros(0, 3, dtype=torch.bfloat16)),
               "scalar": neuzip.compress(torch.tensor(-0.0)), "plain_empty": torch.zeros(0, 2)}
    for name, dtype in _DTYPE_NAMES.items():
        entries[f"raw_{name}"] = torch.arange(6 * torch.empty((), dtype=dtype).element_size(),
                                              dtype=torch.uint8).view(dtype).reshape(2, -1)
    neuzip.save(tmp_path / "a.nz", entries)
    back = neuzip.load(tmp_path / "a.nz")
    assert back["empty"].decompress().shape == (0, 3)
    assert back["scalar"].decompress().shape == () and str(back["scalar"].decompress().item()) == "-0.0"
    for name in _DTYPE_NAMES:
        a, b = entries[f"raw_{name}"], back[f"raw_{name}"]
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _forged_plain(path, shape, data=b""):
    from safetensors.numpy import save_file

    import zlib
    meta = {"x": {"codec": "plain", "dtype": "float32", "shape": shape, "crc32": zlib.crc32(data)}}
    save_file({"x::data": np.frombuffer(data, np.uint8).copy()}, str(path),
              metadata={"thrifty.neuzip.format": "3", "thrifty.neuzip.tensors": json.dumps(meta)})


@pytest.mark.parametrize("shape", [[2**32, 2**32], [2**62, 4], [-1, 0], [1.5], [True], ["3"], [1] * 65])
def test_neuzip_header_counts_cannot_overflow(tmp_path, shape):
    _forged_plain(tmp_path / "f.nz", shape)  # 2**64 elements is 0 in int64: matched the empty data before
    with pytest.raises(ValueError, match="f.nz"):
        neuzip.load(tmp_path / "f.nz")


def test_neuzip_save_refuses_before_writing(tmp_path):
    target = tmp_path / "keep.nz"
    target.write_bytes(b"precious")
    with pytest.raises(ValueError, match="::"):
        neuzip.save(target, {"a::b": torch.randn(3)})
    with pytest.raises(ValueError, match="does not exist"):
        neuzip.save(tmp_path / "missing" / "x.nz", {"a": torch.randn(3)})
    assert target.read_bytes() == b"precious" and sorted(os.listdir(tmp_path)) == ["keep.nz"]


# -------------------------------------------------------------------------------------------- neuzip CLI
def _model_file(path):
    from safetensors.torch import save_file

    tensors = {"w": torch.randn(64, 64, dtype=torch.bfloat16), "empty": torch.zeros(0),
               "f8": torch.randn(4).to(torch.float8_e4m3fn), "u16": torch.arange(3, dtype=torch.int16).view(torch.uint16),
               "scalar": torch.tensor(2.5), "half_empty": torch.zeros(0, 3, dtype=torch.float16)}
    save_file(tensors, str(path))
    return tensors


def test_cli_compress_round_trips_what_it_cannot_code(tmp_path):
    from safetensors.torch import load_file

    from thrifty.cli import main

    tensors = _model_file(tmp_path / "m.safetensors")
    assert main(["compress", str(tmp_path / "m.safetensors"), str(tmp_path / "m.nz")]) == 0
    assert main(["decompress", str(tmp_path / "m.nz"), str(tmp_path / "back.safetensors")]) == 0
    back = load_file(str(tmp_path / "back.safetensors"))
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape
        assert torch.equal(back[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def _one_line_exit_2(capsys, fn, argv, match):
    rc = fn(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("thrifty")]
    assert rc == 2 and len(lines) == 1 and match in lines[0] and "Traceback" not in err, err


def test_cli_user_errors_are_one_line_exit_2(tmp_path, capsys, monkeypatch):
    from thrifty.cli import main

    src = tmp_path / "m.safetensors"
    _model_file(src)
    before = src.read_bytes()
    _one_line_exit_2(capsys, main, ["compress", str(src), str(src)], "is the input file")
    (tmp_path / "link").symlink_to(src)
    _one_line_exit_2(capsys, main, ["compress", str(src), str(tmp_path / "link")], "is the input file")
    assert src.read_bytes() == before
    _one_line_exit_2(capsys, main, ["compress", str(src), str(tmp_path / "no" / "x.nz")], "does not exist")
    from safetensors.torch import save_file
    save_file({"a::b": torch.randn(3)}, str(tmp_path / "odd.safetensors"))
    _one_line_exit_2(capsys, main, ["compress", str(tmp_path / "odd.safetensors"), str(tmp_path / "o.nz")], "a::b")
    assert main(["compress", str(src), str(tmp_path / "m.nz")]) == 0
    capsys.readouterr()
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        _one_line_exit_2(capsys, main, ["decompress", str(tmp_path / "m.nz"), str(tmp_path / "b.safetensors"),
                                        "--impl", "triton"], "--impl triton")
    _one_line_exit_2(capsys, main, ["demo", "--device", "nonsense"], "--device")
    _one_line_exit_2(capsys, main, ["pretrain", "--preset", "nonsense"], "preset")


# ------------------------------------------------------------------------------------------------ attention
def _qkv(D=16, S=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, S, D, generator=g) for _ in range(3)]


IMPLS = ["reference"] + (["triton"] if interpreting() or torch.cuda.is_available() else [])


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_nan_query_gives_nan_row_not_zeros(impl):
    q, k, v = _qkv(D=64)
    q[0, 0, 3, 5] = NAN
    out, lse = sage_attention(q, k, v, impl=impl, return_lse=True)
    assert out[0, 0, 3].isnan().all() and lse[0, 0, 3].isnan()
    out[0, 0, 3] = 0
    assert out.isfinite().all()


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_nan_key_with_smoothing_stays_in_the_rows_that_see_it(impl):
    q, k, v = _qkv(D=64, S=12)
    k[0, 1, 7, 0] = NAN
    out = sage_attention(q, k, v, causal=True, impl=impl, config=SageConfig(smooth_k=True))
    assert out[0, 1, 7:].isnan().all() and out[0, 1, :7].isfinite().all() and out[0, 0].isfinite().all()
    ref = exact_attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], causal=True)
    assert accuracy_metrics(out[0, 1, :7], ref[0, 1])["cos_sim"] > 0.99  # rows before the bad key: right


def test_attention_refuses_nan_scale_and_degenerate_heads():
    q, k, v = _qkv()
    for bad in (NAN, math.inf, 0.0):
        with pytest.raises(ValueError, match="sm_scale"):
            sage_attention(q, k, v, sm_scale=bad)
    with pytest.raises(ValueError, match="head"):
        sage_attention(*(torch.randn(1, 0, 4, 8) for _ in range(3)))
    with pytest.raises(ValueError, match="head_dim"):
        sage_attention(*(torch.randn(1, 2, 4, 0) for _ in range(3)))


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_empty_sizes_give_the_documented_result(impl):
    D = 64
    out = sage_attention(torch.randn(0, 2, 4, D), torch.randn(0, 2, 4, D), torch.randn(0, 2, 4, D), impl=impl)
    assert out.shape == (0, 2, 4, D)
    out, lse = sage_attention(torch.randn(1, 2, 3, D), torch.randn(1, 2, 0, D), torch.randn(1, 2, 0, D), impl=impl,
                              return_lse=True)
    assert torch.equal(out, torch.zeros(1, 2, 3, D)) and (lse == -math.inf).all()
    assert sage_attention(torch.randn(1, 2, 0, D), *_qkv(D=D)[1:], impl=impl).shape == (1, 2, 0, D)


# ------------------------------------------------------------------------------------- model and checkpoints
class _Data:
    def batch(self, b, s, generator=None):
        x = torch.randint(0, 64, (b, s + 1), generator=generator)
        return x[:, :-1], x[:, 1:]


def _trainer(seed=0):
    return Trainer(LlamaForCausalLM(LlamaConfig(**TINY)).init_weights(seed=seed), _Data(),
                   config=TrainConfig(steps=1, batch_size=1, seq_len=4))


@pytest.mark.parametrize("damaged", ["optimizer.safetensors", "trainer_state.json", "model.safetensors"])
def test_damaged_checkpoint_is_refused_before_the_model_changes(tmp_path, damaged):
    t = _trainer()
    t.train_step()
    t.save_checkpoint(tmp_path)
    raw = (tmp_path / damaged).read_bytes()
    (tmp_path / damaged).write_bytes(raw[: len(raw) * 2 // 3])
    fresh = _trainer(seed=1)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(ValueError, match=damaged):
        fresh.load_checkpoint(tmp_path)
    assert all(torch.equal(before[k], v) for k, v in fresh.model.state_dict().items()) and fresh.step == 0


def test_checkpoint_weights_carry_a_checksum(tmp_path):
    model = LlamaForCausalLM(LlamaConfig(**TINY)).init_weights(seed=0)
    model.save_pretrained(tmp_path)
    raw = bytearray((tmp_path / "model.safetensors").read_bytes())
    raw[-3] ^= 0x40  # a flipped bit in the last weight: still a valid safetensors file
    (tmp_path / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="checksum"):
        LlamaForCausalLM.from_pretrained(tmp_path)


def test_from_pretrained_errors_name_the_file(tmp_path):
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        LlamaForCausalLM.from_pretrained(tmp_path)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "hidden_size": 64}))
    with pytest.raises(ValueError, match="model.safetensors"):
        LlamaForCausalLM.from_pretrained(tmp_path)


def test_model_refuses_empty_input_ids():
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(1, 0, dtype=torch.long))


# ------------------------------------------------------------------------------------ transformers integration
def _hf_model():
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM as HFLlama

    return HFLlama(HFConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1))


def test_hf_integrations_check_options_when_enabled():
    from thrifty.attention import enable_hf
    from thrifty.loss.hf import patch_causal_lm

    with pytest.raises(TypeError, match="config"):
        enable_hf(_hf_model(), config={"qk_bits": 4})
    with pytest.raises(ValueError, match="impl"):
        enable_hf(_hf_model(), impl="fast")
    with pytest.raises(TypeError, match="foo"):
        enable_hf(_hf_model(), foo=1)
    with pytest.raises(TypeError, match="model"):
        enable_hf(LlamaForCausalLM(LlamaConfig(**TINY)))
    with pytest.raises(ValueError, match="label_smoothing"):
        patch_causal_lm(_hf_model(), label_smoothing=NAN)
    model = patch_causal_lm(_hf_model()).train()
    ids = torch.randint(0, 64, (1, 5))
    with pytest.raises(ValueError, match="num_items_in_batch"):
        model(ids, labels=ids, num_items_in_batch=0)


# ---------------------------------------------------------------------------- second round of edge cases
def test_positions_cache_and_plans_fail_clearly(tmp_path):
    from thrifty.attention import load_plan, plan_from_scores, save_plan, sage_seam
    from thrifty.models.llama import KVCache

    model = LlamaForCausalLM(LlamaConfig(**TINY))
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="positions"):  # wrapped around the RoPE table silently before
        model(ids, positions=torch.tensor([-1, 0, 1]))
    cache = KVCache()
    model(ids, cache=cache)
    with pytest.raises(ValueError, match="cache"):
        model(torch.zeros(2, 1, dtype=torch.long), cache=cache)
    with pytest.raises(TypeError, match="config"):
        sage_seam(config={"qk_bits": 5})
    with pytest.raises(ValueError, match="scores"):
        plan_from_scores({0: NAN}, 0.5)
    (tmp_path / "p.json").write_text('{"format": "thrifty.sage_plan/1"}')
    with pytest.raises(ValueError, match="p.json"):
        load_plan(tmp_path / "p.json")
    with pytest.raises(ValueError, match="does not exist"):
        save_plan({0: 4}, tmp_path / "missing" / "p.json")


def test_trainer_edge_cases_fail_clearly(tmp_path):
    class NoEval(_Data):
        def iter_eval_batches(self, b, s, n):
            return iter([])

    with pytest.raises(TypeError, match="config"):
        Trainer(LlamaForCausalLM(LlamaConfig(**TINY)), _Data(), config={"steps": 1})
    with pytest.raises(ValueError, match="model"):
        Trainer(torch.nn.ReLU(), _Data())
    t = Trainer(LlamaForCausalLM(LlamaConfig(**TINY)), _Data(), NoEval(), TrainConfig(steps=1, batch_size=1, seq_len=4))
    with pytest.raises(ValueError, match="no batch"):  # ZeroDivisionError before
        t.evaluate()
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        t.save_checkpoint(tmp_path / "f")


def test_trainer_state_carries_a_checksum(tmp_path):
    t = _trainer()
    t.train_step()
    t.save_checkpoint(tmp_path)
    state = (tmp_path / "trainer_state.json").read_text()
    (tmp_path / "trainer_state.json").write_text(state.replace('"step": 1', '"step": 7'))  # still valid JSON
    with pytest.raises(ValueError, match="checksum"):
        _trainer(seed=1).load_checkpoint(tmp_path)


def test_calibrate_refuses_nan_instead_of_choosing_4_bits():
    from thrifty.attention import calibrate

    model = LlamaForCausalLM(LlamaConfig(**TINY)).init_weights(seed=0)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[0, 0] = NAN
    with pytest.raises(ValueError, match="NaN"):  # min(1.0, nan) kept 1.0: "4 bits is fine" before
        calibrate(model, [torch.randint(0, 64, (1, 8))], threshold=0.99)


def test_written_files_get_ordinary_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        neuzip.save(tmp_path / "a.nz", {"a": torch.randn(3)})
    finally:
        os.umask(old)
    assert (tmp_path / "a.nz").stat().st_mode & 0o777 == 0o644  # not the 0600 of a temporary file


@pytest.mark.parametrize("layout_rows", [1, 4, 16])
def test_short_query_route_keeps_nan_rows(layout_rows):
    """Queries of 1-16 rows go to SDPA; torch's CPU flash SDPA returns zeros for a NaN query row."""
    from thrifty import sage_attention

    q = torch.randn(1, 2, layout_rows, 64)
    k, v = torch.randn(1, 1, 32, 64), torch.randn(1, 1, 32, 64)
    q[0, 1, -1, 3] = NAN
    out = sage_attention(q, k, v, causal=True)
    assert out[0, 1, -1].isnan().all()
    assert out[0, 0].isfinite().all() and out[0, 1, :-1].isfinite().all()
