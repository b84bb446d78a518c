"""The attention K/V pre-pass (``quant_kernel.quantize_kv``: statistics + quantization, 2 launches) against its
byte floor, old tree against new in one run (issue #28: the pre-pass is 0.07-0.1 ms of a 2K call, 0.2-0.3 ms at 8K).

Shapes: MHA B=2 H=32 (``benchmarks/attention.py``'s) and a Llama-3.1-8B prefill (B=1, 8 KV heads), head_dim 64 and
128, S in --seqs, bf16, the K-scale block and V layout of the kernel each call routes to (Gluon: ``v_perm16``).
Per shape: GPU time of one call (CUDA-graph replay of 20 calls, so the host path is not in it), host µs per call,
and the floor: the bytes two passes move (K and V read twice, int8 K and e4m3 Vᵀ written once) at the rate of a
device-to-device copy measured in the same run.

    python benchmarks/attention_prepass.py [--baseline-src OLD/src] [--label X]   # GPU
    python benchmarks/attention_prepass.py --smoke                                   # CPU, interpreter, tiny
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

ROWS_MARK = "ATTENTION_PREPASS_ROWS "
SHAPES = {"mha": (2, 32), "8b": (1, 8)}  # (batch, KV heads)


def copy_gbs(device) -> float:
    """Device-to-device copy rate (bytes read + written per second) of 1 GiB, median of 10 timed copies."""
    from thrifty.bench import time_fn

    src = torch.empty(1 << 29, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), warmup=2, reps=10, device=device)
    return 2 * src.numel() * 2 / t.median_ms / 1e6


def graph_us(fn, calls: int = 20) -> float:
    """GPU µs per call: ``calls`` calls captured in one CUDA graph (``bench.capture_graph``), replayed 5 times,
    median."""
    from thrifty.bench import capture_graph, time_fn

    graph, _ = capture_graph(fn, warmup=3, repeat=calls)
    return time_fn(graph.replay, warmup=1, reps=5, device="cuda").median_ms * 1e3 / calls


def measure(args) -> list:
    from thrifty.attention import gluon_kernel as G, routing
    from thrifty.attention.attn_kernel import kernel_config
    from thrifty.attention.quant_kernel import quantize_kv
    from thrifty.bench import host_us_per_call

    dev = torch.device("cuda" if not args.smoke else "cpu")
    rows = []
    for D in map(int, args.dims.split(",")):
        for S in map(int, args.seqs.split(",")):
            for name, (B, H) in SHAPES.items():
                gluon = not args.smoke and routing.prefill_goes_to_gluon(D, S, True, (9, 0))
                block = G.gluon_config(D, True)["scale_block"] if gluon else kernel_config(D, dev)["block_n"]
                g = torch.Generator(device=dev).manual_seed(0)
                k, v = (torch.randn(B, H, S, D, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(2))
                call = lambda: quantize_kv(k, v, qmax=127.0, block_n=block, smooth_k=True, fp8_v=True,
                                           smooth_v=False, v_perm16=gluon)
                row = dict(shape=name, B=B, H_kv=H, D=D, S=S, block=block, v_perm16=gluon)
                if args.smoke:
                    call()
                    rows.append(dict(row, gpu_us=None))
                    continue
                kv_bytes = 2 * B * H * S * D * 2
                row.update(gpu_us=graph_us(call), host_us=host_us_per_call(call, calls=200, warmup=20, device=dev),
                           floor_bytes=2 * kv_bytes + kv_bytes // 2)
                rows.append(row)
                print(f"  {name:4s} D={D:3d} S={S:6d}: {row['gpu_us']:8.1f} µs GPU, {row['host_us']:6.1f} µs host",
                      flush=True)
                del k, v
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--seqs", default="2048,4096,8192,32768")
    ap.add_argument("--baseline-src", default=None, help="src/ of another thrifty tree, timed in the same run")
    ap.add_argument("--rows-only", action="store_true", help="print the rows (for --baseline-src) and stop")
    ap.add_argument("--label", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.dims, args.seqs = "64", "40"
    rows = measure(args)
    if args.rows_only:
        print(ROWS_MARK + json.dumps(rows), flush=True)
        return
    from thrifty.bench import print_table, rows_from_tree, write_result

    if args.baseline_src:
        extra_args = ["--rows-only", "--dims", args.dims, "--seqs", args.seqs] + (["--smoke"] if args.smoke else [])
        rows = [dict(r, tree="new") for r in rows] + rows_from_tree(__file__, args.baseline_src, extra_args,
                                                                     ROWS_MARK)
    summary = {}
    if not args.smoke:
        gbs = copy_gbs("cuda")
        summary["copy_gbs"] = gbs
        for r in rows:
            if r.get("gpu_us"):
                r["floor_us"] = r["floor_bytes"] / gbs / 1e3
                r["vs_floor"] = r["gpu_us"] / r["floor_us"]
        for r in rows:
            if r.get("tree", "new") == "new" and r.get("gpu_us"):
                key = f"{r['shape']}_d{r['D']}_s{r['S'] // 1024}k"
                summary[f"prepass_us_{key}"] = r["gpu_us"]
                old = next((b for b in rows if b.get("tree") == "baseline" and b.get("gpu_us")
                            and all(b[x] == r[x] for x in ("shape", "D", "S"))), None)
                if old:
                    summary[f"prepass_speedup_vs_baseline_{key}"] = old["gpu_us"] / r["gpu_us"]
    print_table(rows)
    print(json.dumps(summary, indent=1))
    path = write_result("attention_prepass", rows, summary, device=args.label,
                        results_dir=None if not args.smoke else "/tmp")
    print(path)


if __name__ == "__main__":
    sys.exit(main())
