"""Cost of attention's NaN guard (issue #22): ``sage_attention`` (guard included: one isfinite pass over q, k, v
and a masked fill of the output) against ``sage_forward_triton`` (the kernels alone) and the guard alone, at
the attention benchmark's shapes. Writes benchmarks/results/nan_guard_<device>.json (+ PNG); summary keys
``guard_overhead_pct_<S>`` (sage_attention over sage_forward_triton, minus one).

GPU box:  PYTHONPATH=src python3 benchmarks/nan_guard.py
CPU smoke (tiny sizes, the Triton interpreter; numbers meaningless, results not written):
          TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/nan_guard.py --smoke
"""

from __future__ import annotations

import argparse
import os

import torch

from thrifty import bench


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (interpreter); nothing written")
    args = p.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from thrifty.attention import sage_attention
    from thrifty.attention.attn_kernel import sage_forward_triton
    from thrifty.attention.reference import nonfinite_rows

    dev = "cpu" if args.smoke else "cuda"
    B, H, D = (1, 2, 64) if args.smoke else (2, 32, 128)
    lengths = (64,) if args.smoke else (1024, 2048, 4096, 8192)
    reps = 2 if args.smoke else 30
    rows, summary = [], {}
    for S in lengths:
        q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
        scale = D ** -0.5
        cases = {
            "sage_attention (guarded)": lambda: sage_attention(q, k, v, causal=True, impl="triton"),
            "sage_forward_triton (kernels only)": lambda: sage_forward_triton(q, k, v, causal=True, sm_scale=scale),
            "guard alone": lambda: q.masked_fill(nonfinite_rows(q, k, v, True)[..., None], float("nan")),
        }
        times = {}
        for name, fn in cases.items():
            t = bench.time_fn(fn, warmup=1 if args.smoke else 5, reps=reps, device=dev)
            times[name] = t.median_ms
            rows.append(dict(S=S, call=name, median_ms=t.median_ms, spread_pct=t.spread_pct))
        pct = 100 * (times["sage_attention (guarded)"] / times["sage_forward_triton (kernels only)"] - 1)
        summary[f"guard_overhead_pct_{S}"] = pct
        summary[f"guard_alone_ms_{S}"] = times["guard alone"]
    bench.print_table(rows)
    print(summary)
    if not args.smoke:
        bench.write_result("nan_guard", rows, summary, extra={"shape": f"B={B} H={H} D={D} bf16 causal"},
                           plot=dict(x="S", y="median_ms", hue="call", title="attention NaN guard cost"))


if __name__ == "__main__":
    main()
