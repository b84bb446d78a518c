"""Passkey retrieval: dense vs ShadowKV vs the Quest-style baseline at the same budget, on filler text from the
corpus (thrifty.data validation split), with a transformers checkpoint (default: the real SmolLM2-135M, Q4_1).

RULER-style rows: accuracy per method, prompt length and needle depth. On the GPU box with a model trained to
retrieve (issue #19), run it at 4K-16K; here it runs tiny (``--lengths 1024 --samples 2``) to prove it works.

    PYTHONPATH=src THRIFTY_DATA=/work/main/data python benchmarks/shadowkv_needle.py --lengths 1024 --samples 2
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from thrifty import bench
from thrifty.data import TokenDataset
from thrifty.kvcache import ShadowKVConfig
from thrifty.kvcache.needle import evaluate_passkey
from thrifty.paths import data_dir
from thrifty.pretrained import ensure_converted


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF checkpoint folder (default: SmolLM2-135M from thrifty.pretrained)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.25, 0.75])
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--rank", type=int, default=160)
    ap.add_argument("--outliers", type=int, default=4)
    ap.add_argument("--name", default="shadowkv_needle")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    path = args.model or str(ensure_converted())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(device).eval()
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    filler = TokenDataset(data_dir() / "corpus", "validation").tokens
    common = dict(rank=args.rank, chunk_size=8, sparse_budget=args.budget, outlier_chunks=args.outliers,
                  local_chunks=4, min_prompt_len=min(args.lengths), max_generated=16)
    methods = {"dense": None, "shadowkv": ShadowKVConfig(**common),
               "quest": ShadowKVConfig(**common, selector="quest")}
    t0 = time.time()
    rows = evaluate_passkey(model, lambda s: tok.encode(s).ids, tok.decode, filler, args.lengths, args.depths,
                            args.samples, methods, progress=lambda w: tqdm(w, desc="passkey"))
    acc = {m: sum(r["accuracy"] for r in rows if r["method"] == m) / (len(rows) / len(methods)) for m in methods}
    bench.print_table(rows, ["method", "length", "depth", "accuracy", "n"])
    summary = {"needle_acc_dense": acc["dense"], "needle_acc_shadowkv": acc["shadowkv"],
               "needle_acc_quest": acc["quest"],
               "needle_gap_vs_dense_points": 100 * (acc["shadowkv"] - acc["dense"])}
    extra = {"model": path, "settings": vars(args), "seconds": time.time() - t0,
             "note": "the untrained-for-retrieval SmolLM2-135M (Q4_1): a check that the evaluator runs, not the "
                     "issue's retrieval goal"}
    rows = [dict(r, setting=f"{r['length']} @ {r['depth']}") for r in rows]
    bench.write_result(args.name, rows, summary, extra=extra,
                       plot=dict(x="setting", y="accuracy", hue="method", title="passkey retrieval"))


if __name__ == "__main__":
    main()
