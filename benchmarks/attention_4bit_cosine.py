"""4-bit attention (SageAttention2-4b) on the real SmolLM2-135M: per-layer cosine similarity against fp64
attention on the layer's real Q, K, V (validation text of the thrifty corpus).

Variants (all with K smoothing, INT4-range Q·K on int8 arithmetic, e4m3 P̃·V):
  * ``4bit_api``: what ``sage_attention(config=SageConfig(qk_bits=4))`` runs: Q smoothed per group of 16 queries,
    ΔS added back, Q and K scales per token;
  * ``4bit_k_token_q64``: the same with Q smoothed per 64-query block;
  * ``4bit_block64``: the API before (Q smoothed per 64 queries, K scales per 64-key block);
  * ``4bit_paper_warp``: that with one Q scale per 16-query warp slice (the paper's Table 8 granularity);
  * ``4bit_no_smooth_q``: K smoothing only, K scales per 64-key block (thrifty's 4-bit before issue #20);
  * ``8bit``: the default 8-bit mode, for scale.
``--kernel-layers N`` also runs the Triton kernel (``qk_bits=4``; interpreter on CPU, slow) on the first N
layers and reports its cosine against the reference.

    python benchmarks/attention_4bit_cosine.py [--seq 512] [--windows 2] [--kernel-layers 2]
Writes benchmarks/results/attention_4bit_cosine_<device>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sage_accuracy import capture_qkv, load_model, windows  # noqa: E402

from thrifty import bench  # noqa: E402
from thrifty.attention import accuracy_metrics, exact_attention  # noqa: E402
from thrifty.attention.sage import SMOOTH_Q_BLOCK  # noqa: E402
from thrifty.attention.reference import K_GRANULARITY_4BIT, sage_attention_reference  # noqa: E402

COMMON = dict(qk_format="int4", smooth_k=True, k_granularity="block", block_n=64, block_m=64, warp_rows=16)
VARIANTS = {
    "4bit_api": dict(COMMON, smooth_q=True, q_granularity="token", k_granularity=K_GRANULARITY_4BIT,
                     block_m=SMOOTH_Q_BLOCK),
    "4bit_k_token_q64": dict(COMMON, smooth_q=True, q_granularity="token", k_granularity=K_GRANULARITY_4BIT),
    "4bit_block64": dict(COMMON, smooth_q=True, q_granularity="token"),
    "4bit_paper_warp": dict(COMMON, smooth_q=True, q_granularity="warp"),
    "4bit_no_smooth_q": dict(COMMON, smooth_q=False, q_granularity="token"),
    "8bit": dict(qk_format="int8"),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--kernel-layers", type=int, default=0)
    ap.add_argument("--windows", type=int, default=1, help="validation windows of --seq tokens (rows: layer x window)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model("smollm2", device)
    rows = []
    for w, (ids, _) in enumerate(windows(args.seq, args.windows, device=device)):
        captured = capture_qkv(model, ids)
        for layer, (q, k, v) in enumerate(captured):
            exact = exact_attention(q, k, v, causal=True)
            row = {"window": w, "layer": layer}
            for name, kw in VARIANTS.items():
                out = sage_attention_reference(q, k, v, causal=True, **kw)
                row[name] = accuracy_metrics(out, exact)["cos_sim"]
            if w == 0 and layer < args.kernel_layers:
                from thrifty.attention import SageConfig, sage_attention
                t = time.perf_counter()
                kern = sage_attention(q, k, v, causal=True, impl="triton", config=SageConfig(qk_bits=4))
                row["kernel_4bit"] = accuracy_metrics(kern, exact)["cos_sim"]
                from thrifty.attention.attn_kernel import kernel_config
                cfg = kernel_config(q.shape[-1], q.device)
                ref = sage_attention_reference(q, k, v, causal=True, **dict(VARIANTS["4bit_api"],
                                               block_n=cfg["block_n"]))
                row["kernel_vs_reference"] = accuracy_metrics(kern, ref)["cos_sim"]
                row["kernel_s"] = time.perf_counter() - t
            rows.append(row)
            print(f"window {w} layer {layer:2d} " + " ".join(f"{n}={row[n]:.6f}" for n in VARIANTS), flush=True)
    summary = {}
    for name in VARIANTS:
        vals = [r[name] for r in rows]
        summary[f"cos_{name}_worst"] = min(vals)
        summary[f"cos_{name}_mean"] = statistics.fmean(vals)
    if args.kernel_layers:
        summary["cos_kernel_vs_reference_worst"] = min(r["kernel_vs_reference"] for r in rows if "kernel_4bit" in r)
    extra = dict(model="SmolLM2-135M (Q4_1 dequantized)", seq=args.seq, windows=args.windows,
                 shape=list(captured[0][0].shape),
                 variants={n: {k: v for k, v in kw.items()} for n, kw in VARIANTS.items()},
                 interpreter=os.environ.get("TRITON_INTERPRET") == "1",
                 note="reference path (the kernel matches it to ~1e-5, tests/test_attention_4bit.py)")
    path = bench.write_result("attention_4bit_cosine", rows, summary, extra=extra)
    kernel_cols = ["kernel_4bit", "kernel_vs_reference"] if args.kernel_layers else []
    bench.print_table(rows, ["window", "layer", *VARIANTS, *kernel_cols])
    print(summary)
    print(path)


if __name__ == "__main__":
    main()
