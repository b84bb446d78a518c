"""End to end: pre-train the reference model (SmolLM2-135M shape, vocab 49152) from scratch on the corpus with
torch's cross-entropy (logits materialized) and with thrifty's cut cross-entropy, same seed and batches.

Reports the loss curves (plot), tokens/s, peak memory per step, and the largest batch that fits (seq_len
fixed) for each loss. Needs the tokenized corpus on the box (carry `data/corpus` token files).

    bash benchmarks/run_on_gpu.sh benchmarks/train_e2e.py --steps 150
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from thrifty.bench import print_table, write_result
from thrifty.data import TokenDataset
from thrifty.models import LlamaForCausalLM, preset
from thrifty.paths import data_dir
from thrifty.train import Trainer, TrainConfig


CHECKS: list = []  # |kernel loss - naive torch loss| on the same batch, per step (--check-loss)


def make_model(name: str, loss: str, device, seed: int = 0, check: bool = False):
    with torch.device(device):
        model = LlamaForCausalLM(preset(name)).init_weights(seed=seed)
    if loss != "torch":
        import functools

        from thrifty.loss import lm_loss

        fn = functools.partial(lm_loss, impl=loss)
        if check:
            def fn(h, w, y, _impl=loss):  # noqa: F811 -- the same loss, plus the naive loss of the same inputs
                out = lm_loss(h, w, y, impl=_impl)
                with torch.no_grad():
                    ref = lm_loss(h.detach(), w.detach(), y, impl="torch")
                CHECKS.append(abs(out.item() - ref.item()))
                return out
        model.set_loss(fn)
    return model


def train_curve(args, loss: str, corpus, seed: int = 0):
    model = make_model(args.preset, loss, args.device, seed=seed, check=args.check_loss)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      warmup_steps=max(1, args.steps // 10), eval_batches=8, seed=0)
    trainer = Trainer(model, TokenDataset(corpus, "train"), TokenDataset(corpus, "validation"), cfg)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    history = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        row = trainer.train_step()  # ends with a host sync (loss.item()), so wall time is the step time
        row["step_ms"] = (time.perf_counter() - t0) * 1e3
        if CHECKS:
            row["loss_check_abs_diff"] = CHECKS[-1]
            CHECKS.clear()
        history.append(row)
    final = trainer.evaluate()
    steady = [h["step_ms"] for h in history[len(history) // 4:]]
    tokens_per_s = cfg.batch_size * cfg.seq_len / (statistics.median(steady) / 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    del trainer, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return history, final, tokens_per_s, peak


def fits(args, loss: str, data, batch: int) -> bool:
    """Whether one full training step (fwd, bwd, AdamW) at this batch (x seq_len) fits on the device."""
    model = trainer = None
    try:
        model = make_model(args.preset, loss, args.device)
        cfg = TrainConfig(steps=1, batch_size=batch, seq_len=args.seq_len, warmup_steps=0)
        trainer = Trainer(model, data, None, cfg)
        trainer.train_step()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del model, trainer
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


def max_batch(args, loss: str, corpus) -> int:
    """Largest batch (at seq_len) whose training step fits: doubling from 8, then bisection to a step of 2
    (power-of-two steps would hide the logits' share of memory)."""
    data = TokenDataset(corpus, "train")
    best, batch = 0, 8
    while batch <= args.max_batch_limit and fits(args, loss, data, batch):
        best, batch = batch, batch * 2
    if best == 0 or batch > args.max_batch_limit:
        return best
    lo, hi = best, batch  # lo fits, hi does not
    while hi - lo > 2:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(args, loss, data, mid) else (lo, mid)
    return lo


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="135m")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--losses", default="torch,triton")
    ap.add_argument("--max-batch-limit", type=int, default=512)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--init-seeds", default="0", help="model init seeds, e.g. 0,1 (the data order stays seed 0)")
    ap.add_argument("--no-max-batch", action="store_true")
    ap.add_argument("--check-loss", action="store_true", help="also the naive loss of each batch (kernel arms)")
    args = ap.parse_args()
    corpus = data_dir() / "corpus"  # staged: the box has no apt to build it
    rows, curves, max_batches = [], {}, {}
    seeds = [int(x) for x in args.init_seeds.split(",")]
    arms = [(loss, seed) for loss in args.losses.split(",") for seed in seeds]
    for loss, seed in arms:
        name = loss if len(seeds) == 1 else f"{loss}_s{seed}"
        history, final, tps, peak = train_curve(args, loss, corpus, seed)
        curves[name] = [h["loss"] for h in history]
        if not args.no_max_batch and loss not in max_batches:  # memory does not depend on the init seed
            max_batches[loss] = max_batch(args, loss, corpus)
        fits = max_batches.get(loss)
        rows.append({"loss": name, "tokens_per_s": tps, "peak_gib": peak, "final_train_loss": history[-1]["loss"],
                     "val_loss": final["val_loss"], "val_ppl": final["val_ppl"], "max_batch": fits,
                     "train_loss_last50": sum(curves[name][-50:]) / len(curves[name][-50:]),
                     "seq_len": args.seq_len})
        for h in history:
            rows.append({"curve": name, "step": h["step"], "train_loss": h["loss"], "step_ms": h["step_ms"],
                         **({"loss_check_abs_diff": h["loss_check_abs_diff"]} if "loss_check_abs_diff" in h else {})})
        steps = [h["loss"] for h in history]
        # one-step spikes: loss above the mean of both neighbours by > 0.5 nats
        rows[-len(history) - 1]["spikes"] = [history[i]["step"] for i in range(1, len(steps) - 1)
                                              if steps[i] - (steps[i - 1] + steps[i + 1]) / 2 > 0.5]
    summary_rows = [r for r in rows if "tokens_per_s" in r]
    print_table(summary_rows)
    summary = {f"{r['loss']}_{k}": r[k] for r in summary_rows for k in ("tokens_per_s", "peak_gib", "max_batch",
                                                                       "val_loss", "spikes",
                                                                       "train_loss_last50")}
    losses = args.losses.split(",")
    if len(losses) == 2 and len(seeds) > 1:  # same init seed and data order: the gap each seed shows
        for seed in seeds:
            a, b = (summary.get(f"{lo}_s{seed}_train_loss_last50") for lo in losses)
            summary[f"{losses[1]}_minus_{losses[0]}_last50_s{seed}"] = b - a if a is not None and b is not None else None
    checks = [r["loss_check_abs_diff"] for r in rows if "loss_check_abs_diff" in r]
    if checks:
        summary["loss_check_max_abs_diff"] = max(checks)
    names = list(curves)
    if len(names) == 2:
        a, b = curves[names[0]], curves[names[1]]
        summary["loss_curve_max_abs_diff"] = max(abs(x - y) for x, y in zip(a, b))
    path = write_result("train_e2e", rows, summary, extra=vars(args))
    plot_curves(rows, path.with_suffix(".png"), f"{args.preset} preset, B={args.batch_size}x{args.seq_len}: "
                "torch CE vs thrifty CE")


def plot_curves(rows, path, title):
    """Training-loss curves, one line per loss implementation (plus a smoothed copy to see through noise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in dict.fromkeys(r["curve"] for r in rows if "curve" in r):
        pts = [(r["step"], r["train_loss"]) for r in rows if r.get("curve") == name]
        steps, losses = zip(*pts)
        ax.plot(steps, losses, alpha=0.35, lw=0.8)
        smooth = [sum(losses[max(0, i - 9):i + 1]) / len(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
        ax.plot(steps, smooth, lw=1.8, label=f"{name} (10-step mean)", color=ax.lines[-1].get_color())
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats/token)")
    ax.set_ylim(top=min(11, ax.get_ylim()[1]))
    ax.set_title(title, fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
