"""Anchors: the GPU's measured ceilings and the attention baselines thrifty is compared against.

    bash benchmarks/run_on_gpu.sh benchmarks/anchors.py      # on the GPU box (see benchmarks/README.md)
    python benchmarks/anchors.py --smoke                     # CPU plumbing check, tiny sizes

Ceilings (8192³ matrix products through cuBLAS in bf16, fp8 e4m3 and int8; HBM copy; pinned host<->device
copies) are measured at the start and again at the end, so their spread shows how steady the card was.
Attention: torch SDPA (flash, cuDNN, efficient backends) and sageattention 1.0.6 (Triton, int8 Q·K,
fp16 P·V) at B=2, H=32, D=128, bf16. TFLOP/s = 4·B·H·S²·D / t, halved for causal. Each attention output is
first checked against a float32 reference on 256 of its query rows (the first and last 128), at the timed S.
Every variant runs inside try/except: a failure becomes an error row, never a dead run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from thrifty import bench

BF16 = torch.bfloat16


def nvidia_smi() -> str:
    """Clocks, temperature and power, read-only: a throttled card explains low numbers."""
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,power.limit",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # no nvidia-smi (CPU machine)
        return f"unavailable: {type(e).__name__}"


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    out, ref = out.double().flatten(), ref.double().flatten()
    return {
        "max_abs_err": (out - ref).abs().max().item(),
        "rel_err": ((out - ref).norm() / ref.norm()).item(),
        "cos_sim": F.cosine_similarity(out, ref, dim=0).item(),
        "finite": bool(torch.isfinite(out).all()),
    }


def s_tag(S: int) -> str:
    return f"{S // 1024}k" if S % 1024 == 0 else str(S)


def err_row(base: dict, e: BaseException) -> dict:
    msg = f"{type(e).__name__}: {e}".replace("\n", " ")
    print(f"  ERROR {base.get('what')} {base.get('backend', '')}: {msg[:300]}", flush=True)
    return {**base, "error": msg[:500]}


# ------------------------------------------------------------------------------------------------ ceilings
def ceilings(dev: torch.device, n: int, copy_bytes: int, tag: str) -> list[dict]:
    rows = []
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def matmul_row(key, what, backend, sets, fn, check, unit="TFLOP/s"):
        base = {"group": "ceiling", "pass": tag, "key": key, "what": what, "backend": backend, "unit": unit}
        try:
            out = fn(*sets[0])
            errs = check(out, *sets[0])
            t = bench.time_fn(fn, sets, warmup=5, reps=30, device=dev)
            return {**base, "ms": t.median_ms, "rate": t.rate(2 * n**3), **errs, "reps": t.reps,
                    "spread_pct": t.spread_pct}
        except Exception as e:
            return err_row(base, e)

    def float_check(out, a, b):  # fp32 reference (tf32 off) on the first 256 rows
        return errors(out[:256].float(), a[:256].float() @ b.float())

    # bf16 through cuBLAS. Two input sets, rotated; random data (zeros run faster, METHOD.md).
    try:
        sets = [(torch.randn(n, n, device=dev, dtype=BF16), torch.randn(n, n, device=dev, dtype=BF16)) for _ in range(2)]
        rows.append(matmul_row("bf16_matmul_tflops", f"bf16 matmul {n}^3", "cuBLAS", sets, torch.matmul, float_check))
    except Exception as e:
        rows.append(err_row({"group": "ceiling", "pass": tag, "what": f"bf16 matmul {n}^3"}, e))
    sets = None

    # fp8 e4m3 through torch._scaled_mm: B must be column-major (cuBLASLt's only fp8 layout on Hopper).
    try:
        f8 = torch.float8_e4m3fn
        one = torch.ones((), device=dev)
        sets = [(torch.randn(n, n, device=dev).to(f8), torch.randn(n, n, device=dev).to(f8).t()) for _ in range(2)]
        mm8 = lambda a, b: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=BF16)
        rows.append(matmul_row("fp8_matmul_tflops", f"fp8 e4m3 _scaled_mm {n}^3", "cuBLASLt", sets, mm8, float_check))
    except Exception as e:
        rows.append(err_row({"group": "ceiling", "pass": tag, "what": f"fp8 e4m3 _scaled_mm {n}^3"}, e))
    sets = None

    # int8 through torch._int_mm (int32 out), B row-major and column-major: which layout is fast varies.
    def int_check(out, a, b):  # exact: float64 holds these int32 sums exactly
        ref = a[:64].double() @ b.double()
        return {"max_abs_err": (out[:64].double() - ref).abs().max().item(), "exact": bool(torch.equal(out[:64].double(), ref))}

    for layout in ("B col-major", "B row-major"):
        try:
            mk = lambda: torch.randint(-128, 128, (n, n), device=dev, dtype=torch.int8)
            sets = [(mk(), mk().t() if layout == "B col-major" else mk()) for _ in range(2)]
            rows.append(matmul_row("int8_matmul_tops", f"int8 _int_mm {n}^3 ({layout})", "cuBLASLt", sets, torch._int_mm, int_check, "TOP/s"))
        except Exception as e:
            rows.append(err_row({"group": "ceiling", "pass": tag, "what": f"int8 _int_mm {n}^3 ({layout})"}, e))
        sets = None

    # HBM: device-to-device copy, bytes read + bytes written.
    base = {"group": "ceiling", "pass": tag, "key": "hbm_copy_tbs", "what": f"HBM d2d copy {copy_bytes / 2**30:.3g} GiB", "backend": "copy_", "unit": "TB/s"}
    try:
        src = torch.randn(copy_bytes // 4, device=dev)
        dst = torch.empty_like(src)
        t = bench.time_fn(lambda: dst.copy_(src), warmup=3, reps=30, device=dev)
        rows.append({**base, "ms": t.median_ms, "rate": t.rate(2 * copy_bytes), "exact": bool(torch.equal(dst, src)),
                     "reps": t.reps, "spread_pct": t.spread_pct})
        del src, dst
    except Exception as e:
        rows.append(err_row(base, e))

    # Pinned host <-> device, one direction each.
    for what, unit in (("h2d pinned", "GB/s"), ("d2h pinned", "GB/s")):
        base = {"group": "ceiling", "pass": tag, "key": what.replace(" ", "_") + "_gbs", "what": f"{what} {copy_bytes / 2**30:.3g} GiB", "backend": "copy_", "unit": unit}
        try:
            host = torch.empty(copy_bytes // 4, pin_memory=True).uniform_()
            gpu = torch.empty(copy_bytes // 4, device=dev)
            if what.startswith("h2d"):
                fn = lambda: gpu.copy_(host, non_blocking=True)
            else:
                gpu.uniform_()
                fn = lambda: host.copy_(gpu, non_blocking=True)
            t = bench.time_fn(fn, warmup=2, reps=10, device=dev)
            sync()
            rows.append({**base, "ms": t.median_ms, "rate": t.rate(copy_bytes, 1e9), "exact": bool(torch.equal(gpu.cpu(), host)),
                         "reps": t.reps, "spread_pct": t.spread_pct})
            del host, gpu
        except Exception as e:
            rows.append(err_row(base, e))
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------- attention
def attention_ref(q, k, v, causal: bool, idx: torch.Tensor) -> torch.Tensor:
    """float32 attention for query rows ``idx`` only (the full S×S matrix would not fit at 32k)."""
    s = q[:, :, idx].float() @ k.float().transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s.masked_fill_(torch.arange(k.shape[2], device=q.device)[None, :] > idx[:, None], float("-inf"))
    return s.softmax(-1) @ v.float()


def attention_variants():
    """(name, context-manager factory or None, callable(q, k, v, causal))."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out = [(f"sdpa_{nm}", (lambda b=b: sdpa_kernel([b])), sdpa) for nm, b in
           (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION))]
    try:
        from sageattention import sageattn

        out.append(("sage", None, lambda q, k, v, causal: sageattn(q, k, v, tensor_layout="HND", is_causal=causal)))
    except Exception as e:  # not installed: one error row per config says so
        err = e

        def missing(*a, **kw):
            raise ImportError(f"sageattention unavailable: {err}")

        out.append(("sage", None, missing))
    return out


def attention(dev, B, H, D, seqs, budget_s) -> list[dict]:
    import contextlib

    rows = []
    variants = attention_variants()
    for S in seqs:
        try:
            # Two input sets rotated (both far larger than L2 except at the smallest S).
            sets = [tuple(torch.randn(B, H, S, D, device=dev, dtype=BF16) for _ in range(3)) for _ in range(2)]
        except Exception as e:
            rows.append(err_row({"group": "attention", "what": f"inputs S={S}", "S": S}, e))
            continue
        idx = torch.cat([torch.arange(min(128, S)), torch.arange(max(S - 128, 128), S)]).to(dev)
        for causal in (False, True):
            flops = 4 * B * H * S * S * D / (2 if causal else 1)
            try:
                ref = attention_ref(*sets[0], causal, idx)
            except Exception as e:
                rows.append(err_row({"group": "attention", "what": "float32 reference", "S": S, "causal": causal}, e))
                continue
            for name, ctx, fn in variants:
                base = {"group": "attention", "what": f"attn B={B} H={H} D={D}", "backend": name, "S": S,
                        "causal": causal, "config": f"{s_tag(S)} {'causal' if causal else 'full'}", "unit": "TFLOP/s"}
                # sageattention 1.0.6 subtracts the K mean from its K argument in place: give it clones.
                # (Attention output is unchanged by that shift, but other backends should see pristine K.)
                vsets = [(q, k.clone(), v) for q, k, v in sets] if name == "sage" else sets
                call = lambda q, k, v: fn(q, k, v, causal)
                try:
                    with ctx() if ctx else contextlib.nullcontext():
                        out = call(*vsets[0])  # also compiles Triton kernels, outside the timing
                        errs = errors(out[:, :, idx], ref)
                        del out
                        peak = bench.peak_memory(call, *vsets[0], device=dev)
                        t = bench.time_fn(call, vsets, warmup=2, reps=30, min_reps=5, budget_s=budget_s, device=dev)
                    rows.append({**base, "ms": t.median_ms, "rate": t.rate(flops), **errs,
                                 "peak_mib": None if peak is None else peak / 2**20, "reps": t.reps,
                                 "spread_pct": t.spread_pct})
                    print(f"  S={S:6d} causal={causal!s:5} {name:15s} {t.median_ms:9.3f} ms {rows[-1]['rate']:7.1f} TFLOP/s"
                          f"  cos={errs['cos_sim']:.6f}", flush=True)
                except Exception as e:
                    rows.append(err_row(base, e))
                del vsets
        del sets, ref
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------------- main
def summarize(rows: list[dict]) -> dict:
    s = {}
    # Ceilings: the start-of-run value; where a key has several rows (int8 layouts), the best one.
    for r in rows:
        if r["group"] == "ceiling" and r["pass"] == "start" and "rate" in r and r["rate"] > s.get(r["key"], 0):
            s[r["key"]] = round(r["rate"], 2)
    # How steady the card was: largest change of a ceiling between the start and the end of the run.
    start = {r["what"]: r["rate"] for r in rows if r["group"] == "ceiling" and r["pass"] == "start" and "rate" in r}
    diffs = [100 * abs(r["rate"] - start[r["what"]]) / start[r["what"]] for r in rows
             if r["group"] == "ceiling" and r["pass"] == "end" and "rate" in r and r["what"] in start]
    if diffs:
        s["ceilings_start_end_max_diff_pct"] = round(max(diffs), 1)
    for r in rows:
        if r["group"] == "attention" and "rate" in r:
            s[f"{r['backend']}_tflops_{s_tag(r['S'])}_{'causal' if r['causal'] else 'noncausal'}"] = round(r["rate"], 1)
    return s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU too (plumbing check)")
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--budget-s", type=float, default=1.5, help="timing budget per attention variant, seconds")
    p.add_argument("--results-dir", default=None, help="default benchmarks/results (smoke: a temp dir)")
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 references must be float32
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    if a.smoke:
        n, copy_bytes, B, H, D, seqs, name = 256, 2**20, 1, 2, 128, [256], "anchors-smoke"
    else:
        n, copy_bytes, B, H, D, seqs, name = 8192, 2**30, 2, 32, 128, a.seqs, "anchors"
    meta = bench.env_info()
    print(f"anchors on {meta['device']}: {meta['gpu']} torch {meta['torch']} triton {meta['triton']} commit {meta['commit']}")
    smi_start = nvidia_smi()
    print("nvidia-smi:", smi_start, flush=True)

    rows = ceilings(dev, n, copy_bytes, "start")
    print(f"[{time.perf_counter() - t_start:.0f}s] ceilings done", flush=True)
    rows += attention(dev, B, H, D, seqs, a.budget_s)
    print(f"[{time.perf_counter() - t_start:.0f}s] attention done", flush=True)
    smi_end = nvidia_smi()
    rows += ceilings(dev, n, copy_bytes, "end")

    summary = summarize(rows)
    try:
        import sageattention  # noqa: F401
        from importlib.metadata import version

        sage_version = version("sageattention")
    except Exception:
        sage_version = None
    extra = {
        "settings": {"B": B, "H": H, "D": D, "seqs": seqs, "dtype": "bfloat16", "matmul_n": n, "copy_bytes": copy_bytes,
                     "attention_budget_s": a.budget_s, "timer": "CUDA events, median; 2 rotating input sets"},
        "sageattention": sage_version,
        "notes": ["sage: bf16 in and out; sageattn 1.0.6 casts V to fp16 and subtracts the K mean inside the call "
                  "(both timed, like its quantization pre-pass)",
                  "attention correctness: 256 query rows (first and last 128) vs a float32 reference, at the timed S",
                  "flops: 4*B*H*S^2*D, halved for causal; matmul 2*n^3; HBM copy counts read+write bytes"],
        "nvidia_smi_start": smi_start, "nvidia_smi_end": smi_end,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    out_dir = a.results_dir or (tempfile.mkdtemp(prefix="thrifty-smoke-") if a.smoke else None)
    path = bench.write_result(name, rows, summary, extra=extra, results_dir=out_dir)
    att = [r for r in rows if r["group"] == "attention"]
    ceil = {k: v for k, v in summary.items() if not k.startswith(("sdpa", "sage"))}
    short = {"bf16_matmul_tflops": "bf16 mm {} TFLOP/s", "fp8_matmul_tflops": "fp8 mm {}",
             "int8_matmul_tops": "int8 mm {} TOP/s", "hbm_copy_tbs": "HBM {} TB/s"}
    title = (f"Attention B={B} H={H} D={D} bf16 on {meta['gpu'] or 'cpu'}, torch {meta['torch']}\n"
             "ceilings: " + ", ".join(f.format(round(ceil[k])) if ceil[k] >= 10 else f.format(ceil[k])
                                      for k, f in short.items() if k in ceil))
    if any("rate" in r for r in att):
        bench.plot_rows(att, x="config", y="rate", hue="backend", path=path.with_suffix(".png"), title=title,
                        ylabel="TFLOP/s (4·B·H·S²·D / t, causal halved)")
    print(f"wrote {path}")

    print("\n== ceilings ==")
    bench.print_table([r for r in rows if r["group"] == "ceiling"],
                      ["pass", "what", "ms", "rate", "unit", "rel_err", "exact", "spread_pct", "error"])
    print("\n== attention ==")
    bench.print_table(att, ["backend", "S", "causal", "ms", "rate", "peak_mib", "max_abs_err", "rel_err", "cos_sim",
                            "reps", "spread_pct", "error"])
    print("\n== summary ==")
    bench.print_table([{"key": k, "value": v} for k, v in summary.items()])
    print(f"total {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
