"""The command line end to end on the real corpus built by `thrifty setup` (the README's set-up command)."""

import json
from pathlib import Path

import pytest

from thrifty.cli import main
from thrifty.paths import data_dir

needs_corpus = pytest.mark.skipif(not (data_dir() / "corpus" / "manifest.json").is_file(),
                                  reason="run `thrifty setup` first (scripts/setup.sh does)")


@needs_corpus
def test_demo_quick_reports_all_five_techniques(tmp_path, capsys, monkeypatch):
    import datetime

    import torch

    import thrifty

    monkeypatch.setenv("THRIFTY_COMMIT", "0123abc-test")  # what benchmarks/run_on_gpu.sh hands a copied tree
    assert main(["demo", "--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "demo.json").read_text())
    assert (r["commit"], r["thrifty"], r["torch"]) == ("0123abc-test", thrifty.__version__, torch.__version__)
    assert datetime.datetime.fromisoformat(r["date"]).utcoffset() == datetime.timedelta(0)
    rows = {row["technique"]: row["figures"] for row in r["rows"]}
    assert set(rows) == {"bitnet", "bitnet-packed", "cce", "neuzip", "attention", "shadowkv"}
    packed = rows["bitnet-packed"]  # the BitNet model trained in the demo, served packed vs unpacked
    assert abs(packed["val_loss"] - packed["val_loss_unpacked"]) <= 1e-4 * packed["val_loss_unpacked"]
    assert abs(packed["val_loss_unpacked"] - rows["bitnet"]["val_loss"]) <= 1e-4 * rows["bitnet"]["val_loss"]
    assert packed["linear_bytes_packed"] < packed["linear_bytes_bf16"] < packed["linear_bytes_latent"]
    assert packed["model_bytes_packed"] < packed["model_bytes_unpacked"]
    assert packed["packed_layers"] == 4 * 2  # per decoder layer: q/k/v stacked, o, gate/up stacked, down
    assert abs(rows["cce"]["loss"] - rows["cce"]["loss_plain"]) < 1e-3 * rows["cce"]["loss_plain"]
    assert rows["neuzip"]["val_loss"] == rows["neuzip"]["val_loss_plain"]  # lossless
    assert rows["neuzip"]["compressed_bytes"] < rows["neuzip"]["original_bytes"]
    assert rows["attention"]["quantized_calls"] > 0 and rows["attention"]["val_loss"] != rows["attention"]["val_loss_plain"]
    assert rows["shadowkv"]["host_bytes"] > 0
    assert len(r["loss_curves"]["plain"]) == r["size"]["train_steps"]
    assert (tmp_path / "loss_curves.png").stat().st_size > 1000 and (tmp_path / "memory.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert all(t in out for t in rows) and "vs" in out
    assert out.startswith("thrifty demo · ") and "commit 0123abc-test" in out.splitlines()[0]


def test_demo_report_names_its_commit_without_a_run(monkeypatch):
    """The provenance run_demo puts in demo.json (the checkout's HEAD when $THRIFTY_COMMIT is unset) and the
    table header naming the commit: no corpus or model needed."""
    import subprocess

    from thrifty.bench import git_commit
    from thrifty.demo import format_table, provenance

    monkeypatch.delenv("THRIFTY_COMMIT", raising=False)
    made_by = provenance()
    assert set(made_by) == {"commit", "thrifty", "torch", "date"} and made_by["commit"] == git_commit()
    if made_by["commit"] is not None:  # a source checkout
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
        assert made_by["commit"].removesuffix("-dirty") == head
    report = dict(made_by, model="m", device="cpu", seconds=1.0, rows=[])
    assert format_table(report).splitlines()[0] == f"thrifty demo · m · cpu · 1 s · commit {made_by['commit']}"
    assert "commit unknown" in format_table(dict(report, commit=None)).splitlines()[0]


def test_python_m_thrifty_help():
    import os
    import re
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    # -X importtime lists every module the command imported: the help of every verb needs no torch
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "thrifty", "--help"], capture_output=True,
                          text=True, env=env)
    assert done.returncode == 0 and all(verb in done.stdout for verb in VERBS)
    assert not re.search(r"\|\s+torch$", done.stderr, re.MULTILINE)


@needs_corpus
def test_pretrain_tiny_writes_checkpoint_and_plot(tmp_path):
    out = tmp_path / "run"
    assert main(["pretrain", "--preset", "tiny", "--steps", "6", "--batch-size", "2", "--seq-len", "32",
                 "--eval-every", "3", "--device", "cpu", "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and (out / "loss.png").is_file()
    history = json.loads((out / "history.json").read_text())
    assert len(history) == 6 and "val_loss" in history[2]


@needs_corpus
def test_pretrain_bitnet_then_serve_it_packed(tmp_path, capsys):
    """The README's BitNet path: `thrifty pretrain --recipe b1.58`, `thrifty optimize serve-bitnet --out`, and
    LlamaForCausalLM.from_packed on the file."""
    from thrifty import bitnet
    from thrifty.models import LlamaForCausalLM

    run, packed = tmp_path / "run", tmp_path / "packed.safetensors"
    assert main(["pretrain", "--preset", "tiny", "--recipe", "b1.58", "--steps", "2", "--batch-size", "2",
                 "--seq-len", "16", "--eval-every", "0", "--device", "cpu", "--out", str(run)]) == 0
    assert main(["optimize", "serve-bitnet", "--model", str(run), "--device", "cpu", "--out", str(packed)]) == 0
    model = LlamaForCausalLM.from_packed(packed)
    assert sum(isinstance(m, bitnet.PackedBitLinear) for m in model.modules()) == 2 * 7
    assert bitnet.read_header(packed)["recipe"] == "b1.58"


def test_unknown_preset_is_rejected():
    from thrifty.models import preset

    with pytest.raises(ValueError, match="preset"):
        preset("7b")


def test_compress_decompress_subcommands(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "w.safetensors"
    weights = {"a": (torch.randn(33, 17) * 0.02).bfloat16(), "b": torch.randn(5)}
    save_file(weights, str(src))
    assert main(["compress", str(src), str(tmp_path / "w.nz")]) == 0
    assert main(["decompress", str(tmp_path / "w.nz"), str(tmp_path / "back.safetensors")]) == 0
    back = load_file(str(tmp_path / "back.safetensors"))
    assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in weights.items())


def test_setup_with_own_corpus_folder(tmp_path):
    import shutil

    from thrifty.cli.commands import _corpus
    from thrifty.data import TokenDataset

    folder = tmp_path / "my_texts"
    folder.mkdir()
    prose = ("The kernel keeps track of every page of physical memory, and it records which process owns each "
             "page so that the memory can be returned when the process exits. ")
    for i in range(40):  # enough documents that the hash split puts some in validation
        (folder / f"doc{i}.txt").write_text(f"Document {i}. " + prose * 3 + "\n\n" + prose)
    built = _corpus(str(folder))
    try:
        assert built.name == "corpus-my_texts"
        train = TokenDataset(built, "train")
        assert train.num_tokens > 1000
    finally:
        shutil.rmtree(built)


def test_optimize_verb_describes_the_model(tmp_path, capsys):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from thrifty.cli.commands import OPTIMIZE_PRESETS
    from thrifty.compose import PRESETS

    assert OPTIMIZE_PRESETS == PRESETS
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path)
    assert main(["optimize", "train-bitnet", "--model", str(tmp_path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "bitnet    recipe a4.8: 14 BitLinear layers" in out and "cce       loss without logits" in out
    # a pretrained full-precision checkpoint has no BitLinear to pack: exit 2, one line (refused before loading:
    # no transformers progress either) naming --model, the reason and what to do instead
    err = _one_line_error(capsys, ["optimize", "serve-bitnet", "--model", str(tmp_path), "--device", "cpu"],
                          f"thrifty optimize: --model: {tmp_path} is not a BitNet checkpoint")
    assert "no BitLinear layer to pack" in err and "thrifty pretrain --recipe b1.58" in err and "train-bitnet" in err


def _one_line_error(capsys, argv, says) -> str:
    """A user error: exit status 2 and one line on stderr that names the verb and the problem; returns the line."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"thrifty {argv[0]}") and says in err, err
    return err


def _bitnet_checkpoint(folder, recipe="b1.58"):
    """What `thrifty pretrain --recipe RECIPE` writes (the Trainer's checkpoint of a BitNet reference model, its
    recipe in config.json), from two steps of a tiny model on random tokens: no corpus needed."""
    from thrifty.bench import RandomTokens
    from thrifty.bitnet import build_for_pretraining
    from thrifty.models import LlamaConfig, LlamaForCausalLM
    from thrifty.train import Trainer, TrainConfig

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).init_weights(seed=0)
    schedule = build_for_pretraining(model, recipe, stage1_share=0.5)
    cfg = TrainConfig(steps=2, batch_size=2, seq_len=16, warmup_steps=1, checkpoint_dir=str(folder))
    Trainer(model, RandomTokens(64), None, cfg, schedule=schedule).fit(progress=False)
    return folder


def _files(folder) -> dict:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


def test_optimize_serve_bitnet_packs_a_pretrained_bitnet_checkpoint(tmp_path, capsys):
    """`thrifty optimize serve-bitnet --model <pretrain checkpoint> --out F`: the model is loaded with its
    BitLinears, packed and described; F (thrifty.bitnet.export) loads back with thrifty.bitnet.load and gives the
    packed model's logits; the checkpoint is left as it was."""
    import torch

    import thrifty
    from thrifty import bitnet
    from thrifty.models import LlamaConfig, LlamaForCausalLM

    checkpoint = _bitnet_checkpoint(tmp_path / "run")
    before = _files(checkpoint)
    out = tmp_path / "packed.safetensors"
    assert main(["optimize", "serve-bitnet", "--model", str(checkpoint), "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "pack_bitnet 14 BitLinear layers packed 2-bit into 8 PackedBitLinear" in printed
    assert f"packed model: {out}" in printed and _files(checkpoint) == before
    head = bitnet.read_header(out)
    assert head["recipe"] == "b1.58" and len(head["layers"]) == 14
    loaded = LlamaForCausalLM(LlamaConfig(**head["model_config"]), linear=bitnet.packed_factory(head),
                              activation=bitnet.mlp_activation(head["recipe"]))
    bitnet.load(out, loaded)
    packed = thrifty.optimize(LlamaForCausalLM.from_pretrained(checkpoint).eval(), "serve-bitnet")  # as the verb
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids), packed(ids))


def test_optimize_serve_bitnet_user_errors_are_one_line(tmp_path, capsys, monkeypatch):
    import thrifty.pretrained as pretrained

    checkpoint = _bitnet_checkpoint(tmp_path / "run")
    serve = ["optimize", "serve-bitnet", "--device", "cpu", "--model"]
    # an output never overwrites (or adds to) its own input
    _one_line_error(capsys, serve + [str(checkpoint), "--out", str(checkpoint)], "--out: ")
    _one_line_error(capsys, serve + [str(checkpoint), "--out", str(checkpoint / "model.safetensors")],
                    "is in the input checkpoint")
    _one_line_error(capsys, serve + [str(checkpoint), "--out", str(tmp_path / "no" / "p.safetensors")],
                    "--out: the folder")
    # --out with a preset that writes nothing: refused before the model is looked at
    _one_line_error(capsys, ["optimize", "serve-long-context", "--model", str(tmp_path / "missing"), "--out",
                             str(tmp_path / "x.safetensors")], "--out: only serve-bitnet writes a model")
    # folders that are no checkpoint, or not a complete one
    (tmp_path / "empty").mkdir()
    _one_line_error(capsys, serve + [str(tmp_path / "empty")], "--model: ")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{")
    _one_line_error(capsys, serve + [str(tmp_path / "bad")], "corrupted model config")
    (checkpoint / "model.safetensors").rename(tmp_path / "weights.safetensors")
    (checkpoint / "optimizer.safetensors").unlink()
    _one_line_error(capsys, serve + [str(checkpoint)], "--model: ")
    # the default model is full precision: refused before SmolLM2 is converted or loaded
    monkeypatch.setattr(pretrained, "ensure_converted", lambda *a, **k: pytest.fail("SmolLM2 was loaded"))
    _one_line_error(capsys, ["optimize", "serve-bitnet", "--device", "cpu"],
                    "--model: the default SmolLM2 is not a BitNet checkpoint")
    # a BitNet recipe without an integer packed path: the library's reason, on one line
    _one_line_error(capsys, serve + [str(_bitnet_checkpoint(tmp_path / "fp4", "a4.8-fp4"))], "'fp4'")


def test_optimize_verb_user_errors_are_one_line(tmp_path, capsys):
    _one_line_error(capsys, ["optimize", "train-fast"], "invalid choice: 'train-fast'")
    _one_line_error(capsys, ["optimize", "train-bitnet", "--model", str(tmp_path / "missing"), "--device", "cpu"],
                    "no config.json")


VERBS = ("setup", "demo", "optimize", "pretrain", "eval", "compress", "decompress", "stage")


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_has_help(verb, capsys):
    with pytest.raises(SystemExit) as done:
        main([verb, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: thrifty {verb}")


@pytest.mark.parametrize("argv, says", [
    (["fly"], "invalid choice: 'fly'"),
    ([], "the following arguments are required: VERB"),
    (["demo", "--quik"], "unrecognized arguments: --quik"),
    (["pretrain", "--steps", "many"], "--steps: invalid int value: 'many'"),
    (["eval"], "the following arguments are required: model"),
    (["compress", "in.safetensors"], "the following arguments are required: out"),
    (["compress", "a", "b", "--steps", "100"], "--steps: invalid choice: 100"),
    (["decompress", "missing.nz", "out.safetensors", "--impl", "cuda"], "--impl: invalid choice: 'cuda'"),
    (["stage", "unpack"], "invalid choice: 'unpack'"),
])
def test_argument_errors_are_one_line(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("thrifty") and says in err and "--help" in err, err


@pytest.mark.parametrize("argv, says", [
    (["pretrain", "--steps", "-3"], "argument --steps: expected an int >= 1, got -3"),
    (["pretrain", "--lr", "0"], "argument --lr: expected a number in (0, 1], got 0"),
    (["pretrain", "--seq-len", "0", "--preset", "tiny"], "argument --seq-len: expected an int >= 1, got 0"),
    (["pretrain", "--recipe", "b2"], "argument --recipe: invalid choice: 'b2'"),
    (["eval", "smollm2", "--batches", "0"], "argument --batches: expected an int >= 1, got 0"),
    (["setup", "--max-mb", "-1"], "argument --max-mb: expected a number > 0, got -1"),
])
def test_bad_arguments_are_refused_before_any_work(argv, says, tmp_path, monkeypatch, capsys):
    """A bad number or name is one line and exit status 2 before any corpus, model or checkpoint work: the data
    folder stays untouched and none of the expensive steps is reached."""
    import thrifty.cli.commands as commands
    import thrifty.data.locate as locate
    import thrifty.pretrained as pretrained

    data = tmp_path / "data"
    monkeypatch.setenv("THRIFTY_DATA", str(data))
    reached = []
    for module, name in ((commands, "_corpus"), (commands, "_device"), (locate, "corpus_path"),
                         (pretrained, "ensure_converted")):
        monkeypatch.setattr(module, name, lambda *a, _name=name, **k: reached.append(_name))
    _one_line_error(capsys, argv, says)
    assert reached == [] and not data.exists()


def test_spelled_out_cli_names_match_the_library():
    from thrifty._checks import IMPLS
    from thrifty.bitnet.recipes import RECIPES
    from thrifty.cli import commands
    from thrifty.loss.cce import EXTRA_IMPLS
    from thrifty.models import PRESETS

    assert commands.MODEL_PRESETS == tuple(PRESETS)
    assert commands.BITNET_RECIPES == tuple(RECIPES)
    assert set(commands.LOSS_IMPLS) == set(IMPLS + EXTRA_IMPLS)


def test_missing_input_files_are_one_line(tmp_path, capsys):
    _one_line_error(capsys, ["decompress", str(tmp_path / "missing.nz"), str(tmp_path / "out.safetensors")],
                    "missing.nz")
    _one_line_error(capsys, ["compress", str(tmp_path / "missing.safetensors"), str(tmp_path / "out.nz")],
                    "cannot read")


def test_compress_choices_match_neuzip():
    from thrifty.cli import neuzip as verbs
    from thrifty.neuzip import reference

    assert (verbs.LANE_STEPS, verbs.DEFAULT_STEPS) == (reference.LANE_STEPS, reference.STEPS)


def test_no_technique_package_imports_the_cli():
    import ast
    from pathlib import Path

    import thrifty

    root = Path(thrifty.__file__).parent
    for package in ("attention", "bitnet", "kvcache", "loss", "neuzip"):
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    assert "cli" not in (node.module or "").split("."), f"{path} imports {node.module}"
