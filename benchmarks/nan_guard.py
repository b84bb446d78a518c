"""Cost of attention's NaN rule, measured across source trees in one run (issue #25).

The rule (NaN in → NaN out, ``reference.nonfinite_rows``) used to be a host-side guard: an isfinite pass over
q, k and v and a masked fill of the output. It now lives in the passes that read the data anyway (K/V in the
quantization kernel, Q in the attention kernel). This script times, for each tree given with ``--trees``
(name=DIR, DIR holding ``src/thrifty``), in a subprocess of its own:

* ``sage_attention`` (the public call, rule included) and ``sage_forward_triton`` (the kernels) at
  S = 1K … 32K (B=2, H=32/8, D=128, causal), GPU time (a spin kernel hides the host path) and host-inclusive
  event time;
* kernel TFLOP/s of ``sage_attention`` at the issue's five shapes beside cuDNN SDPA.

Summary: ``guard_overhead_pct_<S>`` = this tree's ``sage_attention`` over the pre-guard tree's kernels
(``--pre-guard NAME``), GPU time, minus one; ``tflops_<shape>_<tree>`` and ``cudnn_tflops_<shape>``.

GPU box:  PYTHONPATH=src python3 benchmarks/nan_guard.py --trees new=.,guarded=.base,pre_guard=.base_pre \\
              --pre-guard pre_guard
CPU smoke (tiny sizes, the Triton interpreter; numbers meaningless, nothing written):
          PYTHONPATH=src python3 benchmarks/nan_guard.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
SHAPES = [  # label, B, H, Hkv, D, S, causal: the rows of the table
    ("d64_gqa_8k_causal", 4, 32, 8, 64, 8192, True),
    ("d64_mha_8k_causal", 2, 32, 32, 64, 8192, True),
    ("d128_gqa_8k_causal", 2, 32, 8, 128, 8192, True),
    ("d128_gqa_32k_causal", 2, 32, 8, 128, 32768, True),
    ("d128_gqa_8k_full", 2, 32, 8, 128, 8192, False),
]
SMOKE_SHAPES = [("d64_smoke", 1, 2, 1, 64, 64, True)]


# ----------------------------------------------------------------------------------- worker (one tree)
def _timer(fn, inputs, *, gpu_only: bool, warmup: int, reps: int, device: str) -> float:
    """Median ms. ``gpu_only``: a spin kernel queued before each call keeps the GPU busy while the host runs
    the call's Python and launches, so the events see only the GPU work."""
    import time

    import torch

    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    if device != "cuda":
        times = []
        for i in range(reps):
            t = time.perf_counter()
            fn(*inputs[i % len(inputs)])
            times.append(1e3 * (time.perf_counter() - t))
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    pairs = []
    for i in range(reps):
        if gpu_only:
            torch.cuda._sleep(2_000_000)  # ~1 ms at 1.8 GHz: longer than any host path here
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*inputs[i % len(inputs)])
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in pairs)
    return times[len(times) // 2]


def _flops(B, H, S, D, causal):
    return 4 * B * H * S * S * D / (2 if causal else 1)


def worker(smoke: bool) -> dict:
    import torch

    from thrifty.attention import sage_attention
    from thrifty.attention.attn_kernel import sage_forward_triton

    dev = "cpu" if smoke else "cuda"
    dt = torch.float32 if smoke else torch.bfloat16
    reps, warmup = (2, 1) if smoke else (30, 5)
    out = {"sweep": [], "shapes": []}

    def qkv(B, H, Hkv, S, D, n):
        return [[torch.randn(B, h, S, D, device=dev, dtype=dt) for h in (H, Hkv, Hkv)] for _ in range(n)]

    B, H, Hkv, D = (1, 2, 1, 64) if smoke else (2, 32, 8, 128)
    for S in ((64,) if smoke else LENGTHS):
        inputs = qkv(B, H, Hkv, S, D, 2)
        scale = D ** -0.5
        calls = {
            "sage_attention": lambda q, k, v: sage_attention(q, k, v, causal=True, impl="triton"),
            "kernels": lambda q, k, v: sage_forward_triton(q, k, v, causal=True, sm_scale=scale),
        }
        for name, fn in calls.items():
            for gpu_only in (True, False):
                ms = _timer(fn, inputs, gpu_only=gpu_only, warmup=warmup, reps=reps, device=dev)
                out["sweep"].append(dict(S=S, call=name, timing="gpu" if gpu_only else "host+gpu", ms=ms))
        del inputs
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for label, B, H, Hkv, D, S, causal in (SMOKE_SHAPES if smoke else SHAPES):
        inputs = qkv(B, H, Hkv, S, D, 2)
        fl = _flops(B, H, S, D, causal)
        ms = _timer(lambda q, k, v: sage_attention(q, k, v, causal=causal, impl="triton"), inputs, gpu_only=True,
                    warmup=warmup, reps=reps, device=dev)
        row = dict(shape=label, thrifty_ms=ms, thrifty_tflops=fl / ms / 1e9)
        if not smoke:
            wide = [[q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)] for q, k, v in inputs]
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cms = _timer(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
                             wide, gpu_only=True, warmup=warmup, reps=reps, device=dev)
            row.update(cudnn_ms=cms, cudnn_tflops=fl / cms / 1e9)
            del wide
        out["shapes"].append(row)
        del inputs
        if dev == "cuda":
            torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------------- driver
def run_tree(name: str, root: Path, smoke: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root.resolve() / "src"), PYTHONUNBUFFERED="1")
    if smoke:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, __file__, "--worker"] + (["--smoke"] if smoke else [])
    print(f"== tree {name}: {root}", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        return {"error": f"worker exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", default="new=.", help="name=DIR,... (DIR holds src/thrifty); the first is the new tree")
    p.add_argument("--pre-guard", default=None, help="the tree whose kernels had no NaN rule (overhead baseline)")
    p.add_argument("--commits", default="", help="name=sha,... recorded in the result")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (interpreter); nothing written")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.smoke)))
        return None
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    results = {name: run_tree(name, Path(d), args.smoke) for name, d in trees.items()}
    rows, summary = [], {}
    for name, res in results.items():
        if "error" in res:
            rows.append(dict(tree=name, error=res["error"]))
            continue
        rows += [dict(tree=name, **r) for r in res["sweep"]]
        for r in res["shapes"]:
            summary[f"tflops_{r['shape']}_{name}"] = r["thrifty_tflops"]
            if "cudnn_tflops" in r:
                summary.setdefault(f"cudnn_tflops_{r['shape']}", r["cudnn_tflops"])
                summary[f"vs_cudnn_{r['shape']}_{name}"] = r["thrifty_tflops"] / r["cudnn_tflops"]
    new = next(iter(trees))
    base = args.pre_guard or new
    if "error" not in results[new] and "error" not in results.get(base, {"error": 1}):
        kern = {r["S"]: r["ms"] for r in results[base]["sweep"] if r["call"] == "kernels" and r["timing"] == "gpu"}
        for r in results[new]["sweep"]:
            if r["call"] == "sage_attention" and r["timing"] == "gpu":
                summary[f"guard_overhead_pct_{r['S']}"] = 100 * (r["ms"] / kern[r["S"]] - 1)
            if r["call"] == "sage_attention" and r["timing"] == "host+gpu":
                summary[f"host_overhead_pct_{r['S']}"] = 100 * (r["ms"] / next(
                    x["ms"] for x in results[new]["sweep"]
                    if x["S"] == r["S"] and x["call"] == "kernels" and x["timing"] == "host+gpu") - 1)
    from thrifty import bench

    shape_rows = [dict(tree=n, **r) for n, res in results.items() if "error" not in res for r in res["shapes"]]
    bench.print_table(rows)
    bench.print_table(shape_rows)
    for k, v in summary.items():
        print(f"{k}: {v:.3f}")
    if not args.smoke:
        extra = {"trees": trees, "pre_guard_tree": base, "commits": args.commits, "shapes": shape_rows,
                 "sweep_shape": "B=2 H=32 Hkv=8 D=128 bf16 causal, random inputs",
                 "timing": "median of 30 CUDA-event-timed calls; gpu = a spin kernel ahead of each call hides the host"}
        path = bench.write_result("nan_guard", rows + shape_rows, summary, extra=extra)
        gpu_rows = [dict(r, series=f"{r['tree']}: {r['call']}") for r in rows if r.get("timing") == "gpu"]
        bench.plot_rows(gpu_rows, x="S", y="ms", hue="series", kind="line", logy=True, path=path.with_suffix(".png"),
                        title="attention NaN rule: GPU ms per call, B=2 H=32/8 D=128 causal")
    return summary


if __name__ == "__main__":
    main()
