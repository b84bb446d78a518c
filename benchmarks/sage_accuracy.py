"""SageAttention2 accuracy on real attention inputs: the shape of the paper's Tables 2-5, plus perplexity.

Captures Q, K, V of every layer of the real SmolLM2-135M (30 layers, 9 heads / 3 KV heads, head_dim 64) on
validation text of the thrifty corpus, then compares quantized attention (the reference, which the kernel
matches to ~1e-6) against fp64 attention: cos-sim, relative L1, RMSE, average and worst over layers.
End to end: validation perplexity with full-precision, 8-bit, 4-bit and adaptive (calibrated) attention.
Runs on CPU:  python benchmarks/sage_accuracy.py [--seq 1024] [--eval-windows 4] [--save-qkv DIR]
Writes benchmarks/results/sage_accuracy.json and sage_accuracy.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from thrifty.attention import accuracy_metrics, apply_plan, calibrate, exact_attention, sage_seam, save_plan
from thrifty.attention.reference import sage_attention_reference
from thrifty.models import LlamaForCausalLM, sdpa_attention
from thrifty.pretrained import ensure_converted

RESULTS = Path(__file__).resolve().parent / "results"


def windows(seq, n, split="validation", seed=0):
    from thrifty.data import TokenDataset
    ds = TokenDataset(Path(__file__).resolve().parents[1] / "data" / "corpus", split)
    return [ds.batch(1, seq, seed=seed + i) for i in range(n)]


def capture_qkv(model, ids):
    """Q, K, V (post-RoPE, as attention sees them) of every layer for one forward."""
    captured = []

    def recorder(q, k, v, *, causal, scale):
        captured.append((q.detach().clone(), k.detach().clone(), v.detach().clone()))
        return sdpa_attention(q, k, v, causal=causal, scale=scale)

    model.set_attention(recorder)
    with torch.no_grad():
        model(ids)
    model.set_attention(sdpa_attention)
    return captured


# Each variant: the reference's keywords. Q/K granularities follow the paper (warp: 16-query slices of a
# 128-query block, K per 64-key block; thread: the MMA row groups). "kernel" = what the Triton kernel does.
def variants():
    fp_pv = dict(pv="fp32")
    out = {}
    for bits in ("int4", "int8"):
        for g in ("token", "thread", "warp", "block", "tensor"):
            out[f"granularity/{bits}/{g}"] = dict(qk_format=bits, q_granularity=g, k_granularity=g, **fp_pv)
    for bits in ("int4", "int8"):
        for name, sm in (("none", {}), ("K", dict(smooth_k=True)), ("Q", dict(smooth_q=True)),
                         ("Q+K", dict(smooth_q=True, smooth_k=True))):
            kw = dict(smooth_k=False, smooth_q=False)
            kw.update(sm)
            out[f"smoothing/{bits}/{name}"] = dict(qk_format=bits, q_granularity="warp", k_granularity="block",
                                                   **kw, **fp_pv)
    for pv in ("int8", "e5m2", "e4m3", "fp16"):
        out[f"pv/{pv}"] = dict(qk_format="fp32", pv=pv)
    out["pv/e4m3/one-level-accum"] = dict(qk_format="fp32", pv="e4m3", two_level_accum=False)
    out["final/sage2-8b (kernel: Q token, K block, e4m3 PV, smooth K)"] = dict()
    out["final/sage2-8b per-warp"] = dict(q_granularity="warp")
    out["final/sage2-4b (kernel: int4 Q token, K block, smooth K)"] = dict(qk_format="int4")
    out["final/sage2-4b per-thread + smooth Q+K (paper)"] = dict(qk_format="int4", q_granularity="thread",
                                                                  k_granularity="thread", smooth_q=True)
    out["final/sage2-8b + smooth V"] = dict(smooth_v=True)
    return out


def layer_table(captured):
    exact = [exact_attention(q, k, v, causal=True) for q, k, v in captured]
    rows = []
    for name, kw in variants().items():
        per_layer = [accuracy_metrics(sage_attention_reference(q, k, v, causal=True, **kw), e)
                     for (q, k, v), e in zip(captured, exact)]
        group, _, variant = name.partition("/")
        row = dict(table=group, variant=variant,
                   cos_avg=statistics.mean(m["cos_sim"] for m in per_layer),
                   cos_min=min(m["cos_sim"] for m in per_layer),
                   l1_avg=statistics.mean(m["rel_l1"] for m in per_layer),
                   l1_max=max(m["rel_l1"] for m in per_layer),
                   rmse_avg=statistics.mean(m["rmse"] for m in per_layer),
                   rmse_max=max(m["rmse"] for m in per_layer),
                   worst_layer=min(range(len(per_layer)), key=lambda i: per_layer[i]["cos_sim"]))
        rows.append(row)
        print(f"{name:70s} cos avg {row['cos_avg']:.6f} min {row['cos_min']:.6f}  L1 avg {row['l1_avg']:.4f} "
              f"max {row['l1_max']:.4f}", flush=True)
    return rows


def perplexity(model, batches):
    losses = []
    with torch.no_grad():
        for x, y in batches:
            losses.append(float(model(x, y)))
    return float(torch.tensor(losses).mean().exp())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--eval-windows", type=int, default=4)
    ap.add_argument("--calib-windows", type=int, default=2)
    ap.add_argument("--threshold", type=float, default=0.985)
    ap.add_argument("--save-qkv", type=str, default=None, help="save bf16 Q/K/V of every layer here (for the GPU benchmark)")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    model = LlamaForCausalLM.from_pretrained(ensure_converted(progress=False)).eval()
    (ids, _), = windows(args.seq, 1, seed=1000)
    captured = capture_qkv(model, ids)
    print(f"captured {len(captured)} layers of q {tuple(captured[0][0].shape)} k {tuple(captured[0][1].shape)}")
    if args.save_qkv:
        Path(args.save_qkv).mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file  # never pickle

        save_file({f"layer{i}.{n}": t.bfloat16().contiguous() for i, qkv in enumerate(captured)
                   for n, t in zip("qkv", qkv)}, str(Path(args.save_qkv) / "smollm2_qkv.safetensors"))
    rows = layer_table(captured)

    # end to end: perplexity on validation windows; the adaptive plan is calibrated on other windows
    evals = windows(args.seq, args.eval_windows, seed=0)
    calib = [x for x, _ in windows(args.seq, args.calib_windows, seed=500)]
    ppl = {}
    model.set_attention(sdpa_attention)
    ppl["full precision (fp32 SDPA)"] = perplexity(model, evals)
    model.set_attention(sage_seam(impl="reference"))
    ppl["sage2 8-bit (int8 QK, e4m3 PV)"] = perplexity(model, evals)
    model.set_attention(sage_seam(impl="reference", qk_bits=4))
    ppl["sage2 4-bit QK (smooth K)"] = perplexity(model, evals)
    model.set_attention(sage_seam(impl="reference", qk_bits=4, smooth_q=True))
    ppl["sage2 4-bit QK (smooth Q+K)"] = perplexity(model, evals)
    model.set_attention(sdpa_attention)
    plan, scores = calibrate(model, calib, threshold=args.threshold, return_scores=True, impl="reference")
    save_plan(plan, RESULTS / "sage_accuracy_plan.json", scores=scores, model="SmolLM2-135M",
              threshold=args.threshold, seq=args.seq)
    apply_plan(model, plan, impl="reference")
    n4 = sum(b == 4 for b in plan.values())
    ppl[f"adaptive ({n4}/{len(plan)} layers 4-bit, threshold {args.threshold})"] = perplexity(model, evals)
    model.set_attention(sdpa_attention)
    for k, v in ppl.items():
        print(f"ppl {k}: {v:.4f}")

    summary = dict(
        cos_min_8bit_kernel_config=next(r["cos_min"] for r in rows if r["variant"].startswith("sage2-8b (kernel")),
        cos_avg_8bit_kernel_config=next(r["cos_avg"] for r in rows if r["variant"].startswith("sage2-8b (kernel")),
        cos_min_4bit_kernel_config=next(r["cos_min"] for r in rows if r["variant"].startswith("sage2-4b (kernel")),
        ppl=ppl, plan_4bit_layers=n4, seconds=round(time.time() - t0, 1))
    doc = dict(name="sage_accuracy", model="SmolLM2-135M (Q4_1-dequantized GGUF)",
               text="thrifty corpus validation split", seq=args.seq, eval_windows=args.eval_windows,
               reference="fp64 exact attention on the same captured Q/K/V", summary=summary, rows=rows,
               calibration_scores={str(k): v for k, v in scores.items()}, plan={str(k): v for k, v in plan.items()})
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sage_accuracy.json").write_text(json.dumps(doc, indent=1) + "\n")
    (RESULTS / "sage_accuracy.md").write_text(markdown(doc))
    print(f"wrote {RESULTS / 'sage_accuracy.json'} and .md in {summary['seconds']} s")


def markdown(doc):
    lines = [f"# SageAttention2 accuracy on real Q/K/V: {doc['model']}",
             "", f"All 30 layers, one {doc['seq']}-token window of {doc['text']}, causal; metrics against "
             f"{doc['reference']}; avg and worst over layers. Written by benchmarks/sage_accuracy.py.", ""]
    titles = {"granularity": "Q/K granularity (P·V in fp32, K smoothed; paper Table 2)",
              "smoothing": "Smoothing (Q per-warp, K per-block, P·V fp32; paper Table 3)",
              "pv": "P̃·V format (Q·K in fp32; paper Table 4)",
              "final": "Full pipelines (paper Table 5)"}
    for table, title in titles.items():
        lines += [f"## {title}", "", "| variant | cos avg | cos worst | rel L1 avg | rel L1 worst | RMSE avg | RMSE worst |",
                  "|---|---|---|---|---|---|---|"]
        for r in doc["rows"]:
            if r["table"] == table:
                lines.append(f"| {r['variant']} | {r['cos_avg']:.6f} | {r['cos_min']:.6f} | {r['l1_avg']:.4f} | "
                             f"{r['l1_max']:.4f} | {r['rmse_avg']:.2e} | {r['rmse_max']:.2e} |")
        lines.append("")
    lines += ["## End to end: validation perplexity", "", f"{doc['eval_windows']} windows of {doc['seq']} tokens.", "",
              "| attention | perplexity |", "|---|---|"]
    lines += [f"| {k} | {v:.4f} |" for k, v in doc["summary"]["ppl"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
