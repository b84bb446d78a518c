"""The Gluon attention kernel alone, launched a few times per structure, for Nsight Compute (issue #28).

Each ``--variants`` entry (a ``gluon_config`` override, JSON) gets its own pre-pass output and ``--launches``
launches of ``gluon_kernel.launch`` on B=2, H=32 bf16 inputs; the first is the compile. Run it under ncu on the
GPU box, one profiled launch per variant (the last of each), e.g.

    ncu --clock-control none -k regex:_sage_fwd_gluon --launch-skip 2 --launch-skip-before-match 0 \\
        --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        --section ComputeWorkloadAnalysis python3 benchmarks/gluon_ncu.py --variants '{}' '{"rowsum_mma": true}'

(ncu numbers the matching launches over the whole process: with 3 launches per variant, profile launch 2 of
the first and ``--launch-skip 5`` for the second, or ``--launch-count`` = all and read them in order.)
"""

from __future__ import annotations

import argparse
import json

import torch

from thrifty.attention import gluon_kernel as G
from thrifty.attention.quant_kernel import quantize_kv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", default=["{}"])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--launches", type=int, default=3)
    args = ap.parse_args()
    B, H, S, D = 2, 32, args.seq, args.dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    for text in args.variants:
        over = json.loads(text)
        cfg = dict(G.gluon_config(D, args.causal), **over)
        kv = quantize_kv(k, v, qmax=127.0, block_n=cfg["scale_block"], smooth_k=True, fp8_v=True, smooth_v=False,
                         v_perm16=cfg["v_perm16"])
        prep = dict(q=q, qmax=127.0, sm_scale=D ** -0.5, smooth_v=False, **kv)
        out = torch.empty_like(q)
        for _ in range(args.launches):
            G.launch(prep, out, None, causal=args.causal, H=H, H_kv=H, Sq=S, Sk=S, config=over)
        torch.cuda.synchronize()
        print(f"variant {over}: {args.launches} launches, D={D} S={S} causal={args.causal}", flush=True)


if __name__ == "__main__":
    main()
