"""ShadowKV accuracy on real text with the real SmolLM2-135M (Q4_1 weights dequantized; 8K context), CPU.

For each context length and configuration, on windows of the corpus' validation split:
* attention-output cosine: at every decode step and layer, ShadowKV's attention output against dense attention
  over the exact keys/values of the same run (same query): the error of one sparse step;
* perplexity of the continuation tokens, decoded one at a time (teacher forcing) through the sparse cache,
  against the dense model's perplexity on the same tokens;
* greedy agreement: the fraction of continuation positions where the sparse run's argmax equals the dense one.

Rows: ``method`` (shadowkv / shadowkv-fp8 / quest), ``budget`` (tokens), ``ctx``. Writes
``benchmarks/results/shadowkv_accuracy_cpu.json`` + PNG.

    PYTHONPATH=src THRIFTY_DATA=/work/main/data python benchmarks/shadowkv_accuracy.py --ctx 2048 --samples 4
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from thrifty import bench
from thrifty.data import TokenDataset
from thrifty.kvcache import ShadowKVCache, ShadowKVConfig
from thrifty.kvcache import reference as ref
from thrifty.paths import data_dir
from thrifty.pretrained import ensure_converted


class AttentionProbe:
    """Wraps a cache's engine: keeps the exact keys/values of the run and, at every decode step of every layer,
    compares the sparse attention output with dense attention over them."""

    def __init__(self, engine):
        self.engine, self.full, self.cosines = engine, {}, []
        self._prefill, self._decode = engine.prefill, engine.decode
        engine.prefill, engine.decode = self.prefill, self.decode

    def prefill(self, layer, k_post, v, lengths, k_pre=None):
        self.full[layer] = (k_post, v)
        return self._prefill(layer, k_post, v, lengths, k_pre)

    def decode(self, layer, q, k_new, v_new, scale):
        out = self._decode(layer, q, k_new, v_new, scale)
        k, v = self.full[layer]
        k, v = torch.cat((k, k_new), 2), torch.cat((v, v_new), 2)
        self.full[layer] = (k, v)
        lengths = torch.full((q.shape[0],), k.shape[2])
        dense = ref.dense_attention(q, k, v, lengths, scale)
        self.cosines.append(F.cosine_similarity(out.float().flatten(2), dense.float().flatten(2), dim=-1).mean().item())
        return out


@torch.no_grad()
def dense_run(model, ids, ctx):
    """One dense forward over prompt + continuation: the reference logits, and the prompt's keys/values."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0].float()
    cache.crop(ctx)
    return logits[ctx - 1:-1], [(layer.keys, layer.values) for layer in cache.layers]


@torch.no_grad()
def sparse_run(model, ids, ctx, config, prompt_kv, first_logits):
    """The prompt (already run densely) compressed into a ShadowKV cache; the continuation fed one token at a
    time. The first continuation token's logits are the dense prefill's, as in ShadowKV."""
    cache = ShadowKVCache(model, config)
    cache.load_prompt(prompt_kv)
    if cache.dense:
        raise RuntimeError("the cache stayed dense: lower min_prompt_len")
    probe = AttentionProbe(cache.engine)
    for layer, (k, v) in enumerate(prompt_kv):
        probe.full[layer] = (k, v)
    logits = [first_logits]
    for t in range(ctx, ids.shape[1] - 1):
        logits.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits[0, -1].float())
    return torch.stack(logits), probe.cosines, cache.host_bytes_per_sequence()


def nll(logits, targets):
    return F.cross_entropy(logits, targets).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048])
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--cont", type=int, default=48, help="continuation tokens decoded per sample")
    ap.add_argument("--rank", type=int, default=160)
    ap.add_argument("--outliers", type=int, default=8)
    ap.add_argument("--extra-budget", type=int, default=512, help="budget of the fp8 and Quest rows")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-baselines", action="store_true", help="skip the fp8 and Quest rows")
    ap.add_argument("--name", default="shadowkv_accuracy", help="result file name (a rank sweep writes its own)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ensure_converted()), dtype=torch.float32).eval()
    ds = TokenDataset(data_dir() / "corpus", "validation")
    methods = [("shadowkv", b, "native") for b in args.budgets]
    if not args.no_baselines:
        methods += [("shadowkv-fp8", args.extra_budget, "fp8"), ("quest", args.extra_budget, "native")]
    rows, t0 = [], time.time()
    for ctx in args.ctx:
        span = ctx + args.cont
        starts = np.linspace(0, len(ds.tokens) - span - 1, args.samples).astype(np.int64)
        acc = {m: {"cos": [], "nll": [], "agree": [], "host": 0} for m in methods}
        dense_nll = []
        for s in tqdm(starts, desc=f"ctx {ctx}"):
            ids = torch.from_numpy(ds.tokens[s:s + span].astype(np.int64))[None]
            targets = ids[0, ctx:]
            ref_logits, prompt_kv = dense_run(model, ids, ctx)
            dense_nll.append(nll(ref_logits, targets))
            for m in methods:
                name, budget, host = m
                cfg = ShadowKVConfig(rank=args.rank, chunk_size=8, sparse_budget=budget, outlier_chunks=args.outliers,
                                     local_chunks=4, min_prompt_len=min(ctx, 1024), host_values=host,
                                     selector="quest" if name == "quest" else "shadowkv")
                logits, cos, host_bytes = sparse_run(model, ids, ctx, cfg, prompt_kv, ref_logits[0])
                acc[m]["cos"] += cos
                acc[m]["nll"].append(nll(logits, targets))
                acc[m]["agree"].append((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item())
                acc[m]["host"] = host_bytes
        d_ppl = math.exp(float(np.mean(dense_nll)))
        rows.append({"method": "dense", "setting": f"ctx {ctx}", "budget": ctx, "ctx": ctx, "ppl": d_ppl, "ppl_ratio": 1.0,
                     "attn_cos_mean": 1.0, "attn_cos_p01": 1.0, "greedy_agree": 1.0})
        for m in methods:
            name, budget, _ = m
            cos = np.array(acc[m]["cos"])
            ppl = math.exp(float(np.mean(acc[m]["nll"])))
            rows.append({"method": name, "setting": f"ctx {ctx} budget {budget}", "budget": budget, "ctx": ctx, "ppl": ppl, "ppl_ratio": ppl / d_ppl,
                         "attn_cos_mean": float(cos.mean()), "attn_cos_p01": float(np.quantile(cos, 0.01)),
                         "greedy_agree": float(np.mean(acc[m]["agree"])), "host_bytes_per_seq": acc[m]["host"]})
    bench.print_table(rows, ["method", "ctx", "budget", "ppl", "ppl_ratio", "attn_cos_mean", "attn_cos_p01",
                             "greedy_agree", "host_bytes_per_seq"])
    main_rows = [r for r in rows if r["method"] == "shadowkv"]
    summary = {
        "ppl_ratio_at_min_budget": max(main_rows, key=lambda r: -r["budget"])["ppl_ratio"],
        "greedy_agree_at_min_budget": max(main_rows, key=lambda r: -r["budget"])["greedy_agree"],
        "attn_cos_mean_at_min_budget": max(main_rows, key=lambda r: -r["budget"])["attn_cos_mean"],
        "fp8_ppl_ratio": next((r["ppl_ratio"] for r in rows if r["method"] == "shadowkv-fp8"), None),
        "quest_ppl_ratio": next((r["ppl_ratio"] for r in rows if r["method"] == "quest"), None),
    }
    extra = {"model": "SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to fp32 (thrifty.pretrained)",
             "text": "thrifty.data validation split (Debian documentation), evenly spaced windows",
             "settings": vars(args), "seconds": time.time() - t0,
             "note": "rank/outliers scaled to the small model and context; chunk 8 and local 4 chunks as the paper"}
    bench.write_result(args.name, rows, summary, device="cpu", extra=extra,
                       plot=dict(x="setting", y="ppl_ratio", hue="method", ylabel="perplexity / dense",
                                 title=f"ShadowKV on SmolLM2-135M (Q4_1), rank {args.rank}, CPU"))


if __name__ == "__main__":
    main()
