"""The model verbs: ``setup`` (real model + corpus), ``demo`` (the five techniques against the plain model),
``optimize``, ``pretrain`` and ``eval``. Each ``add_<verb>`` declares its arguments; torch and the data code are
imported when a verb runs, so that ``thrifty --help`` stays instant."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

# Names spelled out so that `thrifty --help` imports no torch (tests keep them equal to the library's):
OPTIMIZE_PRESETS = ("train-memory", "train-bitnet", "serve-long-context", "serve-small",  # thrifty.compose.PRESETS
                    "serve-bitnet")
MODEL_PRESETS = ("tiny", "30m", "60m", "135m", "1b")  # thrifty.models.PRESETS
BITNET_RECIPES = ("fp", "b1.58", "a4.8", "a4.8-fp4", "int4-all")  # thrifty.bitnet.RECIPES
LOSS_IMPLS = ("torch", "auto", "triton", "reference")  # "torch": the model's own loss, else a thrifty.loss impl
CORPUS_HELP = "a folder of text files to use instead of the Debian docs"


# Argument types: a bad number is refused while the command line is parsed, i.e. before any corpus, model or
# checkpoint work, as one line that names the option ("argument --steps: expected an int >= 1, got -3").
def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an int >= {lo}, got {value}")
        return value

    return parse


def _float_in(lo: float, hi: float, lo_open: bool = False):
    """A finite float in [lo, hi] ((lo, hi] with ``lo_open``; hi may be math.inf)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        if not math.isfinite(value) or value < lo or (lo_open and value == lo) or value > hi:
            wanted = f"a number {'>' if lo_open else '>='} {lo:g}" if math.isinf(hi) else \
                f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text}")
        return value

    return parse


_POSITIVE, _NON_NEGATIVE = _int_at_least(1), _int_at_least(0)


def _device(name: str):
    from ..data.locate import resolve_device

    return resolve_device(name)


def _corpus(corpus_dir, max_mb=None, reuse=False):
    from ..data.locate import corpus_path

    return corpus_path(corpus_dir, max_mb, reuse)


def cmd_setup(args) -> int:
    from .. import pretrained

    path = pretrained.ensure_converted()
    print(f"model: {path}")
    corpus = _corpus(args.corpus, args.max_mb)
    print(f"corpus: {corpus}")
    return 0


def cmd_demo(args) -> int:
    """The five techniques on the real SmolLM2 and corpus against the plain model (see thrifty.demo)."""
    from ..demo import SIZES, format_table, run_demo

    device = _device(args.device)
    size = SIZES["quick" if args.quick else ("gpu" if device.type == "cuda" else "cpu")]
    report = run_demo(device, size, Path(args.out), corpus_dir=args.corpus)
    print(format_table(report))
    print(f"report, loss curves and memory bars: {Path(args.out).resolve()}/"
          "{demo.json, loss_curves.png, memory.png}")
    return 0


def cmd_optimize(args) -> int:
    """Applies a preset to a checkpoint and prints thrifty.describe: a BitNet checkpoint of ``thrifty pretrain
    --recipe ...`` as thrifty's model with its BitLinear layers, any other through transformers (default: the real
    SmolLM2). serve-bitnet with ``--out`` writes the packed model (thrifty.bitnet.export)."""
    import thrifty

    config = thrifty.OptimizeConfig.preset(args.preset)
    if args.out is not None and not config.pack_bitnet:
        raise ValueError(f"--out: only serve-bitnet writes a model (the packed BitNet export); {args.preset} sets up "
                         "a loaded model to train or serve in this process (BitNet before training, cut "
                         "cross-entropy, quantized attention, KV caches, NeuZip in memory): drop --out (to store "
                         "NeuZip-compressed weights: `thrifty compress`)")
    device = _device(args.device)  # a bad --device is refused before any model is converted or loaded
    path, bitnet = _checkpoint(args.model, config)
    out = None if args.out is None else _packed_out(Path(args.out), path)
    model = _load_checkpoint(path, bitnet, config, device)
    try:
        thrifty.optimize(model, config)
    except TypeError as err:  # a model thrifty.optimize does not know (not of the Llama family)
        raise ValueError(f"--model: {str(err).removeprefix('model: ')}") from None
    print(thrifty.describe(model))
    if out is not None:
        _write_packed(model, out)
    return 0


def _write_packed(model, out: Path) -> None:
    from ..bitnet import export

    export(model, out)
    print(f"packed model: {out} ({out.stat().st_size / 2**20:.1f} MB; thrifty.models.LlamaForCausalLM.from_packed "
          "loads it)")


def _checkpoint(model_arg, config) -> tuple:
    """(--model's folder, whether it is a thrifty BitNet checkpoint), checked; the default is the real SmolLM2
    (converted on first use). A preset that packs BitNet layers refuses a full-precision one here, unloaded."""
    from .._io import read_json
    from ..bitnet.recipes import CHECKPOINT_KEY

    if model_arg is None and config.pack_bitnet:
        raise ValueError(_full_precision("the default SmolLM2"))
    if model_arg is None:
        from .. import pretrained

        return pretrained.ensure_converted(progress=False), False
    path = Path(model_arg)
    if not (path / "config.json").is_file():  # transformers would take it for a hub name
        raise FileNotFoundError(f"--model: {path} is not a checkpoint folder (no config.json): expected a "
                                "transformers checkpoint or one `thrifty pretrain` wrote")
    try:
        hf = read_json(path / "config.json", "model config")
    except ValueError as err:
        raise ValueError(f"--model: {err}") from None
    bitnet = isinstance(hf, dict) and CHECKPOINT_KEY in hf
    if config.pack_bitnet and not bitnet:
        raise ValueError(_full_precision(path))
    return path, bitnet


def _full_precision(where) -> str:
    return (f"--model: {where} is not a BitNet checkpoint (its config.json records no BitNet recipe), so "
            "pack_bitnet has no BitLinear layer to pack. Train a BitNet model first with `thrifty pretrain --recipe "
            "b1.58 --out DIR` and pass --model DIR (in Python: the \"train-bitnet\" preset, then \"serve-bitnet\")")


def _load_checkpoint(path: Path, bitnet: bool, config, device):
    """A thrifty BitNet checkpoint as thrifty's LlamaForCausalLM, its BitLinears rebuilt from the recipe its
    config.json records; any other folder through transformers. Loading errors are one line naming --model."""
    import torch

    # lossy NeuZip codes bf16 weights; the other presets keep the checkpoint's fp32
    dtype = torch.bfloat16 if config.neuzip is not None and config.neuzip.kept_bits is not None else torch.float32
    try:
        if bitnet:
            from ..models import LlamaForCausalLM

            return LlamaForCausalLM.from_pretrained(path, dtype=dtype, device=device).eval()
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    except (ValueError, OSError) as err:  # transformers' messages can span lines
        raise ValueError(f"--model: {' '.join(str(err).split())}") from None


def _packed_out(out: Path, checkpoint: Path) -> Path:
    """serve-bitnet's --out: a new file, never the input checkpoint folder or anything in it (a .safetensors
    there would also become part of that checkpoint)."""
    from .._io import check_output_path

    if checkpoint.resolve() in (out.resolve(), *out.resolve().parents):
        raise ValueError(f"--out: {out} is in the input checkpoint {checkpoint} (--model); an output never "
                         "overwrites or adds to its input: write it elsewhere")
    return check_output_path("--out", out, *(f for f in checkpoint.iterdir() if f.is_file()))


def cmd_pretrain(args) -> int:
    """Pre-trains a preset-sized reference model from scratch on the corpus; writes checkpoint, history, plot.
    Under ``torchrun --nproc-per-node N`` the model is sharded with FSDP2 (thrifty.parallel): --batch-size is
    then per rank, and rank 0 writes history and plot (every rank its checkpoint shard)."""
    import torch

    from .. import parallel
    from ..data import TokenDataset
    from ..models import LlamaForCausalLM, preset
    from ..train import Trainer, TrainConfig

    distributed = parallel.launched_by_torchrun()
    device = parallel.init_distributed() if distributed else _device(args.device)
    lead = not distributed or torch.distributed.get_rank() == 0
    if not lead:
        torch.distributed.barrier()  # rank 0 builds the corpus if needed, the others wait
    corpus = _corpus(args.corpus, reuse=True)
    if distributed and lead:
        torch.distributed.barrier()
    train, val = TokenDataset(corpus, "train"), TokenDataset(corpus, "validation")
    with torch.device(device):
        model = LlamaForCausalLM(preset(args.preset)).init_weights(seed=args.seed)
    if args.loss != "torch":
        import functools

        from ..loss import lm_loss

        model.set_loss(functools.partial(lm_loss, impl=args.loss))
    schedule = None
    if args.recipe != "fp":  # BitNet: ternary weights, quantized activations; a4.8 trains two-stage from b1.58
        from ..bitnet import build_for_pretraining

        schedule = build_for_pretraining(model, args.recipe, stage1_share=args.stage1_share)
    if args.compile:
        model.model.compile()
    if distributed:
        parallel.shard_model(model)
    out = Path(args.out)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      warmup_steps=max(1, args.steps // 20), eval_every=args.eval_every, eval_batches=8,
                      checkpoint_dir=str(out), seed=args.seed)
    trainer = Trainer(model, train, val, cfg, schedule=schedule)
    history = trainer.fit(progress=lead)
    if not lead:
        return 0
    (out / "history.json").write_text(json.dumps(history))
    _plot_history(history, out / "loss.png", title=f"{args.preset} ({args.loss} loss) on {device}")
    last = history[-1]
    print(f"{args.preset}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"loss {history[0]['loss']:.3f} -> {last['loss']:.3f}, val ppl {last.get('val_ppl', float('nan')):.1f}, "
          f"{last['tokens_per_s']:,.0f} tokens/s; checkpoint in {out}")
    return 0


def _plot_history(history, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="train")
    evals = [h for h in history if "val_loss" in h]
    ax.plot([h["step"] for h in evals], [h["val_loss"] for h in evals], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_eval(args) -> int:
    """Validation perplexity of a checkpoint (NeuZip-compressed or not), optionally NeuZip-compressed first."""
    import torch

    from ..data import TokenDataset
    from ..evaluate import load_any_model, validation_perplexity
    from ..neuzip import compress_model

    device = _device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" or args.neuzip not in (None, "lossless") else torch.float32
    model = load_any_model(Path(args.model), device, dtype)
    if args.neuzip is not None:
        if getattr(model, "neuzip", None) is not None:
            raise ValueError("--neuzip: the checkpoint is already compressed")
        mode = "lossless" if args.neuzip == "lossless" else "lossy"
        compress_model(model, mode, None if mode == "lossless" else int(args.neuzip))
    val = TokenDataset(_corpus(args.corpus, reuse=True), "validation")
    t0 = time.perf_counter()
    r = validation_perplexity(model, val, args.batch_size, args.seq_len, args.batches, device)
    print(f"model: {args.model} ({_weights(model)}, {next(model.parameters()).dtype}, {device})")
    print(f"validation: {r['val_tokens']:,} tokens  loss {r['val_loss']:.4f}  perplexity {r['val_ppl']:.3f}  "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0


def _weights(model) -> str:
    """How the block weights are stored: uncompressed, or NeuZip's mode and ratio."""
    state = getattr(model, "neuzip", None)
    if state is None:
        return "uncompressed"
    lossy = f" k={state.config.mantissa_bits}" if state.config.mode == "lossy" else ""
    return f"NeuZip {state.config.mode}{lossy}, block weights {state.memory()['ratio_vs_bf16']:.3f}x bf16"


def add_setup(verbs) -> None:
    s = verbs.add_parser("setup", help="fetch and prepare the real model and the corpus (idempotent)")
    s.add_argument("--corpus", default=None, help=CORPUS_HELP)
    s.add_argument("--max-mb", type=_float_in(0.0, math.inf, lo_open=True), default=None,
                   help="cap the cleaned corpus (MB)")
    s.set_defaults(run=cmd_setup)


def add_demo(verbs) -> None:
    d = verbs.add_parser("demo", help="the five techniques on the real SmolLM2 against the plain model, one table "
                                      "(CPU by default, the whole model on a GPU when present)")
    d.add_argument("--corpus", default=None, help=CORPUS_HELP)
    d.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    d.add_argument("--quick", action="store_true", help="the smallest sizes (seconds; for tests)")
    d.add_argument("--out", default="runs/demo", help="folder for demo.json, loss_curves.png, memory.png")
    d.set_defaults(run=cmd_demo)


def add_optimize(verbs) -> None:
    o = verbs.add_parser("optimize", help="apply a thrifty.optimize preset to a model and describe it; "
                                          "serve-bitnet packs a BitNet model trained by `thrifty pretrain`",
                         description="Applies a thrifty.optimize preset to a checkpoint and prints thrifty.describe. "
                                     "serve-bitnet packs the BitLinear layers of a BitNet checkpoint (`thrifty "
                                     "pretrain --recipe b1.58 --out DIR`, then --model DIR) and with --out writes "
                                     "the packed model (thrifty.bitnet.export; LlamaForCausalLM.from_packed loads "
                                     "it).")
    o.add_argument("preset", choices=OPTIMIZE_PRESETS)
    o.add_argument("--model", default=None, metavar="DIR",
                   help="checkpoint folder: transformers, or `thrifty pretrain`'s (a BitNet one keeps its BitLinear "
                        "layers); default: the real SmolLM2 (full precision: not for serve-bitnet)")
    o.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    o.add_argument("--out", default=None, metavar="FILE",
                   help="serve-bitnet only: write the packed model to this .safetensors file (not into --model)")
    o.set_defaults(run=cmd_optimize)


def add_pretrain(verbs) -> None:
    t = verbs.add_parser("pretrain", help="pre-train a preset-sized model from scratch on the corpus")
    t.add_argument("--preset", default="30m", choices=MODEL_PRESETS, help="model size (thrifty.models.PRESETS)")
    t.add_argument("--corpus", default=None, help=CORPUS_HELP)
    t.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    t.add_argument("--steps", type=_POSITIVE, default=1000)
    t.add_argument("--batch-size", type=_POSITIVE, default=32)
    t.add_argument("--seq-len", type=_POSITIVE, default=512)
    t.add_argument("--lr", type=_float_in(0.0, 1.0, lo_open=True), default=1e-3)
    t.add_argument("--eval-every", type=_NON_NEGATIVE, default=100, help="0: only at the end")
    t.add_argument("--loss", default="torch", choices=LOSS_IMPLS,
                   help="torch (logits + F.cross_entropy) or a thrifty.loss impl")
    t.add_argument("--compile", action="store_true")
    t.add_argument("--recipe", default="fp", choices=BITNET_RECIPES, help="BitNet recipe (thrifty.bitnet); fp: none")
    t.add_argument("--stage1-share", type=_float_in(0.0, 1.0, lo_open=True), default=0.95,
                   help="BitNet: share of the steps in stage 1 (W1.58A8) before the recipe's own quantizers")
    t.add_argument("--seed", type=_NON_NEGATIVE, default=0)
    t.add_argument("--out", default="runs/pretrain", help="folder for the checkpoint, history.json and loss.png")
    t.set_defaults(run=cmd_pretrain)


def add_eval(verbs) -> None:
    e = verbs.add_parser("eval", help="validation perplexity of a model, NeuZip-compressed or not")
    e.add_argument("model", help="checkpoint folder (NeuZip, thrifty or HF Llama layout) or 'smollm2'")
    e.add_argument("--corpus", default=None, help=CORPUS_HELP)
    e.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    e.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                   help="weights of an uncompressed model (auto: bf16 on CUDA, fp32 on CPU)")
    e.add_argument("--neuzip", default=None, choices=("lossless", "0", "1", "3", "7"),
                   help="compress an uncompressed model first: lossless, or lossy k mantissa bits (bf16)")
    e.add_argument("--batches", type=_POSITIVE, default=8)  # 0 would print a perplexity of 1.0 over no tokens
    e.add_argument("--batch-size", type=_POSITIVE, default=4)
    e.add_argument("--seq-len", type=_POSITIVE, default=256)
    e.set_defaults(run=cmd_eval)
