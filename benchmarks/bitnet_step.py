"""BitNet training-step time (issue #31): one step (forward, backward, AdamW) of fp, b1.58, a4.8 with the fused
kernels and a4.8 with the reference quantizers, in one run at the same batch, the variants timed in interleaved
rounds (all four built first; each round visits every variant) so run order favours none; and the activation quantizers alone
(INT8, INT4, TopK+INT8 at widths 384 / 1536 / 4096: GB/s and TopK time / INT8 time).

**Eager and CUDA-graph steps** (``TrainConfig(cuda_graph=True)``, the step the library recommends on one GPU):
on CUDA every variant is timed twice in the same interleaved rounds, as the eager ``Trainer.train_step`` (rows
``path: "eager"``) and as the captured graph (rows ``path: "cuda_graph"``, variant names ``"… (cuda graph)"``;
the graph trainers warm up and capture before the timing and must report ``last_step_path == "cuda_graph"``).
The eager step of the 30m preset is host-bound (bitnet_profile: host 44 / 67 ms vs GPU busy 25.5 / 28.4 ms per
fp / a4.8 step on the H200), so its ratios follow the host CPU; the graph's follow the GPU. ``--no-cuda-graph``
(and every CPU run) times the eager steps only.

Writes ``benchmarks/results/bitnet_step_<device>.json`` and a PNG. Summary keys: ``train_step_time_ratio_a48_vs_fp``,
``train_step_time_ratio_b158_vs_fp``, ``train_step_time_ratio_a48_reference_vs_fp`` and ``step_ms_fp`` are of the
CUDA-graph step when it was timed, else of the eager step (``train_step_path`` says which); the same keys with
``_eager`` (always) and ``_cuda_graph`` (when timed) name their path, and ``cuda_graph_speedup_<variant>`` is
eager time / graph time (fp, b158, a48, a48_reference). Also ``topk_over_int8_time`` (at width 4096; per width
in the rows). Batches are random token ids: the step time does not depend on the text, so no corpus travels.
GPU box:

    THRIFTY_COMMIT=<sha> bash benchmarks/run_on_gpu.sh benchmarks/bitnet_step.py

``--baseline-src OLD/src`` times the quantizers of another tree (``git archive OLD | tar -x -C /tmp/old``) in the
same run, in a subprocess: rows tagged ``tree`` (this / baseline) side by side, summary keys ``*_baseline`` and
``topk_gpu_speedup_vs_baseline_d<width>``. ``--quantizers-only`` skips the training steps (old vs new kernels in
under a minute):

    THRIFTY_COMMIT=<sha> THRIFTY_NO_INSTALL=1 bash benchmarks/run_on_gpu.sh benchmarks/bitnet_step.py \
        --quantizers-only --baseline-src /tmp/old/src

``--smoke``: tiny sizes on the CPU (kernels under TRITON_INTERPRET=1) into a temporary folder; measures nothing.
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
from thrifty.bench import RandomTokens, default_results_dir, detect_device, print_table, time_fn, write_result
from thrifty.models import LlamaForCausalLM, preset
from thrifty.train import CUDA_GRAPH_WARMUP_STEPS, Trainer, TrainConfig

VARIANTS = (("fp", "fp", True), ("b1.58", "b1.58", True), ("a4.8", "a4.8", True),
            ("a4.8 (reference quantizers)", "a4.8", False))
SUMMARY_NAMES = {"fp": "fp", "b1.58": "b158", "a4.8": "a48", "a4.8 (reference quantizers)": "a48_reference"}
GRAPH_TAG = " (cuda graph)"  # appended to a variant's name for its CUDA-graph trainer
KINDS = ("int8", "int4", "topk_int8")
ROWS_MARK = "BITNET_QUANTIZER_ROWS "  # the line a --rows-only run prints its rows on (for --baseline-src)


def build_trainer(recipe: str, impl: str, args, device, cuda_graph: bool = False) -> Trainer:
    """A trainer for one step of ``recipe`` in its final stage (a4.8 as a4.8), same init and batch for all."""
    config = preset(args.preset, vocab_size=args.vocab_size)
    with torch.device(device):
        model = LlamaForCausalLM(config).init_weights(seed=0)
    if recipe != "fp":
        bitnet.convert(model, bitnet.BitNetConfig(recipe=recipe, impl=impl))
    cfg = TrainConfig(steps=10**6, batch_size=args.batch_size, seq_len=args.seq_len, lr=1e-3, warmup_steps=1,
                      cuda_graph=cuda_graph)
    return Trainer(model, RandomTokens(config.vocab_size), None, cfg)


def interleaved_step_ms(trainers: dict, args, device) -> dict[str, list[float]]:
    """ms per step of every trainer, timed in rounds that visit the variants in turn: timed one after another,
    the variants' times rose in run order (H100, 65ebb36: 36, 53, 72, 101 ms), so order must not favour one.
    ``train_step`` ends with a host sync (``float(loss)``), so the wall clock is the step time. A CUDA-graph trainer
    first runs its eager warm-up steps and the capture, so that every timed step is a replay."""
    for name, trainer in trainers.items():
        graphed = trainer.cfg.cuda_graph
        for _ in range(args.warmup + (CUDA_GRAPH_WARMUP_STEPS if graphed else 0)):
            trainer.train_step()
        if trainer.last_step_path != ("cuda_graph" if graphed else "eager"):
            raise RuntimeError(f"{name}: the warmed-up step ran as {trainer.last_step_path!r}")
    per_round = max(1, args.reps // args.rounds)
    samples = {name: [] for name in trainers}
    for _ in range(args.rounds):
        for name, trainer in trainers.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(per_round):
                trainer.train_step()
            samples[name].append((time.perf_counter() - t0) * 1e3 / per_round)
    return samples


def quantizer_rows(args, device) -> list[dict]:
    """The input kernel alone on (tokens, width) bf16 activations: bytes moved = one read + one write. Runs with
    whichever thrifty is imported (a --baseline-src subprocess: the old tree's), so only long-standing API."""
    import thrifty
    from thrifty.bitnet import quant_kernel as QK, reference

    src = str(Path(thrifty.__file__).resolve().parents[1])  # which tree ran: the table's tree column, checked

    rows = []
    for d in args.widths:
        x = torch.randn(args.tokens, d, device=device, dtype=torch.bfloat16)
        times, gpu = {}, {}
        for kind in KINDS:
            times[kind] = time_fn(lambda: QK.quantize_rows(x, kind), warmup=args.warmup, reps=args.reps * 3,
                                  device=device).median_ms
            # the call as a step pays it (host path included: at 16384 x 384 that is most of it), and the kernel
            # alone (gpu_only: the host's part overlaps a spin kernel)
            gpu[kind] = time_fn(lambda: QK.quantize_rows(x, kind), warmup=1, reps=args.reps * 3, gpu_only=True,
                                device=device).median_ms
        exact = torch.equal(QK.quantize_rows(x, "topk_int8"), reference.quantize_topk_int8(x))
        for kind in KINDS:
            moved = 2 * x.numel() * x.element_size()
            rows.append({"what": "quantizer", "kind": kind, "tokens": args.tokens, "features": d,
                         "ms": times[kind], "gbs": moved / times[kind] / 1e6,
                         "over_int8_time": times[kind] / times["int8"], "gpu_ms": gpu[kind],
                         "gpu_gbs": moved / gpu[kind] / 1e6, "gpu_over_int8_time": gpu[kind] / gpu["int8"],
                         "thrifty_src": src, **({"exact": exact} if kind == "topk_int8" else {})})
    return rows


def baseline_quantizer_rows(args) -> list[dict]:
    """:func:`quantizer_rows` of the tree at ``--baseline-src``, timed by this script in a subprocess."""
    from thrifty.bench import rows_from_tree  # not at module level: a --rows-only run may import an older bench

    passed = ["--rows-only", "--tokens", str(args.tokens), "--widths", ",".join(map(str, args.widths)),
              "--warmup", str(args.warmup), "--reps", str(args.reps), "--rounds", str(args.rounds),
              "--device", args.device]
    return rows_from_tree(__file__, args.baseline_src, passed + ["--smoke"] * args.smoke, ROWS_MARK)


def quantizer_summary(rows: list[dict]) -> dict:
    """TopK over INT8 (call and GPU time) per width, for this tree and, when timed, the baseline's, and the
    baseline's TopK GPU time over this tree's."""
    out = {}
    for tree, suffix in (("this", ""), ("baseline", "_baseline")):
        topk = {r["features"]: r for r in rows if r.get("kind") == "topk_int8" and r["tree"] == tree}
        if not topk:
            continue
        widest = topk[max(topk)]
        out.update({f"topk_over_int8_time{suffix}": widest["over_int8_time"],
                    f"topk_over_int8_gpu_time{suffix}": widest["gpu_over_int8_time"],
                    **{f"topk_over_int8_time_d{d}{suffix}": r["over_int8_time"] for d, r in topk.items()},
                    **{f"topk_over_int8_gpu_time_d{d}{suffix}": r["gpu_over_int8_time"] for d, r in topk.items()}})
    for r in rows:
        if r.get("kind") == "topk_int8" and r["tree"] == "this":
            old = next((b for b in rows if b.get("kind") == "topk_int8" and b["tree"] == "baseline"
                        and b["features"] == r["features"]), None)
            if old is not None:
                out[f"topk_gpu_speedup_vs_baseline_d{r['features']}"] = old["gpu_ms"] / r["gpu_ms"]
    return out


def plot(rows: list, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    steps = [r for r in rows if r.get("what") == "step"]
    ax.barh([r["variant"] for r in steps], [r["step_ms"] for r in steps])
    for i, r in enumerate(steps):
        ax.text(r["step_ms"], i, f" {r['vs_fp']:.2f}× fp", va="center")
    ax.set_xlabel("ms per training step")
    ax.set_title(title)
    quant = [r for r in rows if r.get("what") == "quantizer"]
    widths = sorted({r["features"] for r in quant})
    series = [(f"{kind}", "this", kind) for kind in KINDS]
    if any(r["tree"] == "baseline" for r in quant):
        series.append(("topk_int8 (baseline)", "baseline", "topk_int8"))
    bar = 0.8 / len(series)
    for j, (name, tree, kind) in enumerate(series):
        gbs = [next((r["gpu_gbs"] for r in quant if r["tree"] == tree and r["kind"] == kind and r["features"] == d),
                    0.0) for d in widths]
        bx.bar([i + j * bar for i in range(len(widths))], gbs, bar, label=name)
    bx.set_xticks([i + 0.4 - bar / 2 for i in range(len(widths))], [str(d) for d in widths])
    bx.set_xlabel("features per token")
    bx.set_ylabel("GB/s of GPU time (bf16 read + write)")
    bx.set_title("fused input quantizer")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="30m")
    ap.add_argument("--vocab-size", type=int, default=49152, help="the SmolLM2 tokenizer's")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=16384, help="rows of the quantizer table")
    ap.add_argument("--widths", default="384,1536,4096")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20, help="timed steps per variant, spread over --rounds")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each visits every variant)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--label", default=None, help="device tag in the result name (default: detected device)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results; --smoke: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, results to a temporary folder")
    ap.add_argument("--quantizers-only", action="store_true", help="skip the training steps")
    ap.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                    help="also time every variant's CUDA-graph step (default: on CUDA)")
    ap.add_argument("--baseline-src", default=None, help="src/ of another thrifty tree: its quantizers timed too")
    ap.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)  # --baseline-src's subprocess
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.reps < args.rounds:
        ap.error(f"--rounds/--reps: need 1 <= rounds <= reps, got rounds={args.rounds}, reps={args.reps}")
    if args.baseline_src is not None and not Path(args.baseline_src, "thrifty").is_dir():
        ap.error(f"--baseline-src: {args.baseline_src!r} holds no thrifty package (give the old tree's src/)")
    impl = "auto"
    if args.smoke:  # the kernels under the interpreter: set TRITON_INTERPRET=1 before thrifty is imported
        args.preset, args.vocab_size, args.batch_size, args.seq_len = "tiny", 256, 1, 8
        args.tokens, args.widths = 4, "33,130"
        args.warmup, args.reps, args.rounds, impl = 1, 2, 2, "triton"
        args.out = args.out or tempfile.mkdtemp(prefix="bitnet_step_smoke_")
    args.widths = [int(w) for w in str(args.widths).split(",")]
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if args.cuda_graph and device.type != "cuda":
        ap.error(f"--cuda-graph: needs a CUDA device, got {device}")
    args.cuda_graph = device.type == "cuda" if args.cuda_graph is None else args.cuda_graph
    torch.manual_seed(0)
    if args.rows_only:
        print(ROWS_MARK + json.dumps(quantizer_rows(args, device)), flush=True)
        return 0
    label = args.label or detect_device(device)

    rows, summary = [], {}
    if not args.quantizers_only:
        step_rows, summary = step_times(args, device, impl)
        rows += step_rows
    rows += [dict(r, tree="this") for r in quantizer_rows(args, device)]
    if args.baseline_src:
        rows += baseline_quantizer_rows(args)
    summary.update(quantizer_summary(rows))
    extra = {"args": vars(args), "note": "smoke run: tiny sizes, measures nothing" if args.smoke else
             "issue #31: a4.8 step time vs fp (goal <= 1.3x), TopK vs INT8 (goal <= ~2x)"}
    results_dir = Path(args.out) if args.out else default_results_dir()
    path = write_result("bitnet_step", rows, summary, device=label, extra=extra, results_dir=results_dir)
    plot(rows, path.with_suffix(".png"), f"BitNet step, {args.preset}, {args.batch_size}×{args.seq_len}, {label}")
    if not args.quantizers_only:
        print_table([r for r in rows if r.get("what") == "step"],
                    ["variant", "path", "step_ms", "tokens_per_s", "vs_fp", "vs_eager"])
    print_table([r for r in rows if r.get("what") == "quantizer" or "error" in r],
                ["tree", "kind", "features", "ms", "gbs", "over_int8_time", "gpu_ms", "gpu_gbs",
                 "gpu_over_int8_time", "exact", "error"])
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}, indent=1))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def step_times(args, device, impl) -> tuple[list[dict], dict]:
    """(one row per variant and path, the step-time summary): every trainer built first, then timed in rounds."""
    paths = ("eager", "cuda_graph") if args.cuda_graph else ("eager",)
    trainers = {name + (GRAPH_TAG if path == "cuda_graph" else ""):
                build_trainer(recipe, impl if use_kernels else "reference", args, device, cuda_graph=path == "cuda_graph")
                for path in paths for name, recipe, use_kernels in VARIANTS}
    samples = interleaved_step_ms(trainers, args, device)
    del trainers
    timings = {name: statistics.median(ms) for name, ms in samples.items()}
    for name, ms in samples.items():
        print(f"  {name}: {timings[name]:.2f} ms per step (rounds: {', '.join(f'{m:.1f}' for m in ms)})", flush=True)
    tokens = args.batch_size * args.seq_len
    rows, summary = [], {"tokens_per_step": tokens, "train_step_path": paths[-1]}
    for path in paths:
        tag = GRAPH_TAG if path == "cuda_graph" else ""
        ms = {variant: timings[variant + tag] for variant, _, _ in VARIANTS}
        for variant, t in ms.items():
            row = {"what": "step", "variant": variant + tag, "path": path, "step_ms": t,
                   "tokens_per_s": tokens / (t / 1e3), "vs_fp": t / ms["fp"], "round_ms": samples[variant + tag]}
            if path == "cuda_graph":
                row["vs_eager"] = timings[variant] / t  # the graph's speed-up
                summary[f"cuda_graph_speedup_{SUMMARY_NAMES[variant]}"] = row["vs_eager"]
            rows.append(row)
        keys = {f"train_step_time_ratio_{SUMMARY_NAMES[v]}_vs_fp": ms[v] / ms["fp"] for v in ms if v != "fp"}
        keys["step_ms_fp"] = ms["fp"]
        summary.update({f"{k}_{path}": v for k, v in keys.items()})
        if path == paths[-1]:  # the unsuffixed keys: the graph's when timed (the recommended step), else eager's
            summary.update(keys)
    return rows, summary


if __name__ == "__main__":
    sys.exit(main())
