"""``thrifty`` command line: ``setup`` (real model + corpus), ``demo`` (the five techniques against the plain model),
``pretrain``, ``stage``, and NeuZip's ``compress`` / ``decompress`` / ``eval``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# thrifty.compose.PRESETS, spelled out so that `thrifty --help` imports no torch (a test keeps them equal)
OPTIMIZE_PRESETS = ("train-memory", "train-bitnet", "serve-long-context", "serve-small")


def _device(name: str):
    from .data.locate import resolve_device  # imported on use: `thrifty --help` loads no data code

    return resolve_device(name)


def _corpus(corpus_dir, max_mb=None, reuse=False):
    from .data.locate import corpus_path

    return corpus_path(corpus_dir, max_mb, reuse)


def cmd_setup(args) -> int:
    from . import pretrained

    path = pretrained.ensure_converted()
    print(f"model: {path}")
    corpus = _corpus(args.corpus, args.max_mb)
    print(f"corpus: {corpus}")
    return 0


def cmd_demo(args) -> int:
    """The five techniques on the real SmolLM2 and corpus against the plain model (see thrifty.demo)."""
    from .demo import SIZES, format_table, run_demo

    device = _device(args.device)
    size = SIZES["quick" if args.quick else ("gpu" if device.type == "cuda" else "cpu")]
    report = run_demo(device, size, Path(args.out), corpus_dir=args.corpus)
    print(format_table(report))
    print(f"report, loss curves and memory bars: {Path(args.out).resolve()}/"
          "{demo.json, loss_curves.png, memory.png}")
    return 0


def cmd_optimize(args) -> int:
    """Applies a preset to a transformers checkpoint (default: the real SmolLM2) and prints thrifty.describe."""
    import torch
    from transformers import AutoModelForCausalLM

    import thrifty

    from . import pretrained

    config = thrifty.OptimizeConfig.preset(args.preset)
    path = args.model or pretrained.ensure_converted(progress=False)
    if not (Path(path) / "config.json").is_file():  # transformers would take it for a hub name
        raise FileNotFoundError(f"--model: {path} is not a transformers checkpoint folder (no config.json)")
    # lossy NeuZip codes bf16 weights; the other presets keep the checkpoint's fp32
    dtype = torch.bfloat16 if config.neuzip is not None and config.neuzip.kept_bits is not None else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(_device(args.device)).eval()
    thrifty.optimize(model, config)
    print(thrifty.describe(model))
    return 0


def cmd_pretrain(args) -> int:
    """Pre-trains a preset-sized reference model from scratch on the corpus; writes checkpoint, history, plot.
    Under ``torchrun --nproc-per-node N`` the model is sharded with FSDP2 (thrifty.parallel): --batch-size is
    then per rank, and rank 0 writes history and plot (every rank its checkpoint shard)."""
    import torch

    from . import parallel
    from .data import TokenDataset
    from .models import LlamaForCausalLM, preset
    from .train import Trainer, TrainConfig

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

        from .loss import lm_loss

        model.set_loss(functools.partial(lm_loss, impl=args.loss))
    schedule = None
    if args.recipe != "fp":  # BitNet: ternary weights, quantized activations; a4.8 trains two-stage from b1.58
        from .bitnet import build_for_pretraining

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="thrifty", description="thrifty: cheaper LLM training and serving")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="fetch and prepare the real model and the corpus (idempotent)")
    s.add_argument("--corpus", default=None, help="a folder of text files to use instead of the Debian docs")
    s.add_argument("--max-mb", type=float, default=None, help="cap the cleaned corpus (MB)")
    d = sub.add_parser("demo", help="the five techniques on the real SmolLM2 against the plain model, one table "
                                     "(CPU by default, the whole model on a GPU when present)")
    d.add_argument("--corpus", default=None, help="a folder of text files to use instead of the Debian docs")
    d.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    d.add_argument("--quick", action="store_true", help="the smallest sizes (seconds; for tests)")
    d.add_argument("--out", default="runs/demo", help="folder for demo.json, loss_curves.png, memory.png")
    o = sub.add_parser("optimize", help="apply a thrifty.optimize preset to a transformers model and describe it")
    o.add_argument("preset", choices=OPTIMIZE_PRESETS)
    o.add_argument("--model", default=None, help="a transformers checkpoint folder (default: the real SmolLM2)")
    o.add_argument("--device", default="auto")
    t = sub.add_parser("pretrain", help="pre-train a preset-sized model from scratch on the corpus")
    t.add_argument("--preset", default="30m")
    t.add_argument("--corpus", default=None)
    t.add_argument("--device", default="auto")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch-size", type=int, default=32)
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--loss", default="torch", help="torch (logits + F.cross_entropy) or a thrifty.loss impl")
    t.add_argument("--compile", action="store_true")
    t.add_argument("--recipe", default="fp", help="fp, b1.58, a4.8, a4.8-fp4 or int4-all (thrifty.bitnet)")
    t.add_argument("--stage1-share", type=float, default=0.95,
                   help="BitNet: share of the steps in stage 1 (W1.58A8) before the recipe's own quantizers")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default="runs/pretrain")
    sub.add_parser("stage", help="stage model + corpus onto the GPU box in parts (see thrifty stage -h)",
                   add_help=False)
    sub.add_parser("compress", help="NeuZip-compress a .safetensors file (see thrifty compress -h)", add_help=False)
    sub.add_parser("decompress", help="restore a NeuZip file to .safetensors (see thrifty decompress -h)",
                   add_help=False)
    sub.add_parser("eval", help="validation perplexity of a model, NeuZip-compressed or not (see thrifty eval -h)",
                   add_help=False)
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "stage":
        from .stage import main as stage_main

        return stage_main(rest)
    if args.cmd in ("compress", "decompress", "eval"):
        from .neuzip import cli as neuzip_cli

        return getattr(neuzip_cli, f"{args.cmd}_main")(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return {"setup": cmd_setup, "demo": cmd_demo, "pretrain": cmd_pretrain, "optimize": cmd_optimize}[args.cmd](args)
    except (ValueError, OSError) as err:  # bad input (thrifty's checks, missing files): one line, exit 2
        print(f"thrifty {args.cmd}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
