"""Training beyond one GPU: thrifty's Trainer under torchrun + FSDP2 (thrifty.parallel.shard_model), 1 vs N
GPUs, per recipe. Reports tokens/s and peak memory per GPU, scaling efficiency (tokens/s on N GPUs over N x
tokens/s on 1 GPU, same per-GPU batch) and whether the N-GPU loss curve equals the 1-GPU curve on the same
global batches (1 GPU with N x the per-GPU batch reads exactly the windows the N ranks read together).

Run on the GPU box (NVLink multicast off: NCCL_NVLS_ENABLE=0, set by this driver for its torchrun children):

    THRIFTY_COMMIT=<sha> bash benchmarks/run_on_gpu.sh benchmarks/multi_gpu.py --gpus 2

The driver starts, per recipe, three torchrun jobs (each printed before it runs), e.g.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/multi_gpu.py --worker --recipe cce --batch-size 8 ...

(1 GPU x b: throughput baseline; N GPUs x b: throughput + loss curve; 1 GPU x N.b: the loss reference), then
writes benchmarks/results/multi_gpu_<device>.json (summary: scaling_efficiency_2gpu = the worst recipe's,
loss_match, per-recipe figures) and a PNG. ``--smoke``: 2 CPU processes on gloo, tiny model, synthetic tokens,
results into a temporary folder -- proves the script runs, measures nothing.

Recipes: plain (logits + torch CE), cce (thrifty cut cross-entropy). Hooks for bitnet (thrifty.bitnet.convert(
model, "a4.8")) and neuzip (thrifty.neuzip.compress_model(model)) are in RECIPES: they run when those APIs
exist on the checkout (other branches today) and give an error row otherwise.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _recipe_missing(recipe):
    """Why a recipe cannot run on this checkout (its API lives on another branch), or None."""
    need = {"bitnet": ("thrifty.bitnet", "convert"), "neuzip": ("thrifty.neuzip", "compress_model")}.get(recipe)
    if recipe not in RECIPES:
        return f"unknown recipe {recipe!r}; expected one of {sorted(RECIPES)}"
    if need is None:
        return None
    try:
        module = importlib.import_module(need[0])
    except ImportError:
        return f"{need[0]} is not on this checkout"
    return None if hasattr(module, need[1]) else f"{need[0]}.{need[1]} is not on this checkout"


def _bitnet(model):
    return importlib.import_module("thrifty.bitnet").convert(model, "a4.8")


def _neuzip(model):
    return importlib.import_module("thrifty.neuzip").compress_model(model)


# name -> (thrifty.loss impl or "torch", a model conversion applied before sharding or None)
RECIPES = {
    "plain": ("torch", None),
    "cce": ("auto", None),
    "bitnet": ("auto", _bitnet),   # BitNet a4.8 (its branch): scales computed on the all-gathered weight
    "neuzip": ("auto", _neuzip),   # NeuZip lossless (its branch): see src/thrifty/parallel/NOTES.md
}

LOSS_TOL = 0.02  # nats: bf16 all-reduce/reduce-scatter order noise over a short curve, far below a real bug


# ------------------------------------------------------------------------------------------------ the worker

class RandomTokens:
    """Synthetic token stream (smoke runs, or a box without the corpus): same duck type as TokenDataset."""

    def __init__(self, vocab, n=1 << 20, seed=0):
        self.tokens = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))

    def batch(self, batch_size, seq_len, generator=None):
        starts = torch.randint(0, len(self.tokens) - seq_len - 1, (batch_size,), generator=generator)
        w = self.tokens[starts[:, None] + torch.arange(seq_len + 1)]
        return w[:, :-1], w[:, 1:]


def _data(args, vocab):
    if not args.smoke:
        try:
            from thrifty.data import TokenDataset
            from thrifty.paths import data_dir

            return TokenDataset(data_dir() / "corpus", "train"), "corpus"
        except (ValueError, OSError):
            pass
    return RandomTokens(vocab), "random"


def worker(args) -> None:
    import torch.distributed as dist

    from thrifty import parallel
    from thrifty.models import LlamaForCausalLM, preset
    from thrifty.train import Trainer, TrainConfig

    device = parallel.init_distributed("gloo" if args.smoke else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    loss_impl, convert = RECIPES[args.recipe]
    cfg_model = preset(args.preset)
    with torch.device(device):
        model = LlamaForCausalLM(cfg_model).init_weights(seed=0)
    if loss_impl != "torch":
        from thrifty.loss import lm_loss

        model.set_loss(functools.partial(lm_loss, impl=loss_impl))
    if convert is not None:
        model = convert(model) or model
    parallel.shard_model(model)
    data, source = _data(args, cfg_model.vocab_size)
    cfg = TrainConfig(steps=args.warmup + args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      warmup_steps=max(1, (args.warmup + args.steps) // 10), seed=0)
    trainer = Trainer(model, data, None, cfg)
    cuda = device.type == "cuda"
    losses, step_s = [], []
    for i in range(cfg.steps):
        if cuda and i == args.warmup:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        row = trainer.train_step()  # ends with the all-reduce of the loss: a host sync on every rank
        step_s.append(time.perf_counter() - t0)
        losses.append(row["loss"])
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")], device=device)
    peaks = torch.empty(world, device=device)
    torch.distributed.all_gather_into_tensor(peaks, peak)
    steady = step_s[args.warmup:]
    if rank == 0:
        tokens = world * args.batch_size * args.seq_len
        part = {"recipe": args.recipe, "gpus": world, "batch_per_gpu": args.batch_size, "seq_len": args.seq_len,
                "tokens_per_s": tokens / statistics.median(steady), "step_ms_median": 1e3 * statistics.median(steady),
                "peak_gib_per_gpu": [float(p) for p in peaks.cpu()], "losses": losses, "data": source,
                "params_m": sum(p.numel() for p in model.parameters()) / 1e6}
        Path(args.part).write_text(json.dumps(part))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ the driver

def _launch(args, recipe, gpus, batch, part) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
           str(Path(__file__).resolve()), "--worker", "--recipe", recipe, "--preset", args.preset,
           "--batch-size", str(batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--lr", str(args.lr), "--part", str(part)] + (["--smoke"] if args.smoke else [])
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    print("NCCL_NVLS_ENABLE=0 " + " ".join(cmd[2:]).replace("torch.distributed.run", "torchrun", 1), flush=True)
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited with {proc.returncode}")
    return json.loads(Path(part).read_text())


def driver(args) -> None:
    from thrifty.bench import print_table, write_result

    gpus = args.gpus or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    if not args.smoke and gpus < 2:
        raise SystemExit(f"--gpus: need at least 2 GPUs for a scaling figure, have {gpus}")
    rows, summary, curves = [], {}, {}
    tmp = Path(tempfile.mkdtemp(prefix="multi_gpu_"))
    for recipe in args.recipes.split(","):
        missing = _recipe_missing(recipe)
        if missing:
            rows.append({"recipe": recipe, "error": missing})
            continue
        try:
            one = _launch(args, recipe, 1, args.batch_size, tmp / f"{recipe}_1.json")
            many = _launch(args, recipe, gpus, args.batch_size, tmp / f"{recipe}_{gpus}.json")
            ref = _launch(args, recipe, 1, gpus * args.batch_size, tmp / f"{recipe}_1x{gpus}.json")
        except Exception as err:  # a recipe whose API is not on this checkout, an OOM, ...
            rows.append({"recipe": recipe, "error": f"{type(err).__name__}: {err}"})
            continue
        eff = many["tokens_per_s"] / (gpus * one["tokens_per_s"])
        diff = [abs(a - b) for a, b in zip(many["losses"], ref["losses"])]
        for run, label in ((one, "1 GPU"), (many, f"{gpus} GPUs"), (ref, f"1 GPU, {gpus}x batch")):
            rows.append({"recipe": recipe, "run": label, "gpus": run["gpus"], "batch_per_gpu": run["batch_per_gpu"],
                         "tokens_per_s": run["tokens_per_s"], "step_ms": run["step_ms_median"],
                         "peak_gib_per_gpu": max(run["peak_gib_per_gpu"]), "final_loss": run["losses"][-1],
                         "data": run["data"]})
        summary[f"{recipe}_scaling_efficiency_{gpus}gpu"] = eff
        summary[f"{recipe}_tokens_per_s_1gpu"] = one["tokens_per_s"]
        summary[f"{recipe}_tokens_per_s_{gpus}gpu"] = many["tokens_per_s"]
        summary[f"{recipe}_peak_gib_per_gpu_1gpu"] = max(one["peak_gib_per_gpu"])
        summary[f"{recipe}_peak_gib_per_gpu_{gpus}gpu"] = max(many["peak_gib_per_gpu"])
        summary[f"{recipe}_loss_max_abs_diff"] = max(diff)
        curves[recipe] = (many["losses"], ref["losses"])
    done = [r for r in args.recipes.split(",") if r in curves]
    if done:
        summary[f"scaling_efficiency_{gpus}gpu"] = min(summary[f"{r}_scaling_efficiency_{gpus}gpu"] for r in done)
        summary["loss_match"] = all(summary[f"{r}_loss_max_abs_diff"] <= LOSS_TOL for r in done)
        summary["recipes_run"] = ",".join(done)
    out_dir = Path(tempfile.mkdtemp(prefix="multi_gpu_smoke_")) if args.smoke else None
    path = write_result("multi_gpu", rows, summary, results_dir=out_dir,
                        extra={**vars(args), "gpus": gpus, "loss_tol_nats": LOSS_TOL, "nccl_nvls_enable": 0,
                               "curves": {k: {"n_gpu": a, "one_gpu_same_batches": b} for k, (a, b) in curves.items()}})
    _plot(rows, curves, gpus, path.with_suffix(".png"))
    print_table(rows)
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


def _plot(rows, curves, gpus, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ok = [r for r in rows if "tokens_per_s" in r and r["batch_per_gpu"] == rows[0].get("batch_per_gpu")]
    recipes = list(dict.fromkeys(r["recipe"] for r in ok))
    for i, n in enumerate(sorted({r["gpus"] for r in ok})):
        vals = [next((r["tokens_per_s"] for r in ok if r["recipe"] == rc and r["gpus"] == n), 0) for rc in recipes]
        ax1.bar([j + 0.4 * i for j in range(len(recipes))], vals, width=0.4, label=f"{n} GPU(s)")
    ax1.set_xticks([j + 0.2 for j in range(len(recipes))], recipes)
    ax1.set_ylabel("tokens/s (all GPUs)")
    ax1.set_title("throughput, same batch per GPU")
    ax1.legend()
    for recipe, (many, ref) in curves.items():
        line = ax2.plot(many, label=f"{recipe}: {gpus} GPUs")[0]
        ax2.plot(ref, "--", color=line.get_color(), label=f"{recipe}: 1 GPU, same batches")
    ax2.set_xlabel("step")
    ax2.set_ylabel("train loss (nats/token)")
    ax2.set_title("loss curves")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=0, help="N (default: every visible GPU; 2 for --smoke)")
    ap.add_argument("--recipes", default="plain,cce,bitnet,neuzip")
    ap.add_argument("--preset", default="135m")
    ap.add_argument("--batch-size", type=int, default=8, help="per GPU")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 processes, tiny sizes")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--recipe", default="plain", help=argparse.SUPPRESS)
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke and not args.worker:
        args.preset, args.batch_size, args.seq_len, args.steps, args.warmup = "tiny", 2, 32, 4, 1
        args.gpus = args.gpus or 2
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
