"""NeuZip block decode vs a copy of the same bf16 bytes: one launch per transformer block (issue: item 2).

Blocks (bf16, **random N(0, 0.02) init** unless said; the ratio of trained bf16 weights is within ~0.01 of it):
  llama-3.2-1b  hidden 2048, intermediate 8192, 32 heads / 8 kv heads, head_dim 64: q, k, v, o, gate, up, down
                (60.8M weights, 121.6 MB of bf16) -- the headline (``block_decode_vs_copy``)
  30m           thrifty's 30m preset (hidden 384, intermediate 1024, 6/2 heads): 1.57M weights, the small block
                of the earlier model runs
  smollm2-real  layer 7 of SmolLM2-135M, real (Q4_1-dequantized) weights, when ``$THRIFTY_DATA`` has them
Per block: bit-exactness against the input, the launch shape, host µs per ``decode_into`` call (the cached
launcher; the GPU keeps up for the 200 calls timed), GPU-only µs of the decode and of ``dst.copy_(src)`` of the
same bf16 bytes (L2 flushed before each call), and the byte floor (bytes the decode moves / bytes the copy moves).

    python benchmarks/neuzip_decode.py [--baseline-src OLD/src]   # GPU; OLD/src: another tree, timed in the same run
                                                                  # (summary: *_baseline, block_decode_speedup_vs_baseline)
    python benchmarks/neuzip_decode.py --smoke                    # CPU, tiny blocks, the Triton interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

BLOCKS = {
    "llama-3.2-1b": dict(hidden=2048, inter=8192, heads=32, kv_heads=8, head_dim=64),
    "30m": dict(hidden=384, inter=1024, heads=6, kv_heads=2, head_dim=64),
}
SMOKE_BLOCKS = {"smoke": dict(hidden=64, inter=160, heads=4, kv_heads=2, head_dim=16)}
ROWS_MARK = "NEUZIP_DECODE_ROWS "


def block_weights(shape: dict, device, seed: int = 0) -> list:
    """The 7 linear weights of a Llama block ([out, in], as nn.Linear stores them), N(0, 0.02) in bf16."""
    h, f, d = shape["hidden"], shape["inter"], shape["head_dim"]
    dims = [(shape["heads"] * d, h), (shape["kv_heads"] * d, h), (shape["kv_heads"] * d, h), (h, shape["heads"] * d),
            (f, h), (f, h), (h, f)]
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [(torch.randn(o, i, generator=g) * 0.02).to(torch.bfloat16).to(device) for o, i in dims]


def real_block(device) -> list | None:
    from thrifty.paths import data_dir

    path = data_dir() / "smollm2-135m" / "model.safetensors"
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        names = sorted(n for n in f.keys() if "layers.7." in n and n.endswith("proj.weight"))
        return [f.get_tensor(n).to(torch.bfloat16).to(device) for n in names]


def measure(name: str, weights: list, device, smoke: bool) -> dict:
    from thrifty import bench
    from thrifty.neuzip.block_decode import pack_tensors

    pack = pack_tensors(weights)
    n = pack.total_numel
    impl = "triton"
    buf = torch.empty(n, dtype=torch.bfloat16, device=device)
    pack.decode_into(buf, impl)
    want = torch.cat([w.reshape(-1) for w in weights])
    launch = tuple(pack.launch_table(device))
    row = {"block": name, "params": n, "tensors": len(pack.numels), "programs": launch[1],
           "launch": f"g{launch[2]}w{launch[3]}" if len(launch) > 2 else "g4w4",
           "ratio_vs_bf16": pack.nbytes / (2 * n),
           "pair_tensors": sum(getattr(pack, "pairs", [])),  # tensors coded in pair symbols (format 4; 0 before)
           "exact": bool(torch.equal(buf.view(torch.int16), want.view(torch.int16))),
           # a decode reads the pack and writes bf16; a copy reads and writes bf16
           "byte_floor_vs_copy": (pack.nbytes + 2 * n) / (4 * n)}
    calls = 1 if smoke else 200
    for _ in range(0 if smoke else 3):
        pack.decode_into(buf, impl)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        pack.decode_into(buf, impl)
    row["block_decode_host_us"] = (time.perf_counter() - t) / calls * 1e6
    if device.type == "cuda":
        torch.cuda.synchronize()
        src, dst = torch.empty_like(buf), torch.empty_like(buf)
        dec = bench.time_fn(lambda: pack.decode_into(buf, impl), reps=100, flush_l2=True, gpu_only=True, device=device)
        cp = bench.time_fn(lambda: dst.copy_(src), reps=100, flush_l2=True, gpu_only=True, device=device)
        row.update(decode_gpu_us=dec.median_ms * 1e3, decode_spread_pct=dec.spread_pct, copy_gpu_us=cp.median_ms * 1e3,
                   block_decode_vs_copy=dec.median_ms / cp.median_ms,
                   decode_out_gbs=2 * n / (dec.median_ms * 1e-3) / 1e9, copy_out_gbs=2 * n / (cp.median_ms * 1e-3) / 1e9)
    return row


def all_rows(device, smoke: bool) -> list:
    rows = []
    blocks = SMOKE_BLOCKS if smoke else BLOCKS
    for name, shape in blocks.items():
        rows.append(measure(name, block_weights(shape, device), device, smoke))
        print(rows[-1], flush=True)
    real = None if smoke else real_block(device)
    if real is not None:
        rows.append(measure("smollm2-real", real, device, smoke))
        print(rows[-1], flush=True)
    return rows


def baseline_rows(src: str, smoke: bool) -> list:
    """The same measurements with another tree's thrifty (a subprocess), tagged ``tree=baseline``."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    args = [sys.executable, __file__, "--rows-only"] + (["--smoke"] if smoke else [])
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=540)
    lines = [l for l in out.stdout.splitlines() if l.startswith(ROWS_MARK)]
    if out.returncode != 0 or not lines:
        return [{"block": "baseline", "tree": "baseline", "error": out.stderr[-800:]}]
    return [dict(r, tree="baseline") for r in json.loads(lines[-1][len(ROWS_MARK):])]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="CPU, tiny block, Triton interpreter (not a result)")
    p.add_argument("--baseline-src", default=None, help="src/ of another thrifty tree, timed in the same run")
    p.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from thrifty import bench

    device = torch.device("cpu" if args.smoke else "cuda")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --smoke)")
    rows = all_rows(device, args.smoke)
    if args.rows_only:
        print(ROWS_MARK + json.dumps(rows), flush=True)
        return 0
    rows = [dict(r, tree="this") for r in rows]
    if args.baseline_src:
        rows += baseline_rows(args.baseline_src, args.smoke)
    head = next(r for r in rows if r["tree"] == "this" and r["block"] in ("llama-3.2-1b", "smoke"))
    summary = {"block_decode_host_us": head["block_decode_host_us"], "block_exact": int(all(r.get("exact", 1) for r in rows)),
               "block_byte_floor_vs_copy": head["byte_floor_vs_copy"]}
    for r in rows:
        if "block_decode_vs_copy" in r:
            key = "block_decode_vs_copy" + ("" if r["block"] == "llama-3.2-1b" else "_" + r["block"].replace("-", "_"))
            summary[key + ("_baseline" if r["tree"] == "baseline" else "")] = r["block_decode_vs_copy"]
    for r in rows:  # old vs new, same run: baseline decode time / this tree's (> 1: the new decode is faster)
        old = next((b for b in rows if b["tree"] == "baseline" and b.get("block") == r["block"]), None)
        if r["tree"] == "this" and old and "decode_gpu_us" in r and "decode_gpu_us" in old:
            key = "block_decode_speedup_vs_baseline" + ("" if r["block"] == "llama-3.2-1b" else "_" + r["block"].replace("-", "_"))
            summary[key] = old["decode_gpu_us"] / r["decode_gpu_us"]
    results_dir = None
    if args.smoke:
        import tempfile

        results_dir = tempfile.mkdtemp(prefix="neuzip_decode_smoke_")
    path = bench.write_result("neuzip_decode", rows, summary, device="smoke" if args.smoke else bench.detect_device(device),
                              results_dir=results_dir,
                              extra={"weights": "random N(0, 0.02) bf16 except smollm2-real", "args": vars(args)})
    bench.print_table(rows, ["tree", "block", "params", "pair_tensors", "launch", "programs", "exact", "block_decode_host_us",
                             "decode_gpu_us", "copy_gpu_us", "block_decode_vs_copy", "byte_floor_vs_copy"])
    print("SUMMARY", summary)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
