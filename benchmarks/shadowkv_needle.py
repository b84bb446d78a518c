"""Retrieval on a real model (issue 27, item 3): RULER-style needle rows at 2K/4K/8K on SmolLM2-135M, with dense
attention, ShadowKV and the Quest-style selector at several sparse budgets; accuracy against budget.

Rows per prompt length: ``single`` (one pass key) at each of ``--depths``, ``multikey`` (4 keys, one asked) and
``multivalue`` (one key, 2 values, both must come back: recall; weak for SmolLM2-135M even densely). The haystack is real text (the corpus'
validation split), every method sees the same prompts. The prompt minus its last token is prefilled densely
once; each method then decodes the last prompt token and the whole answer through its own cache (so no answer
token comes from the dense prefill). Configs that differ only in the budget share one compression.

    # the GPU run (one device call, see README/NOTES for the time estimate)
    PYTHONPATH=src THRIFTY_DATA=... python benchmarks/shadowkv_needle.py --trials 16
    # the smoke (CPU, tiny random model, real tokenizer and corpus, < 30 s)
    PYTHONPATH=src THRIFTY_DATA=... python benchmarks/shadowkv_needle.py --smoke --out /tmp/x

Summary keys (budget 512 unless suffixed): ``needle_acc_dense``, ``needle_acc_shadowkv``, ``needle_acc_quest``,
``needle_gap_vs_dense_points`` (ShadowKV - dense, points), ``needle_acc_{shadowkv,quest}_b<budget>``,
``needle_gap_vs_quest_points_b<budget>``, per length ``needle_acc_<method>_<L>``, per task
``needle_acc_<method>_<task>`` and the trial counts.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from thrifty import bench
from thrifty.data import TokenDataset
from thrifty.kvcache import ShadowKVConfig
from thrifty.kvcache.needle import evaluate_batch, make_needle_task
from thrifty.paths import data_dir


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF checkpoint folder (default: SmolLM2-135M, thrifty.pretrained)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--tasks", nargs="+", default=["single", "multikey", "multivalue"])
    ap.add_argument("--trials", type=int, default=16, help="prompts per row (a row: length x task x depth)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--rank", type=int, default=160)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--outliers", type=int, default=ShadowKVConfig().outlier_chunks,
                    help="outlier chunks per KV head (default: the paper's 48, ShadowKVConfig's; Quest gets their "
                         "tokens as extra budget). 8 until 57ac1e4: too few to hold the token-type heads of layers "
                         "3-10 (kvcache/NOTES.md, 'Needle retrieval')")
    ap.add_argument("--local", type=int, default=4)
    ap.add_argument("--outlier-radius-share", type=float, default=ShadowKVConfig().outlier_radius_share,
                    help="share of ShadowKV's outlier chunks chosen by the largest chunk radius (0: the paper's rule)")
    ap.add_argument("--outlier-window-share", type=float, default=ShadowKVConfig().outlier_window_share,
                    help="ShadowKVConfig.outlier_window_share: outlier chunks by the last prompt queries' attention")
    ap.add_argument("--observation-window", type=int, default=ShadowKVConfig().observation_window)
    ap.add_argument("--radius-weight", type=float, default=ShadowKVConfig().radius_weight,
                    help="ShadowKV's chunk-radius term λ (0: the paper's mean-landmark score; default: the library's)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prefill-batch", type=int, default=8)
    ap.add_argument("--impl", default="auto", choices=["auto", "reference", "triton"],
                    help="ShadowKV decode path (auto: Triton kernels on CUDA; Quest always runs the reference)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=540,
                    help="start no new row after this many seconds (the result says complete: false); results are "
                         "also rewritten after every row, so a killed run leaves the rows it finished")
    ap.add_argument("--name", default="shadowkv_needle")
    ap.add_argument("--device-tag", default=None, help="file-name tag (default: detect_device(); smoke: cpu-smoke)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny random Llama, real tokenizer and corpus, one length, 2 trials: proves the script runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.lengths, args.depths, args.trials, args.budgets = [320], [0.5], 2, [32, 64]
        args.rank, args.outliers, args.device_tag = 32, 2, args.device_tag or "cpu-smoke"
    return args


def load_model(args, device):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from thrifty.pretrained import converted_dir, ensure_converted

    tok_dir = Path(args.model) if args.model else (converted_dir() if args.smoke else ensure_converted())
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    if args.smoke:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=1024)
        model, path = LlamaForCausalLM(cfg), "random tiny Llama (smoke)"
    else:
        path = str(tok_dir)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    return model.to(device).eval(), tok, path


def methods_for(args, max_generated: int) -> dict:
    common = dict(rank=args.rank, chunk_size=args.chunk, outlier_chunks=args.outliers, local_chunks=args.local,
                  min_prompt_len=1, max_generated=max_generated, radius_weight=args.radius_weight,
                  outlier_radius_share=args.outlier_radius_share, outlier_window_share=args.outlier_window_share,
                  observation_window=args.observation_window)
    methods = {"dense": None}
    for b in args.budgets:
        methods[f"shadowkv@{b}"] = ShadowKVConfig(sparse_budget=b, **common)
    for b in args.budgets:
        methods[f"quest@{b}"] = ShadowKVConfig(sparse_budget=b, selector="quest", **common)
    return methods


def row_specs(args):
    """(length, task, depth) per row; multikey/multivalue put the asked needle at a random depth per trial."""
    for n in args.lengths:
        for task in args.tasks:
            for d in (args.depths if task == "single" else [None]):
                yield n, task, d


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(rows, args, rows_done: int = None) -> dict:
    def acc(method, budget=None, length=None):
        sel = [r for r in rows if r["method"] == method and (budget is None or r["budget"] == budget)
               and (length is None or r["length"] == length)]
        return mean([r["accuracy"] for r in sel])  # every row has the same trial count: the mean of rows

    n_rows = len(list(row_specs(args))) if rows_done is None else rows_done
    s = {"trials_per_row": args.trials, "rows_per_method": n_rows, "trials_per_method": args.trials * n_rows}
    ref_b = 512 if 512 in args.budgets else args.budgets[len(args.budgets) // 2]
    s["needle_reference_budget"] = ref_b
    s["needle_acc_dense"] = acc("dense")
    s["needle_acc_shadowkv"] = acc("shadowkv", ref_b)
    s["needle_acc_quest"] = acc("quest", ref_b)
    s["needle_gap_vs_dense_points"] = 100 * (s["needle_acc_shadowkv"] - s["needle_acc_dense"])
    for b in args.budgets:
        s[f"needle_acc_shadowkv_b{b}"] = acc("shadowkv", b)
        s[f"needle_acc_quest_b{b}"] = acc("quest", b)
        s[f"needle_gap_vs_dense_points_b{b}"] = 100 * (acc("shadowkv", b) - s["needle_acc_dense"])
        s[f"needle_gap_vs_quest_points_b{b}"] = 100 * (acc("shadowkv", b) - acc("quest", b))
    for n in args.lengths:
        s[f"needle_acc_dense_{n}"] = acc("dense", length=n)
        for b in args.budgets:
            s[f"needle_acc_shadowkv_b{b}_{n}"] = acc("shadowkv", b, n)
            s[f"needle_acc_quest_b{b}_{n}"] = acc("quest", b, n)
    for task in args.tasks:
        sel = lambda m, b=None: mean([r["accuracy"] for r in rows if r["method"] == m and r["task"] == task  # noqa: E731
                                      and (b is None or r["budget"] == b)])
        s[f"needle_acc_dense_{task}"] = sel("dense")
        for b in args.budgets:
            s[f"needle_acc_shadowkv_b{b}_{task}"] = sel("shadowkv", b)
            s[f"needle_acc_quest_b{b}_{task}"] = sel("quest", b)
    p, N = s["needle_acc_dense"], s["trials_per_method"]
    s["needle_dense_se_points"] = 100 * math.sqrt(max(p * (1 - p), 0.0) / N) if N else float("nan")
    s["needle_goal_vs_dense_met"] = bool(s["needle_gap_vs_dense_points"] >= -2.0)
    s["needle_goal_vs_quest_met"] = bool(all(s[f"needle_gap_vs_quest_points_b{b}"] >= 0 for b in args.budgets))
    return s


def plot(rows, summary, args, path):
    """Accuracy against budget: one line per method (all rows) and per method x length (thin); dense flat."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    bs = args.budgets
    colors = {"shadowkv": "tab:blue", "quest": "tab:orange", "dense": "black"}
    for m in ("shadowkv", "quest"):
        ax.plot(bs, [100 * summary[f"needle_acc_{m}_b{b}"] for b in bs], "o-", lw=2.2, color=colors[m],
                label=f"{m} (all rows)")
        for n in args.lengths:
            ax.plot(bs, [100 * summary[f"needle_acc_{m}_b{b}_{n}"] for b in bs], ":", lw=1, color=colors[m],
                    alpha=0.7)
            ax.annotate(f"{n // 1024}K", (bs[-1], 100 * summary[f"needle_acc_{m}_b{bs[-1]}_{n}"]), fontsize=7,
                        color=colors[m], xytext=(3, 0), textcoords="offset points")
    ax.axhline(100 * summary["needle_acc_dense"], color="black", lw=1.5, ls="--", label="dense (all rows)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_xlabel("sparse budget (tokens per KV head; Quest also gets the outliers' tokens)")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(f"needle retrieval, {args.trials} trials/row, lengths {', '.join(str(n) for n in args.lengths)}",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv=None):
    args = parse(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    t_start = time.time()
    model, tok, path = load_model(args, device)
    encode, decode = (lambda s: tok.encode(s).ids), tok.decode
    nl = encode("\n\n")
    filler = TokenDataset(data_dir() / "corpus", "validation").tokens
    specs = list(row_specs(args))
    methods = methods_for(args, max_generated=32)
    rng = random.Random(args.seed)
    timings, rows, per_len = {}, [], {}
    for i, (n, task, d) in enumerate(tqdm(specs, desc="needle rows", file=sys.stdout)):
        if time.time() - t_start > args.max_seconds:
            print(f"--max-seconds {args.max_seconds}: stopping after {i} of {len(specs)} rows", flush=True)
            break
        tasks = [make_needle_task(task, encode, filler, n, rng.random() if d is None else d, rng,
                                  filler_sub=nl[0]) for _ in range(args.trials)]
        t0 = time.perf_counter()
        tl, texts = {}, {}
        scores = evaluate_batch(model, tasks, methods, decode, prefill_batch=args.prefill_batch, timings=tl,
                                texts=texts, impl=args.impl)
        for k, v in tl.items():
            timings[k] = timings.get(k, 0.0) + v
        per_len.setdefault(n, []).append(time.perf_counter() - t0)
        for name, sc in scores.items():
            method, _, budget = name.partition("@")
            rows.append({"method": method, "budget": int(budget) if budget else None, "length": n, "task": task,
                         "depth": d, "accuracy": mean(sc), "n": len(sc), "answer0": tasks[0].answers,
                         "output0": texts[name][0].replace("\n", "\\n")})
        report(rows, args, path, timings, per_len, t_start, complete=False, final=False)  # a checkpoint
    return report(rows, args, path, timings, per_len, t_start, complete=len(rows) == len(specs) * len(methods),
                  final=True)


def report(rows, args, path, timings, per_len, t_start, *, complete: bool, final: bool):
    specs_done = {(r["length"], r["task"], r["depth"]) for r in rows}
    summary = summarize(rows, args, rows_done=len(specs_done))
    summary["complete"] = complete
    table = [{"method": m, "budget": b, **{_len_tag(n): summary[f"needle_acc_{m}_b{b}_{n}"] for n in args.lengths},
              "all": summary[f"needle_acc_{m}_b{b}"]} for m in ("shadowkv", "quest") for b in args.budgets]
    table.insert(0, {"method": "dense", "budget": None,
                     **{_len_tag(n): summary[f"needle_acc_dense_{n}"] for n in args.lengths},
                     "all": summary["needle_acc_dense"]})
    if final:
        bench.print_table(rows, ["method", "budget", "length", "task", "depth", "accuracy", "n", "output0"])
        print()
        bench.print_table(table)
        print({k: summary[k] for k in ("needle_acc_dense", "needle_acc_shadowkv", "needle_acc_quest",
                                       "needle_gap_vs_dense_points", "needle_goal_vs_dense_met",
                                       "needle_goal_vs_quest_met", "complete")})
    wall = time.time() - t_start
    extra = {"model": path, "settings": vars(args), "wall_s": wall, "timings_s": timings,
             "row_seconds_by_length": per_len, "table": table,
             "protocol": "prefill prompt[:-1] densely once per row batch; each method decodes the last prompt "
                         "token + the answer greedily through its own cache; single/multikey: first number == key; "
                         "multivalue: recall of the values"}
    device_tag = args.device_tag or bench.detect_device()
    out = bench.write_result(args.name, rows, summary, device=device_tag, extra=extra, results_dir=args.out)
    if rows:
        plot(rows, summary, args, out.with_suffix(".png"))
    if final:
        print(f"wrote {out} and {out.with_suffix('.png')} in {wall:.1f} s")
    return out


def _len_tag(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)

if __name__ == "__main__":
    main()
