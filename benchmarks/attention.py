"""Attention speed on the GPU: torch SDPA (flash, cuDNN), sageattention 1.0.6, thrifty 8-bit and 4-bit.

B=2, H=32, D ∈ {128, 64}, S ∈ {1k … 32k}, causal and not, bf16 inputs; TFLOP/s = 4·B·H·S²·D / time (halved
when causal); thrifty's time includes its quantization pre-pass (a "kernel only" row is the attention kernel
on pre-quantized inputs). Before timing: accuracy on real Q/K/V of SmolLM2-135M (all 30 layers, captured by
benchmarks/sage_accuracy.py --save-qkv build/attn_qkv) against fp32 attention, and a small kernel-config sweep.
Writes benchmarks/results/attention_<device>.json/png.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from thrifty import bench
from thrifty.attention import SageConfig, accuracy_metrics, exact_attention, sage_attention
from thrifty.attention.attn_kernel import kernel_config, launch, quantize_inputs, sage_forward_triton
from thrifty.attention.gluon_kernel import NARROW_D128_TILES, SMALL_D64_TILES

BF16 = torch.bfloat16
QKV_FILE = Path(__file__).resolve().parents[1] / "build" / "attn_qkv" / "smollm2_qkv.safetensors"


def real_accuracy(dev):
    """cos-sim etc. of thrifty 8/4-bit against fp32 attention on every layer's real Q/K/V."""
    rows = []
    if not QKV_FILE.is_file():
        print(f"no real Q/K/V at {QKV_FILE}: skipping real-data accuracy")
        return rows
    from safetensors.torch import load_file

    flat = load_file(str(QKV_FILE))
    layers = [tuple(flat[f"layer{i}.{n}"] for n in "qkv") for i in range(len(flat) // 3)]
    for bits in (8, 4):
        for i, (q, k, v) in enumerate(layers):
            q, k, v = (x.to(dev) for x in (q, k, v))
            ref = exact_attention(q, k, v, causal=True, dtype=torch.float32)
            out = sage_attention(q, k, v, causal=True, impl="triton" if dev.type == "cuda" else "reference",
                                 config=SageConfig(qk_bits=bits))
            m = accuracy_metrics(out, ref)
            rows.append(dict(group="real_accuracy", backend=f"thrifty{bits}", layer=i, S=q.shape[2], **m))
        worst = min(r["cos_sim"] for r in rows if r["backend"] == f"thrifty{bits}")
        print(f"real Q/K/V ({len(layers)} layers, S={layers[0][0].shape[2]}): thrifty {bits}-bit cos min {worst:.6f}")
    return rows


GLUON_VARIANTS = {  # --gluon: the Gluon kernel's structures (gluon_kernel.gluon_config overrides), timed beside the rest
    "thrifty8_gluon": {},  # the default (gluon_config)
    "thrifty8_gluon_ws1": dict(consumers=1, pingpong=False),  # one consumer warpgroup beside the producer warp
    # two consumer warpgroups + a producer warp (FA3 layout), running freely, P̃ moved between lanes
    "thrifty8_gluon_ws2": dict(consumers=2, pingpong=False, v_perm16=False),
    "thrifty8_gluon_ws2_vperm": dict(consumers=2, pingpong=False, v_perm16=True),  # + P̃ as it lies
}
# head_dim 64: the structures above run on its default 128x128 tiles (gluon_kernel.D64_TILES; ws2_vperm is the
# default there); beside them the 64x64 tiles, and FA3's ping-pong schedule on 64 query rows per consumer (128
# spill) with the same tiles without it
GLUON_D64_VARIANTS = {"thrifty8_gluon_ws2_64x64": dict(consumers=2, **SMALL_D64_TILES),
                      "thrifty8_gluon_n128": dict(block_m=64),
                      "thrifty8_gluon_pp_n128": dict(block_m=64, pingpong=True)}
# head_dim 128: FA3's ping-pong schedule (the causal default) with and without v_perm16, on 128-key tiles; and the
# 128-key tiles whatever the mask (the full default before 256-key tiles, gluon_kernel.D128_FULL_TILES)
GLUON_D128_VARIANTS = {"thrifty8_gluon_pp": dict(pingpong=True, v_perm16=False, **NARROW_D128_TILES),
                       "thrifty8_gluon_pp_vperm": dict(pingpong=True, v_perm16=True, **NARROW_D128_TILES),
                       "thrifty8_gluon_n128": dict(NARROW_D128_TILES)}


def gluon_structures(D):
    """{backend name: gluon_config override} of the Gluon variants that run at head_dim D."""
    return {**GLUON_VARIANTS, **(GLUON_D64_VARIANTS if D == 64 else GLUON_D128_VARIANTS)}


def gluon_variants(D):
    from thrifty.attention.gluon_kernel import sage_forward_gluon

    return [(name, None, lambda q, k, v, causal, over=over: sage_forward_gluon(
        q, k, v, causal=causal, sm_scale=q.shape[-1] ** -0.5, config=over))
        for name, over in gluon_structures(D).items()]


def variants(cfg_by_d, D, gluon=False, backends=None):
    out = _variants(cfg_by_d) + (gluon_variants(D) if gluon else [])
    return [v for v in out if not backends or v[0] in backends]


def _variants(cfg_by_d):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out = [("sdpa_flash", lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION]), sdpa),
           ("sdpa_cudnn", lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), sdpa)]
    try:
        from sageattention import sageattn
        out.append(("sageattention_1.0.6", None,
                    lambda q, k, v, causal: sageattn(q, k, v, tensor_layout="HND", is_causal=causal)))
    except Exception as e:
        print(f"sageattention unavailable: {e}")
    # what a user's call runs: sage_attention's own routing (impl="auto": the Gluon kernel on sm_90 at head_dim
    # 128 from 8K queries, else the Triton kernel), validation and host path included
    out.append(("thrifty8_auto", None, lambda q, k, v, causal: sage_attention(q, k, v, causal=causal)))
    for bits in (8, 4):
        out.append((f"thrifty{bits}", None, lambda q, k, v, causal, bits=bits: sage_forward_triton(
            q, k, v, causal=causal, sm_scale=q.shape[-1] ** -0.5, qk_bits=bits, config=cfg_by_d[q.shape[-1]])))
    return out


def sweep_configs(dev, D, S=8192, B=2, H=32):
    """A few tile shapes for the kernel alone at S=8k; returns the fastest (causal and non-causal summed)."""
    default = {k: kernel_config(D, dev)[k] for k in ("block_m", "block_n", "num_warps", "num_stages")}
    candidates = [default] + [c for c in (dict(block_m=64, block_n=128, num_warps=4, num_stages=3),
                                          dict(block_m=64, block_n=64, num_warps=4, num_stages=3),
                                          dict(block_m=128, block_n=64, num_warps=4, num_stages=3),
                                          dict(block_m=128, block_n=128, num_warps=8, num_stages=3)) if c != default]
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=BF16) for _ in range(3))
    rows, best = [], None
    for cfg in candidates:
        total = 0.0
        try:
            prep = quantize_inputs(q, k, v, sm_scale=D ** -0.5, config=cfg)
            out = torch.empty_like(q)
            for causal in (False, True):
                t = bench.time_fn(lambda: launch(prep, out, None, causal=causal, H=H, H_kv=H, Sq=S, Sk=S),
                                  warmup=2, reps=10, device=dev)
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                rows.append(dict(group="config_sweep", D=D, S=S, causal=causal, **cfg, ms=t.median_ms,
                                 rate=t.rate(flops)))
                total += t.median_ms
                print(f"  sweep D={D} {cfg} causal={causal}: {t.median_ms:.3f} ms {t.rate(flops):.1f} TOP/s", flush=True)
            if best is None or total < best[0]:
                best = (total, cfg)
        except Exception as e:
            rows.append(dict(group="config_sweep", D=D, **cfg, error=repr(e)[:300]))
            print(f"  sweep D={D} {cfg}: {e!r}"[:300])
    return (best[1] if best else kernel_config(D, dev)), rows


def speed(dev, D, seqs, cfg_by_d, budget_s, B=2, H=32, gluon=False, backends=None):
    rows = []
    for S in seqs:
        sets = [tuple(torch.randn(B, H, S, D, device=dev, dtype=BF16) for _ in range(3)) for _ in range(2)]
        idx = torch.cat([torch.arange(min(128, S)), torch.arange(max(S - 128, 128), S)]).to(dev)
        for causal in (False, True):
            flops = 4 * B * H * S * S * D / (2 if causal else 1)
            q0, k0, v0 = sets[0]  # fp32 reference for 256 query rows (non-causal: rows are independent)
            ref = None if causal else exact_attention(q0[:, :, idx], k0, v0, dtype=torch.float32)
            for name, ctx, fn in variants(cfg_by_d, D, gluon, backends):
                base = dict(group="speed", backend=name, D=D, S=S, causal=causal,
                            config=f"D{D} {S // 1024}k {'causal' if causal else 'full'}")
                vsets = [(q, k.clone(), v) for q, k, v in sets] if name.startswith("sageattention") else sets
                try:
                    with ctx() if ctx else contextlib.nullcontext():
                        out = fn(*vsets[0], causal)
                        cos = accuracy_metrics(out[:, :, idx], ref)["cos_sim"] if ref is not None else None
                        del out
                        t = bench.time_fn(lambda q, k, v: fn(q, k, v, causal), vsets, warmup=2, reps=20,
                                          min_reps=3, budget_s=budget_s, device=dev)
                        # GPU time alone (a spin kernel hides the host path): at S <= 2k one thrifty call
                        # costs more host time (3 launches, buffers) than GPU time, and SDPA's host path is shorter
                        tg = bench.time_fn(lambda q, k, v: fn(q, k, v, causal), vsets, warmup=1, reps=20,
                                           min_reps=3, budget_s=budget_s, gpu_only=True, device=dev)
                    rows.append(dict(base, ms=t.median_ms, rate=t.rate(flops), cos_vs_fp32=cos, reps=t.reps,
                                     ms_gpu_only=tg.median_ms, rate_gpu_only=tg.rate(flops)))
                    print(f"  D={D} S={S:6d} causal={causal!s:5} {name:20s} {t.median_ms:9.3f} ms "
                          f"{t.rate(flops):7.1f} TFLOP/s (GPU only {tg.median_ms:.3f} ms {tg.rate(flops):.1f})"
                          + (f" cos {cos:.6f}" if cos is not None else ""), flush=True)
                except Exception as e:
                    rows.append(dict(base, error=repr(e)[:300]))
                    print(f"  {base}: {e!r}"[:300], flush=True)
            # the kernel alone (pre-pass excluded), and the pre-pass alone
            try:
                q, k, v = sets[0]
                prep = quantize_inputs(q, k, v, sm_scale=D ** -0.5, config=cfg_by_d[D])
                o = torch.empty_like(q)
                t = bench.time_fn(lambda: launch(prep, o, None, causal=causal, H=H, H_kv=H, Sq=S, Sk=S),
                                  warmup=2, reps=20, min_reps=3, budget_s=budget_s, device=dev)
                tp = bench.time_fn(lambda: quantize_inputs(q, k, v, sm_scale=D ** -0.5, config=cfg_by_d[D]),
                                   warmup=2, reps=10, device=dev)
                rows.append(dict(group="speed", backend="thrifty8_kernel_only", D=D, S=S, causal=causal,
                                 config=base["config"], ms=t.median_ms, rate=t.rate(flops), prepass_ms=tp.median_ms))
                print(f"  D={D} S={S:6d} causal={causal!s:5} {'thrifty8_kernel_only':20s} {t.median_ms:9.3f} ms "
                      f"{t.rate(flops):7.1f} TOP/s  (pre-pass {tp.median_ms:.3f} ms)", flush=True)
                del prep, o
            except Exception as e:
                print(f"  kernel-only D={D} S={S}: {e!r}"[:300])
            if gluon:  # the Gluon kernel alone on its own pre-pass output, and its agreement with the Triton kernel
                rows += gluon_kernel_only(sets[0], D, S, causal, flops, cfg_by_d, budget_s, dev, H, backends)
        del sets
        torch.cuda.empty_cache()
    return rows


def gluon_kernel_only(qkv, D, S, causal, flops, cfg_by_d, budget_s, dev, H, backends=None):
    """Per Gluon variant (those named in ``backends`` if given): the attention launch alone (pre-pass excluded)
    and cos against the Triton kernel's output on the same inputs (both full rows: any S, causal or not)."""
    from thrifty.attention import gluon_kernel as G
    from thrifty.attention.quant_kernel import quantize_kv

    q, k, v = qkv
    ref = sage_forward_triton(q, k, v, causal=causal, sm_scale=D ** -0.5, config=cfg_by_d[D]).float()
    rows = []
    for name, over in gluon_structures(D).items():
        if backends and name not in backends:
            continue
        base = dict(group="speed", backend=f"{name}_kernel_only", D=D, S=S, causal=causal,
                    config=f"D{D} {S // 1024}k {'causal' if causal else 'full'}")
        try:
            cfg = dict(G.gluon_config(D, causal), **over)
            kv = quantize_kv(k, v, qmax=127.0, block_n=cfg["scale_block"], smooth_k=True, fp8_v=True,
                             smooth_v=False, v_perm16=cfg["v_perm16"])
            prep = dict(q=q, qmax=127.0, sm_scale=D ** -0.5, smooth_v=False, **kv)
            o = torch.empty_like(q)
            run = lambda: G.launch(prep, o, None, causal=causal, H=H, H_kv=H, Sq=S, Sk=S, config=over)
            run()
            cos = accuracy_metrics(o.float(), ref)["cos_sim"]
            t = bench.time_fn(run, warmup=2, reps=20, min_reps=3, budget_s=budget_s, device=dev)
            rows.append(dict(base, ms=t.median_ms, rate=t.rate(flops), cos_vs_triton=cos))
            print(f"  D={D} S={S:6d} causal={causal!s:5} {base['backend']:30s} {t.median_ms:9.3f} ms "
                  f"{t.rate(flops):7.1f} TOP/s  cos vs triton {cos:.7f}", flush=True)
        except Exception as e:
            rows.append(dict(base, error=repr(e)[:300]))
            print(f"  {base}: {e!r}"[:300], flush=True)
    return rows


def summarize(rows, real_rows):
    def rate(backend, D, S, causal, key="rate"):
        for r in rows:
            if (r.get("group") == "speed" and r["backend"] == backend and r["D"] == D and r["S"] == S
                    and r["causal"] == causal and key in r):
                return r[key]
        return None

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    # the keys are of the default route (thrifty8_auto) when it ran, else of the Triton kernel
    default = "thrifty8_auto" if any(r.get("backend") == "thrifty8_auto" and "rate" in r for r in rows) else "thrifty8"
    s = {"speedup_vs_cudnn_backend": default,
         "speedup_vs_cudnn_s32k_noncausal": ratio(rate(default, 128, 32768, False), rate("sdpa_cudnn", 128, 32768, False)),
         "speedup_vs_cudnn_s8k_causal": ratio(rate(default, 128, 8192, True), rate("sdpa_cudnn", 128, 8192, True))}
    cudnn_ratios = [(r["D"], ratio(r["rate"], rate("sdpa_cudnn", r["D"], r["S"], r["causal"]))) for r in rows
                    if r.get("group") == "speed" and r["backend"] == default and r["S"] >= 2048 and "rate" in r]
    s["speedup_vs_cudnn_min_s2k_plus"] = min((x for _, x in cudnn_ratios if x), default=None)
    s["speedup_vs_cudnn_d64_min"] = min((x for d, x in cudnn_ratios if x and d == 64), default=None)
    flash_ratios = [ratio(r["rate"], rate("sdpa_flash", r["D"], r["S"], r["causal"])) for r in rows
                    if r.get("group") == "speed" and r["backend"] == "thrifty8" and r["S"] >= 2048 and "rate" in r]
    flash_ratios = [x for x in flash_ratios if x]
    s["speedup_vs_flash_min_s2k_plus"] = min(flash_ratios) if flash_ratios else None
    # the same on GPU time alone (host launch path hidden for every backend alike)
    g = "rate_gpu_only"
    gpu_ratios = [ratio(r[g], rate("sdpa_flash", r["D"], r["S"], r["causal"], g)) for r in rows
                  if r.get("group") == "speed" and r["backend"] == "thrifty8" and r["S"] >= 2048 and g in r]
    gpu_ratios = [x for x in gpu_ratios if x]
    s["speedup_vs_flash_min_s2k_plus_gpu_only"] = min(gpu_ratios) if gpu_ratios else None
    # the two cuDNN keys above on GPU time, of the same backend (they read the Triton kernel's until 2026-11-28)
    s["speedup_vs_cudnn_s32k_noncausal_gpu_only"] = ratio(rate(default, 128, 32768, False, g),
                                                          rate("sdpa_cudnn", 128, 32768, False, g))
    s["speedup_vs_cudnn_s8k_causal_gpu_only"] = ratio(rate(default, 128, 8192, True, g),
                                                      rate("sdpa_cudnn", 128, 8192, True, g))
    s["cos_min_real"] = min((r["cos_sim"] for r in real_rows if r["backend"] == "thrifty8"), default=None)
    s["cos_min_real_4bit"] = min((r["cos_sim"] for r in real_rows if r["backend"] == "thrifty4"), default=None)
    for D in (128, 64):
        for S in (8192, 32768):
            for causal in (False, True):
                tag = f"d{D}_s{S // 1024}k_{'causal' if causal else 'full'}"
                for b in ("thrifty8_auto", "thrifty8", "thrifty8_kernel_only", "sdpa_cudnn", "sdpa_flash",
                          "sageattention_1.0.6"):
                    v = rate(b, D, S, causal)
                    if v:
                        s[f"{b}_tflops_{tag}"] = round(v, 1)
    # --gluon: every Gluon variant against cuDNN and the Triton kernel, per point (same run)
    for r in rows:
        if r.get("group") == "speed" and r["backend"].startswith("thrifty8_gluon") and "rate" in r:
            tag = f"d{r['D']}_s{r['S'] // 1024}k_{'causal' if r['causal'] else 'full'}"
            kernel_only = r["backend"].endswith("_kernel_only")
            s[f"{r['backend']}_vs_cudnn_{tag}"] = None if kernel_only else ratio(
                r["rate"], rate("sdpa_cudnn", r["D"], r["S"], r["causal"]))
            base = "thrifty8_kernel_only" if kernel_only else "thrifty8"
            s[f"{r['backend']}_vs_triton_{tag}"] = ratio(r["rate"], rate(base, r["D"], r["S"], r["causal"]))
            if "cos_vs_triton" in r:
                s[f"{r['backend']}_cos_vs_triton_{tag}"] = round(r["cos_vs_triton"], 7)
    return {k: v for k, v in s.items() if v is not None or not k.startswith("thrifty8_gluon")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--budget", type=float, default=0.6, help="seconds of timed calls per point at most")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test under TRITON_INTERPRET=1")
    ap.add_argument("--gluon", action="store_true",
                    help="also time the Gluon kernel (issue #28; its variants in GLUON_VARIANTS), end to end and "
                         "kernel-only with cos vs the Triton kernel; writes attention_gluon_<device>.json instead")
    ap.add_argument("--backends", default="", help="comma-separated backend names to time (default: all)")
    ap.add_argument("--no-real", action="store_true", help="skip the real Q/K/V accuracy pass")
    ap.add_argument("--label", default=None, help="file tag instead of the device name (e.g. h200-d64)")
    args = ap.parse_args()
    backends = set(filter(None, args.backends.split(",")))
    dev = torch.device(args.device)
    t0 = time.time()
    real_rows = [] if args.no_real else real_accuracy(dev)
    dims = [int(d) for d in args.dims.split(",")]
    cfg_by_d, sweep_rows = {}, []
    for D in dims:
        if args.no_sweep:
            cfg_by_d[D] = kernel_config(D, dev)
        else:
            cfg_by_d[D], r = sweep_configs(dev, D)
            sweep_rows += r
        print(f"D={D}: kernel config {cfg_by_d[D]}", flush=True)
    rows = []
    for D in dims:
        rows += speed(dev, D, [int(s) for s in args.seqs.split(",")], cfg_by_d, args.budget, gluon=args.gluon,
                      backends=backends)
    summary = summarize(rows, real_rows)
    summary["configs"] = {str(d): c for d, c in cfg_by_d.items()}
    summary["seconds"] = round(time.time() - t0, 1)
    for k, v in summary.items():
        print(f"{k}: {v}")
    plot_rows = [r for r in rows if "rate" in r]
    if dev.type != "cuda":
        return  # smoke test: nothing to record
    bench.write_result("attention_gluon" if args.gluon else "attention", rows + sweep_rows + real_rows, summary,
                       device=args.label,
                       extra=dict(B=2, H=32, dtype="bfloat16",
                                  notes=["thrifty rates include the quantization pre-pass except *_kernel_only",
                                         "since v3 Q is quantized inside the attention kernel: *_kernel_only "
                                         "includes Q's quantization, prepass_ms is K/V only",
                                         "cos_vs_fp32 on random inputs, non-causal, 256 query rows"]),
                       plot=dict(x="config", y="rate", hue="backend",
                                 title="attention B=2 H=32, bf16 (TFLOP/s; thrifty incl. pre-pass)")
                       if plot_rows else None)


if __name__ == "__main__":
    main()
