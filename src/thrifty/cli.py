"""``thrifty`` command line: ``setup`` (real model + corpus), ``demo`` (the pipeline end to end), ``stage``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEMO_PROMPT = "The Linux kernel manages memory by"


def _device(name: str):
    import torch

    from ._checks import check_device

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return check_device("--device", name)


def _corpus(corpus_dir, max_mb=None, reuse=False):
    """The Debian corpus by default; with ``--corpus DIR`` only that folder, built into its own data folder.
    ``reuse``: take a corpus already built by ``thrifty setup`` (whatever its size cap) as it is."""
    from .data import prepare_corpus
    from .paths import data_dir

    if corpus_dir is None:
        built = data_dir() / "corpus"
        if reuse and (built / "manifest.json").is_file():
            return built
        return prepare_corpus(max_mb=max_mb)
    name = Path(corpus_dir).resolve().name or "root"
    return prepare_corpus(out_dir=data_dir() / f"corpus-{name}", sources=(), corpus_dir=corpus_dir, max_mb=max_mb)


def cmd_setup(args) -> int:
    from . import pretrained

    path = pretrained.ensure_converted()
    print(f"model: {path}")
    corpus = _corpus(args.corpus, args.max_mb)
    print(f"corpus: {corpus}")
    return 0


def cmd_demo(args) -> int:
    """The reference model end to end on the corpus: perplexity, a few training steps, perplexity, generation."""
    import torch

    from . import pretrained
    from .data import TokenDataset
    from .models import LlamaForCausalLM, generate
    from .train import Trainer, TrainConfig

    device = _device(args.device)
    on_gpu = device.type == "cuda"
    steps = args.steps if args.steps is not None else (50 if on_gpu else 4)
    seq_len = args.seq_len or (512 if on_gpu else 256)
    batch = args.batch_size or (16 if on_gpu else 4)
    t0 = time.perf_counter()
    model_dir = pretrained.ensure_converted()
    tokenizer = pretrained.load_tokenizer()
    corpus = _corpus(args.corpus, reuse=True)
    train, val = TokenDataset(corpus, "train"), TokenDataset(corpus, "validation")
    model = LlamaForCausalLM.from_pretrained(model_dir, device=device)
    cfg = TrainConfig(steps=steps, batch_size=batch, seq_len=seq_len, lr=2e-5, warmup_steps=min(5, steps),
                      min_lr_ratio=1.0, weight_decay=0.0, eval_batches=args.eval_batches)
    trainer = Trainer(model, train, val, cfg)

    before = trainer.evaluate()
    history = trainer.fit(progress=True)
    after = history[-1]  # fit() evaluates after its last step: no second pass over the validation batches
    prompt = torch.tensor([tokenizer.encode(args.prompt).ids], device=device)
    out = generate(model, prompt, args.new_tokens)
    continuation = tokenizer.decode(out[0, prompt.shape[1]:].tolist())
    report = {
        "device": str(device), "model": "SmolLM2-135M-Instruct (Q4_1 dequantized)",
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus": str(corpus), "train_tokens": train.num_tokens, "val_tokens": val.num_tokens,
        "val_ppl_before": before["val_ppl"], "val_ppl_after": after["val_ppl"],
        "eval_tokens": before["val_batches"] * batch * seq_len,
        "train_steps": steps, "train_loss_first": history[0]["loss"], "train_loss_last": history[-1]["loss"],
        "tokens_per_s": history[-1]["tokens_per_s"], "prompt": args.prompt, "continuation": continuation,
        "seconds": time.perf_counter() - t0,
    }
    _print_report(report)
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1))
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


def _print_report(r: dict) -> None:
    line = "-" * 72
    print(line)
    print(f"thrifty demo  ·  {r['model']}  ·  {r['parameters'] / 1e6:.1f}M params  ·  {r['device']}")
    print(line)
    print(f"corpus          {r['corpus']}")
    print(f"                train {r['train_tokens']:,} tokens · validation {r['val_tokens']:,} tokens")
    print(f"perplexity      {r['val_ppl_before']:.2f} before  ->  {r['val_ppl_after']:.2f} after "
          f"{r['train_steps']} steps   (on {r['eval_tokens']:,} validation tokens)")
    print(f"train loss      {r['train_loss_first']:.3f} -> {r['train_loss_last']:.3f}   "
          f"({r['tokens_per_s']:,.0f} tokens/s)")
    print(f"generation      {r['prompt']!r} ->")
    print(f"                {r['continuation']!r}")
    print(f"time            {r['seconds']:.0f} s")
    print(line)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="thrifty", description="thrifty: cheaper LLM training and serving")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="fetch and prepare the real model and the corpus (idempotent)")
    s.add_argument("--corpus", default=None, help="a folder of text files to use instead of the Debian docs")
    s.add_argument("--max-mb", type=float, default=None, help="cap the cleaned corpus (MB)")
    d = sub.add_parser("demo", help="run the reference pipeline end to end (CPU by default, GPU when present)")
    d.add_argument("--corpus", default=None, help="a folder of text files to use instead of the Debian docs")
    d.add_argument("--device", default="auto")
    d.add_argument("--steps", type=int, default=None, help="training steps (default 4 on CPU, 50 on GPU)")
    d.add_argument("--eval-batches", type=int, default=4)
    d.add_argument("--seq-len", type=int, default=None, help="default 256 on CPU, 512 on GPU")
    d.add_argument("--batch-size", type=int, default=None, help="default 4 on CPU, 16 on GPU")
    d.add_argument("--prompt", default=DEMO_PROMPT)
    d.add_argument("--new-tokens", type=int, default=30)
    d.add_argument("--report", default=None, help="also write the report as JSON here")
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
        return {"setup": cmd_setup, "demo": cmd_demo, "pretrain": cmd_pretrain}[args.cmd](args)
    except (ValueError, FileNotFoundError) as err:  # bad input (thrifty's checks raise these): one line, exit 2
        print(f"thrifty {args.cmd}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
