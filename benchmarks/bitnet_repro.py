"""BitNet a4.8 reproduction on the project's corpus (issue #17): fp (LLaMA, SwiGLU), b1.58, a4.8 (two-stage from
b1.58) and the int4-all ablation, trained from the same code, tokenizer, seed, batches and token budget.

Writes ``benchmarks/results/bitnet_repro_<device>.json`` (summary keys ``ppl_fp``, ``ppl_b158``, ``ppl_a48``,
``ppl_int4_all``, ``ppl_a48_over_b158``, ``ppl_b158_over_fp``, ``overall_sparsity_a48``,
``train_step_time_ratio_a48_vs_fp``), the Table-2-shaped sparsity of every BitNet recipe, step time and tokens/s
per recipe (during training, and in a controlled timing of one training step at the same batch, where a4.8 runs
with the fused Triton quantizers and, as a second row, with the plain PyTorch ones), and a PNG of the loss curves
and the sparsity.

GPU box (30m preset, 3052 steps × 32 × 512 = 50M tokens per run, ~4.4 epochs of the 11.5M-token train split);
one call per pair of recipes fits the 10-minute command limit, ``--merge`` folds them into one result file. The
corpus token files travel with the call (24 MB): here ``mkdir -p data/corpus && cp
/work/main/data/corpus/{manifest.json,train.bin,validation.bin} data/corpus/``, then ``carry: ["data/corpus"]``:

    THRIFTY_COMMIT=<sha> bash benchmarks/run_on_gpu.sh benchmarks/bitnet_repro.py --recipes fp,b1.58
    # copy the returned bitnet_repro_h100.json into benchmarks/results/ here, then (it travels with the tree):
    THRIFTY_COMMIT=<sha> bash benchmarks/run_on_gpu.sh benchmarks/bitnet_repro.py --recipes a4.8,int4-all --merge

``--smoke``: tiny sizes on the CPU into a temporary folder (checks the script, measures nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from thrifty import bitnet
from thrifty.bench import default_results_dir, detect_device, print_table, time_fn, write_result
from thrifty.data import TokenDataset
from thrifty.models import LlamaForCausalLM, preset
from thrifty.paths import data_dir
from thrifty.train import Trainer, TrainConfig

SUMMARY_NAMES = {"fp": "fp", "b1.58": "b158", "a4.8": "a48", "a4.8-fp4": "a48_fp4", "int4-all": "int4_all"}


def build(recipe: str, args, device, impl: str = "auto"):
    with torch.device(device):
        model = LlamaForCausalLM(preset(args.preset)).init_weights(seed=args.seed)
    schedule = bitnet.build_for_pretraining(model, recipe, stage1_share=args.stage1_share)
    if impl != "auto":
        for m in model.modules():
            if isinstance(m, bitnet.BitLinear):
                m.configure(impl=impl)
    return model, schedule


def train_config(recipe: str, args) -> TrainConfig:
    return TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                       lr=args.lr if recipe == "fp" else args.bitnet_lr, warmup_steps=args.warmup,
                       weight_decay=0.1, eval_batches=args.eval_batches, seed=args.seed)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_recipe(recipe: str, args, train, val, device) -> dict:
    """Trains one recipe for the whole budget; returns its curve, final validation perplexity and sparsity."""
    model, schedule = build(recipe, args, device)
    cfg = train_config(recipe, args)
    trainer = Trainer(model, train, val, cfg, schedule=schedule)
    history = []
    t_start = time.perf_counter()
    for _ in range(cfg.steps):
        t0 = time.perf_counter()
        row = trainer.train_step()  # ends with a host sync (float(loss)), so wall time is the step time
        row["step_ms"] = (time.perf_counter() - t0) * 1e3
        row["recipe"] = bitnet.current_recipe(model)
        if args.eval_every and trainer.step % args.eval_every == 0 and trainer.step < cfg.steps:
            row.update(trainer.evaluate())
        history.append(row)
        if trainer.step % max(1, cfg.steps // 20) == 0:
            print(f"  {recipe} step {trainer.step}/{cfg.steps} loss {row['loss']:.3f} lr {row['lr']:.2e} "
                  f"({row['recipe']}, {row['step_ms']:.0f} ms)", flush=True)
    train_s = time.perf_counter() - t_start
    final = trainer.evaluate(max_batches=args.final_eval_batches)
    history[-1].update(final)
    out = {"recipe": recipe, "lr": cfg.lr, "final": final, "history": history, "train_s": train_s,
           "params": sum(p.numel() for p in model.parameters()),
           "tokens": trainer.tokens_seen}
    steady = [h["step_ms"] for h in history[len(history) // 4:] if h["recipe"] == bitnet.current_recipe(model)]
    out["step_ms_median"] = statistics.median(steady)
    out["tokens_per_s"] = cfg.batch_size * cfg.seq_len / (out["step_ms_median"] / 1e3)
    if recipe != "fp":
        batches = val.iter_eval_batches(cfg.batch_size, cfg.seq_len, args.eval_batches)
        out["sparsity"] = bitnet.measure_sparsity(model, batches, max_batches=args.eval_batches)
    del trainer, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def time_step(recipe: str, args, train, device, impl: str = "auto") -> float:
    """Median ms of one training step (forward, backward, AdamW) of ``recipe`` at the run's batch, in its final
    stage (a4.8 as a4.8, not its b1.58 stage)."""
    model, schedule = build(recipe, args, device, impl=impl)
    if schedule is not None:
        bitnet.convert(model, bitnet.BitNetConfig(recipe=recipe, impl=impl))
    cfg = train_config(recipe, args)
    trainer = Trainer(model, train, None, cfg)  # plain schedule: the recipe stays as set
    timing = time_fn(trainer.train_step, warmup=3, reps=args.timing_reps, device=device)
    del trainer, model
    return timing.median_ms


def time_quantizers(device) -> list[dict]:
    """The fused quantizer kernels beside the PyTorch reference on (tokens, features) activations (CUDA only)."""
    from thrifty.bitnet import quant_kernel
    from thrifty.bitnet import reference as ref

    rows = []
    for d in (384, 1536, 4096):
        x = torch.randn(16384, d, device=device, dtype=torch.bfloat16)
        for kind in ("int8", "int4", "topk_int8"):
            fused = time_fn(lambda: quant_kernel.quantize_rows(x, kind), warmup=3, reps=30, device=device)
            plain = time_fn(lambda: ref.quantize_activation(x, kind), warmup=3, reps=30, device=device)
            moved = 2 * x.numel() * x.element_size()
            rows.append({"what": "quantizer", "kind": kind, "tokens": 16384, "features": d,
                         "fused_ms": fused.median_ms, "reference_ms": plain.median_ms,
                         "fused_gbs": moved / fused.median_ms / 1e6, "speedup": plain.median_ms / fused.median_ms})
    return rows


def summarize(runs: dict, timings: dict) -> dict:
    s = {}
    for recipe, run in runs.items():
        key = SUMMARY_NAMES[recipe]
        s[f"ppl_{key}"] = run["final"]["val_ppl"]
        s[f"tokens_per_s_{key}"] = run["tokens_per_s"]
        s[f"step_ms_{key}"] = run["step_ms_median"]
        if "sparsity" in run:
            s[f"overall_sparsity_{key}"] = run["sparsity"]["overall"]
    if "ppl_a48" in s and "ppl_b158" in s:
        s["ppl_a48_over_b158"] = s["ppl_a48"] / s["ppl_b158"]
    if "ppl_b158" in s and "ppl_fp" in s:
        s["ppl_b158_over_fp"] = s["ppl_b158"] / s["ppl_fp"]
    if "a4.8" in timings and "fp" in timings:
        s["train_step_time_ratio_a48_vs_fp"] = timings["a4.8"] / timings["fp"]
    if "a4.8 (reference quantizers)" in timings and "fp" in timings:
        s["train_step_time_ratio_a48_reference_vs_fp"] = timings["a4.8 (reference quantizers)"] / timings["fp"]
    first = next(iter(runs.values()), None)
    if first:
        s["params_m"] = first["params"] / 1e6
        s["tokens_per_run_m"] = first["tokens"] / 1e6
    return s


def plot(runs: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    for recipe, run in runs.items():
        h = run["history"]
        steps = [r["step"] for r in h]
        loss = [r["loss"] for r in h]
        win = max(1, len(loss) // 50)  # running mean: the per-batch loss is noisy
        smooth = [sum(loss[max(0, i - win + 1):i + 1]) / len(loss[max(0, i - win + 1):i + 1]) for i in range(len(loss))]
        line, = ax.plot(steps, smooth, label=f"{recipe} (val ppl {run['final']['val_ppl']:.1f})")
        ev = [r for r in h if "val_loss" in r]
        ax.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o", color=line.get_color(), ms=3)
        switch = next((r["step"] for r in h if r["recipe"] != h[0]["recipe"]), None)
        if switch:
            ax.axvline(switch, color=line.get_color(), ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (running mean), val loss (dots)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    roles = ("qkv", "out", "up", "gate", "down", "overall")
    sparse = {r: run["sparsity"] for r, run in runs.items() if "sparsity" in run}
    width = 0.8 / max(1, len(sparse))
    for i, (recipe, sp) in enumerate(sparse.items()):
        bx.bar([j + i * width for j in range(len(roles))], [100 * sp[k] for k in roles], width, label=recipe)
    bx.set_xticks([j + 0.4 - width / 2 for j in range(len(roles))], ["QKV", "Out", "Up", "Gate", "Down", "overall"])
    bx.set_ylabel("zeros in the quantized input (%)")
    bx.set_title("activation sparsity (paper Table 2 shape)")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", default="fp,b1.58,a4.8,int4-all")
    ap.add_argument("--preset", default="30m")
    ap.add_argument("--steps", type=int, default=3052, help="default: 3052 × 32 × 512 ≈ 50M tokens")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3, help="fp peak LR (the 30m pre-training run's)")
    ap.add_argument("--bitnet-lr", type=float, default=3e-3, help="BitNet peak LR (ternary wants a higher one)")
    ap.add_argument("--stage1-share", type=float, default=0.95, help="a4.8: share of steps in W1.58A8 (paper 95%%)")
    ap.add_argument("--warmup", type=int, default=375, help="paper: 375 steps")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--final-eval-batches", type=int, default=36, help="36 × 32 × 512 ≈ the 298k validation tokens")
    ap.add_argument("--timing-reps", type=int, default=20)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default=None, help="device tag in the result name (default: detected device)")
    ap.add_argument("--merge", action="store_true", help="keep the other recipes of an existing result file")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results; --smoke: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, results to a temporary folder")
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset, args.steps, args.batch_size, args.seq_len = "tiny", 6, 2, 32
        args.warmup, args.eval_every, args.eval_batches, args.final_eval_batches = 1, 3, 1, 1
        args.timing_reps, args.stage1_share = 2, 0.5
        args.out = args.out or tempfile.mkdtemp(prefix="bitnet_repro_smoke_")
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    for r in recipes:
        if r not in SUMMARY_NAMES:
            raise SystemExit(f"--recipes: unknown recipe {r!r}, expected some of {list(SUMMARY_NAMES)}")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    label = args.label or detect_device(device)
    results_dir = Path(args.out) if args.out else default_results_dir()
    corpus = data_dir() / "corpus"
    train, val = TokenDataset(corpus, "train"), TokenDataset(corpus, "validation")
    torch.manual_seed(args.seed)

    runs, timings = {}, {}
    previous = results_dir / f"bitnet_repro_{label}.json"
    if args.merge and previous.is_file():
        old = json.loads(previous.read_text())["extra"]
        runs.update(old.get("runs", {}))
        timings.update(old.get("step_ms_controlled", {}))
    for recipe in recipes:
        print(f"== {recipe}: {args.steps} steps × {args.batch_size} × {args.seq_len} on {device}", flush=True)
        runs[recipe] = train_recipe(recipe, args, train, val, device)
    if not args.no_timing:
        variants = [("fp", "fp", "auto"), ("b1.58", "b1.58", "auto"), ("a4.8", "a4.8", "auto"),
                    ("a4.8 (reference quantizers)", "a4.8", "reference")]
        for name, recipe, impl in variants:
            timings[name] = time_step(recipe, args, train, device, impl=impl)
    runs = {r: runs[r] for r in SUMMARY_NAMES if r in runs}  # fixed order

    rows = []
    for recipe, run in runs.items():
        row = {"what": "train", "recipe": recipe, "val_ppl": run["final"]["val_ppl"],
               "val_loss": run["final"]["val_loss"], "step_ms": run["step_ms_median"],
               "tokens_per_s": run["tokens_per_s"], "lr": run["lr"], "train_s": run["train_s"]}
        row.update({f"sparsity_{k}": v for k, v in run.get("sparsity", {}).items()})
        rows.append(row)
    fp_ms = timings.get("fp")
    for name, ms in timings.items():
        rows.append({"what": "step_time", "recipe": name, "step_ms": ms,
                     "tokens_per_s": args.batch_size * args.seq_len / (ms / 1e3),
                     "vs_fp": ms / fp_ms if fp_ms else None})
    if device.type == "cuda" and not args.smoke:
        rows += time_quantizers(device)
    summary = summarize(runs, timings)
    summary["epochs_of_train_split"] = summary.get("tokens_per_run_m", 0) * 1e6 / train.num_tokens
    extra = {"args": vars(args), "runs": runs, "step_ms_controlled": timings,
             "train_tokens": train.num_tokens, "val_tokens": val.num_tokens,
             "sparsity_table": bitnet.format_table({r: run["sparsity"] for r, run in runs.items()
                                                    if "sparsity" in run}),
             "note": ("smoke run: tiny sizes, measures nothing" if args.smoke else
                      "not the issue's scale" if args.preset == "tiny" else "issue #17 reproduction")}
    path = write_result("bitnet_repro", rows, summary, device=label, extra=extra, results_dir=results_dir)
    tokens_m = summary.get("tokens_per_run_m", 0)
    plot(runs, path.with_suffix(".png"), f"BitNet on the corpus: {args.preset}, {tokens_m:.1f}M tokens/run, {label}")
    print_table([r for r in rows if r["what"] != "quantizer"],
                ["what", "recipe", "val_ppl", "step_ms", "tokens_per_s", "vs_fp", "sparsity_overall"])
    quant = [r for r in rows if r["what"] == "quantizer"]
    if quant:
        print_table(quant, ["kind", "features", "fused_ms", "reference_ms", "fused_gbs", "speedup"])
    print(extra["sparsity_table"])
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}, indent=1))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
