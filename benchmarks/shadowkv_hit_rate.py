"""Reuse (hit) rate of ShadowKV's selections on real text with the real SmolLM2-135M, CPU: the fraction of the
chunks selected at a decode step (per layer and KV head) that were also selected at the previous step, i.e. the
work the reuse buffer saves. ``benchmarks/shadowkv.py --hit-rate`` takes the figure.

The prompt runs densely, is compressed into a ShadowKV cache, and the continuation is fed one token at a time
(teacher forcing, the reference backend); the selections are recorded at every step of every layer.

    PYTHONPATH=src THRIFTY_DATA=/work/main/data python benchmarks/shadowkv_hit_rate.py --ctx 2048 4096 --samples 2
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from thrifty import bench
from thrifty.data import TokenDataset
from thrifty.kvcache import ShadowKVCache, ShadowKVConfig
from thrifty.kvcache import reference as ref
from thrifty.paths import data_dir
from thrifty.pretrained import ensure_converted


class SelectionLog:
    """Wraps ``reference.select_chunks``: per layer state, the previous step's picks; counts the repeats."""

    def __init__(self):
        self.prev, self.kept, self.total = {}, 0, 0
        self.inner = ref.select_chunks

    def __call__(self, q, state, config):
        ids, picked = self.inner(q, state, config)
        prev = self.prev.get(id(state))
        if prev is not None:
            same = (ids[..., :, None] == prev[..., None, :]).any(-1) & picked
            self.kept += int(same.sum())
            self.total += int(picked.sum())
        self.prev[id(state)] = ids
        return ids, picked


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--cont", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--outliers", type=int, default=ShadowKVConfig().outlier_chunks,
                    help="outlier chunks per KV head (default: ShadowKVConfig's)")
    ap.add_argument("--device-tag", default=None, help="file-name tag (default: detect_device())")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(str(ensure_converted()), dtype=torch.float32).eval()
    ds = TokenDataset(data_dir() / "corpus", "validation")
    rows, t0 = [], time.time()
    for ctx in args.ctx:
        span = ctx + args.cont
        starts = np.linspace(0, len(ds.tokens) - span - 1, args.samples).astype(np.int64)
        for budget in args.budgets:
            log = SelectionLog()
            ref.select_chunks = log
            try:
                for s in starts:
                    ids = torch.from_numpy(ds.tokens[s:s + span].astype(np.int64))[None]
                    dense = DynamicCache(config=model.config)
                    model(input_ids=ids[:, :ctx], past_key_values=dense, use_cache=True)
                    cfg = ShadowKVConfig(rank=160, chunk_size=8, sparse_budget=budget, outlier_chunks=args.outliers,
                                         local_chunks=4, min_prompt_len=min(ctx, 1024), max_generated=args.cont + 1)
                    cache = ShadowKVCache(model, cfg, impl="reference")
                    cache.load_prompt([(layer.keys, layer.values) for layer in dense.layers])
                    log.prev.clear()
                    for t in range(ctx, span):
                        model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            finally:
                ref.select_chunks = log.inner
            rate = log.kept / max(log.total, 1)
            rows.append(dict(ctx=ctx, budget=budget, budget_fraction=budget / ctx, hit_rate=rate,
                             picks=log.total, seconds=round(time.time() - t0, 1)))
            print(rows[-1], flush=True)
    bench.print_table(rows)
    summary = {f"hit_rate_{r['ctx']}_{r['budget']}": r["hit_rate"] for r in rows}
    bench.write_result("shadowkv_hit_rate", rows, summary,
                       extra={"model": "SmolLM2-135M-Instruct (Q4_1 dequantized, fp32)", "cont": args.cont,
                              "samples": args.samples, "teacher_forcing": True, "outlier_chunks": args.outliers},
                       device=args.device_tag)


if __name__ == "__main__":
    main()
