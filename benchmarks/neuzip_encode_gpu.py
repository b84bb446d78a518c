"""GPU time of the block encoder (LOMO's per-step re-encode), old vs new tree in the same run.

Block: a 1.1B Llama's (TinyLlama shape: q, o 2048x2048; k, v 256x2048; gate, up, down 5632x2048 = 44.0M weights),
bf16 N(0, 0.02), as views of one flat buffer (as LOMO encodes them). Per repetition: host ms of
``encode_block_triton`` (it returns after its last launch; its two reads wait for its own kernels), GPU ms
between CUDA events around it, synchronizing calls (torch's sync debug mode), and the bf16 input rate
(2 B x weights / GPU time). Checks the streams against the torch encoder (``encode.encode_lossless``) once.

    python benchmarks/neuzip_encode_gpu.py [--baseline-src OLD/src] [--reps 10] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

import torch

SHAPES = [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (5632, 2048), (5632, 2048), (2048, 5632)]
ROWS_MARK = "ROWS "


def measure(device, reps: int, smoke: bool) -> dict:
    from thrifty.neuzip import reference as R
    from thrifty.neuzip.encode_kernel import encode_block_triton

    shapes = [(s[0] // 64, s[1] // 64) for s in SHAPES] if smoke else SHAPES
    n = sum(a * b for a, b in shapes)
    g = torch.Generator(device="cpu").manual_seed(0)
    buf = (torch.randn(n, generator=g) * 0.02).bfloat16().to(device)
    views, at = [], 0
    for s in shapes:
        views.append(buf[at: at + s[0] * s[1]].view(s))
        at += s[0] * s[1]
    cuda = device.type == "cuda"
    encode_block_triton(views, R.STEPS)  # compile, caches
    host, gpu, syncs = [], [], []
    for _ in range(1 if smoke else reps):
        if cuda:
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        with warnings.catch_warnings(record=True) as log:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            t0 = time.perf_counter()
            streams, _ = encode_block_triton(views, R.STEPS)
            host.append((time.perf_counter() - t0) * 1e3)
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum(1 for w in log if "synchroniz" in str(w.message)))
        if cuda:
            e1.record()
            torch.cuda.synchronize()
            gpu.append(e0.elapsed_time(e1))
    from thrifty.neuzip.encode import encode_lossless

    exact = 1
    for v, s in zip(views[:2], streams[:2]):  # the torch encoder on the same device (slow: two tensors)
        ref = encode_lossless(v, R.STEPS)
        exact &= int(all(torch.equal(ref[k].cpu(), s[k].cpu()) for k in ref))
    ms = min(gpu) if gpu else min(host)
    return {"weights": n, "host_ms": min(host), "gpu_ms": ms, "gb_per_s": 2 * n / ms / 1e6,
            "syncs": max(syncs), "exact": exact}


def baseline_row(src: str, reps: int, smoke: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    args = [sys.executable, __file__, "--rows-only", "--reps", str(reps)] + (["--smoke"] if smoke else [])
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=540)
    lines = [l for l in out.stdout.splitlines() if l.startswith(ROWS_MARK)]
    if out.returncode != 0 or not lines:
        return {"tree": "baseline", "error": out.stderr[-800:]}
    return dict(json.loads(lines[-1][len(ROWS_MARK):]), tree="baseline")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="CPU, 1/4096 of the block, Triton interpreter")
    p.add_argument("--baseline-src", default=None, help="src/ of another thrifty tree, timed in the same run")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cpu" if args.smoke else "cuda")
    row = measure(device, args.reps, args.smoke)
    if args.rows_only:
        print(ROWS_MARK + json.dumps(row), flush=True)
        return 0
    rows = [dict(row, tree="this")]
    if args.baseline_src:
        rows.append(baseline_row(args.baseline_src, args.reps, args.smoke))
    summary = {"encode_block_gpu_ms": row["gpu_ms"], "encode_block_host_ms": row["host_ms"],
               "encode_gb_per_s": row["gb_per_s"], "encode_syncs": row["syncs"], "encode_exact": row["exact"]}
    if len(rows) > 1 and "gpu_ms" in rows[1]:
        summary.update(encode_block_gpu_ms_baseline=rows[1]["gpu_ms"], encode_syncs_baseline=rows[1]["syncs"],
                       encode_speedup_vs_baseline=rows[1]["gpu_ms"] / row["gpu_ms"])
    for r in rows:
        print(r)
    print("SUMMARY", summary)
    if not args.smoke:
        from thrifty import bench

        path = bench.write_result("neuzip_encode_gpu", rows, summary, device=bench.detect_device(device),
                                  extra={"weights": "N(0, 0.02) bf16, 1.1B Llama block", "args": vars(args)})
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
