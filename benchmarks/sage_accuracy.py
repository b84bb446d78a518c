"""SageAttention2 accuracy on real attention inputs: the shape of the paper's Tables 2-5, plus perplexity.

Captures Q, K, V of every layer of the real SmolLM2-135M (30 layers, 9 heads / 3 KV heads, head_dim 64) on
validation text of the thrifty corpus, then compares quantized attention (the reference, which the kernel
matches to ~1e-6) against fp64 attention: cos-sim, relative L1, RMSE, average and worst over layers.
End to end: validation perplexity with full-precision, 8-bit, 4-bit and adaptive (calibrated) attention.
Runs on CPU or GPU:  python benchmarks/sage_accuracy.py [--model smollm2|CHECKPOINT_DIR --label NAME] [--seq 1024]
Updates that model's entry in benchmarks/results/sage_accuracy.json and rewrites sage_accuracy.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from thrifty import bench
from thrifty.attention import (SageConfig, accuracy_metrics, apply_plan, calibrate, exact_attention,
                               plan_from_scores, sage_seam, save_plan)
from thrifty.attention.reference import K_GRANULARITY_4BIT, SMOOTH_Q_BLOCK, sage_attention_reference
from thrifty.models import LlamaForCausalLM, sdpa_attention
from thrifty.pretrained import ensure_converted

RESULTS = Path(__file__).resolve().parent / "results"


def windows(seq, n, split="validation", seed=0, device="cpu"):
    from thrifty.data import TokenDataset
    from thrifty.paths import data_dir
    ds = TokenDataset(data_dir() / "corpus", split)
    return [tuple(t.to(device) for t in ds.batch(1, seq, seed=seed + i)) for i in range(n)]


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
    out["final/sage2-4b (kernel: int4 Q and K per token, smooth Q per 16 queries + K)"] = dict(
        qk_format="int4", k_granularity=K_GRANULARITY_4BIT, smooth_q=True, block_m=SMOOTH_Q_BLOCK)
    out["final/sage2-4b smooth K only (Q token, K block)"] = dict(qk_format="int4")
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


def load_model(spec, device):
    """``smollm2`` (the real pretrained model) or a checkpoint folder written by ``thrifty pretrain``."""
    if spec == "smollm2":
        return LlamaForCausalLM.from_pretrained(ensure_converted(progress=False), device=device).eval()
    return LlamaForCausalLM.from_pretrained(spec, device=device).eval()


def end_to_end(model, args, device):
    """Validation perplexity: full precision, 8-bit, 4-bit, and adaptive plans calibrated on other windows.
    4-bit layers of the plans use Q+K smoothing (the paper's 4-bit recipe); calibration scores are
    cos·(1 − rel L1) of that 4-bit attention against the layer's exact attention."""
    evals = windows(args.seq, args.eval_windows, seed=0, device=device)
    calib = [x for x, _ in windows(args.seq, args.calib_windows, seed=500, device=device)]
    ppl = {}
    model.set_attention(sdpa_attention)
    ppl["full precision (fp32 SDPA)"] = perplexity(model, evals)
    model.set_attention(sage_seam(impl="reference"))
    ppl["sage2 8-bit (int8 QK, e4m3 PV)"] = perplexity(model, evals)
    model.set_attention(sage_seam(impl="reference", config=SageConfig(qk_bits=4, smooth_q=False)))
    ppl["sage2 4-bit QK (smooth K)"] = perplexity(model, evals)
    model.set_attention(sage_seam(impl="reference", config=SageConfig(qk_bits=4, smooth_q=True)))
    ppl["sage2 4-bit QK (smooth Q+K)"] = perplexity(model, evals)
    model.set_attention(sdpa_attention)
    plan_opts = dict(impl="reference", config=SageConfig(smooth_q=True))
    _, scores = calibrate(model, calib, threshold=0.0, return_scores=True, **plan_opts)
    plans = {}
    for threshold in args.thresholds:
        plan = plan_from_scores(scores, threshold)
        apply_plan(model, plan, **plan_opts)
        n4 = sum(b == 4 for b in plan.values())
        ppl[f"adaptive, threshold {threshold} ({n4}/{len(plan)} layers 4-bit)"] = perplexity(model, evals)
        plans[str(threshold)] = {str(k): v for k, v in plan.items()}
        model.set_attention(sdpa_attention)
        if threshold == args.thresholds[len(args.thresholds) // 2]:  # the middle one, as a loadable plan file
            save_plan(plan, RESULTS / f"sage_plan_{args.label}.json", scores=scores, model=args.label,
                      threshold=threshold, seq=args.seq, smooth_q=True)
    return ppl, scores, plans


def run_model(args, device):
    t0 = time.time()
    model = load_model(args.model, device)
    (ids, _), = windows(args.seq, 1, seed=1000, device=device)
    captured = capture_qkv(model, ids)
    print(f"{args.label}: captured {len(captured)} layers of q {tuple(captured[0][0].shape)} "
          f"k {tuple(captured[0][1].shape)} on {device}")
    if args.save_qkv:
        Path(args.save_qkv).mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file  # never pickle

        save_file({f"layer{i}.{n}": t.bfloat16().contiguous().cpu() for i, qkv in enumerate(captured)
                   for n, t in zip("qkv", qkv)}, str(Path(args.save_qkv) / f"{args.label}_qkv.safetensors"))
    rows = layer_table(captured)
    del captured
    ppl, scores, plans = end_to_end(model, args, device)
    for k, v in ppl.items():
        print(f"ppl {k}: {v:.4f}")
    pick = lambda prefix, key: next(r[key] for r in rows if r["variant"].startswith(prefix))  # noqa: E731
    summary = dict(cos_min_8bit_kernel_config=pick("sage2-8b (kernel", "cos_min"),
                   cos_avg_8bit_kernel_config=pick("sage2-8b (kernel", "cos_avg"),
                   cos_min_4bit_kernel_config=pick("sage2-4b (kernel", "cos_min"),
                   cos_avg_4bit_kernel_config=pick("sage2-4b (kernel", "cos_avg"),
                   cos_min_4bit_paper_config=pick("sage2-4b per-thread", "cos_min"),
                   ppl=ppl, seconds=round(time.time() - t0, 1))
    return dict(model=args.description or args.label, meta=bench.env_info(str(device)), layers=len(scores), seq=args.seq,
                eval_windows=args.eval_windows, device=str(device), text="thrifty corpus validation split",
                reference="fp64 exact attention on the same captured Q/K/V", summary=summary, rows=rows,
                calibration_scores={str(k): v for k, v in scores.items()}, plans=plans)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", help="smollm2, or a checkpoint folder from thrifty pretrain")
    ap.add_argument("--label", default="smollm2-135m", help="the model's key in the results file")
    ap.add_argument("--description", default="SmolLM2-135M (Q4_1-dequantized GGUF)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--eval-windows", type=int, default=4)
    ap.add_argument("--calib-windows", type=int, default=2)
    ap.add_argument("--thresholds", type=lambda s: [float(x) for x in s.split(",")], default=[0.8, 0.85, 0.9, 0.95])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--save-qkv", type=str, default=None, help="save bf16 Q/K/V of every layer here (for the GPU benchmark)")
    args = ap.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(0)
    entry = run_model(args, device)

    # one results file for every model measured: this run replaces its own model's entry
    path = RESULTS / "sage_accuracy.json"
    doc = json.loads(path.read_text()) if path.is_file() else {}
    doc = dict(name="sage_accuracy", models=doc.get("models", {}))
    doc["models"][args.label] = entry
    doc["summary"] = {f"{key}_{label}": m["summary"][key] for label, m in doc["models"].items()
                      for key in ("cos_min_8bit_kernel_config", "cos_min_4bit_kernel_config", "cos_min_4bit_paper_config")
                      if key in m["summary"]}
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    (RESULTS / "sage_accuracy.md").write_text(markdown(doc))
    print(f"wrote {path} and .md ({args.label}, {entry['summary']['seconds']} s)")


def markdown(doc):
    lines = ["# SageAttention2 accuracy on real Q/K/V", "",
             "Written by benchmarks/sage_accuracy.py. Metrics of each variant against fp64 exact attention on the "
             "same captured (post-RoPE) Q/K/V of every layer, causal, one window of validation text of the thrifty "
             "corpus; average and worst over layers.", ""]
    titles = {"granularity": "Q/K granularity (P·V in fp32, K smoothed; paper Table 2)",
              "smoothing": "Smoothing (Q per-warp, K per-block, P·V fp32; paper Table 3)",
              "pv": "P̃·V format (Q·K in fp32; paper Table 4)",
              "final": "Full pipelines (paper Table 5)"}
    for label, m in doc["models"].items():
        lines += [f"## {m['model']}", "", f"{m['layers']} layers, a {m['seq']}-token window, run on {m['device']}.", ""]
        for table, title in titles.items():
            lines += [f"### {title}", "",
                      "| variant | cos avg | cos worst | rel L1 avg | rel L1 worst | RMSE avg | RMSE worst |",
                      "|---|---|---|---|---|---|---|"]
            for r in m["rows"]:
                if r["table"] == table:
                    lines.append(f"| {r['variant']} | {r['cos_avg']:.6f} | {r['cos_min']:.6f} | {r['l1_avg']:.4f} | "
                                 f"{r['l1_max']:.4f} | {r['rmse_avg']:.2e} | {r['rmse_max']:.2e} |")
            lines.append("")
        lines += ["### End to end: validation perplexity", "",
                  f"{m['eval_windows']} windows of {m['seq']} tokens. Adaptive plans: 4-bit (Q+K smoothed) where the "
                  "layer's calibration score cos·(1 − rel L1) reaches the threshold, else 8-bit.", "",
                  "| attention | perplexity |", "|---|---|"]
        lines += [f"| {k} | {v:.4f} |" for k, v in m["summary"]["ppl"].items()]
        lines += ["", "Calibration scores (4-bit, per layer): " +
                  ", ".join(f"{k}: {v:.3f}" for k, v in m["calibration_scores"].items()), ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
