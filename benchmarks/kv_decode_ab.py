"""The KV family's one split-K decode kernel (``thrifty.kv.decode_kernel``) against the two kernels it replaced, in
one process on one GPU: ShadowKV's sparse decode over its static buffer (bf16 rows + a validity byte per row,
before: ``thrifty.kvcache.attention_kernel.decode_attention``) and the quantized 8/4-bit cache (before:
``thrifty.attention.decode_kernel.decode_forward_triton``). The old kernels come from another tree's ``src``
(``--old-src``), imported as ``thrifty_old.*`` without that tree's package ``__init__``; both sides get the same
inputs and the same launch geometry.

Per case: GPU time per call (``gpu_us``: the host's launch overhead hidden behind a spin kernel, as under the
CUDA graph a decode step runs in) and host-inclusive time per call (``call_us``), old and new; the largest
difference between the two outputs, and each one's largest error against float64 attention.

    git archive <old commit> src | tar -x -C .base        # main before the family kernel, e.g. 90291a8
    THRIFTY_COMMIT=<sha> THRIFTY_NO_INSTALL=1 bash benchmarks/run_on_gpu.sh benchmarks/kv_decode_ab.py --old-src .base/src
    python benchmarks/kv_decode_ab.py --smoke [--old-src DIR]   # tiny shapes on the CPU (Triton interpreter)
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import types
from pathlib import Path

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from thrifty import bench  # noqa: E402
from thrifty.kv import decode_kernel, quantize_kv_cache  # noqa: E402
from thrifty.kv.decode import decode_attention_reference  # noqa: E402

OLD_ROOT = "thrifty_old"
# ShadowKV's buffer at batch 1 and 8: Llama-3-8B's 8 KV heads x 4 query heads, selection budget 2048 +
# outliers/local 384 + 64 generated rows; the quantized cache at Llama-3-8B's heads, 4K and 32K tokens
SHADOWKV_CASES = [dict(B=1, H=8, G=4, D=128, N=2048 + 384 + 64), dict(B=8, H=8, G=4, D=128, N=2048 + 384 + 64)]
QUANTIZED_CASES = [dict(B=1, Hq=32, Hkv=8, D=128, L=L, bits=bits) for L in (4096, 32768) for bits in (8, 4)]
SMOKE_SHADOWKV = [dict(B=1, H=2, G=4, D=64, N=64 + 32 + 16), dict(B=2, H=2, G=3, D=64, N=64 + 32 + 16)]
SMOKE_QUANTIZED = [dict(B=1, Hq=8, Hkv=2, D=64, L=L, bits=bits) for L in (40, 96) for bits in (8, 4)]


def load_old(src: str | Path, module: str):
    """``thrifty.<module>`` of the tree at ``src`` as ``thrifty_old.<module>``. Its packages are stand-ins with the
    tree's paths (their ``__init__`` would import that whole tree); the module's relative imports resolve inside
    the old tree."""
    pkg = Path(src) / "thrifty"
    if not pkg.is_dir():
        raise ValueError(f"old_src: no thrifty package under {src}")
    parts = module.split(".")
    for depth in range(len(parts)):
        name = ".".join([OLD_ROOT, *parts[:depth]])
        if name not in sys.modules:
            stand_in = types.ModuleType(name)
            stand_in.__path__ = [str(pkg.joinpath(*parts[:depth]))]
            sys.modules[name] = stand_in
    return importlib.import_module(f"{OLD_ROOT}.{module}")


def shadowkv_inputs(B, H, G, D, N, device, seed=0):
    """q (B, H·G, 1, D), bf16 K/V rows (B, H, N, D) and their validity: every row valid but the unused tail of
    the generated region (16 of 64 used) and ~2% scattered padding picks, which hold NaN."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H * G, 1, D, generator=g)
    k = torch.randn(B, H, N, D, generator=g) * 2
    v = torch.randn(B, H, N, D, generator=g)
    valid = torch.rand(B, H, N, generator=g) > 0.02
    valid[..., N - 48:] = False
    k[~valid], v[~valid] = float("nan"), float("nan")
    return [x.to(device, torch.bfloat16) for x in (q, k, v)] + [valid.to(device)]


def shadowkv_exact(q, k, v, valid, scale):
    B, H, N, D = k.shape
    kd, vd = (torch.where(valid[..., None], x, 0).double() for x in (k, v))
    s = torch.einsum("bhgd,bhnd->bhgn", q.double().view(B, H, -1, D), kd) * scale
    p = s.masked_fill(~valid[:, :, None], float("-inf")).softmax(-1)
    return torch.einsum("bhgn,bhnd->bhgd", p, vd).reshape(q.shape)


def time_us(fn, smoke: bool) -> tuple[float, float]:
    """(GPU µs per call, host-inclusive µs per call); on the CPU both are the wall time."""
    reps, warmup = (2, 1) if smoke else (200, 20)
    call = bench.time_fn(fn, warmup=warmup, reps=reps)
    gpu = bench.time_fn(fn, warmup=warmup, reps=reps, gpu_only=torch.cuda.is_available()) if not smoke else call
    return 1e3 * gpu.median_ms, 1e3 * call.median_ms


def ab_row(kind: str, case: dict, new, old, exact, smoke: bool) -> dict:
    out_new = new()
    row = dict(kind=kind, **case, err_new=(out_new.double() - exact).abs().max().item())
    row["new_gpu_us"], row["new_call_us"] = time_us(new, smoke)
    if old is not None:
        out_old = old()
        row["err_old"] = (out_old.double() - exact).abs().max().item()
        row["max_diff"] = (out_new.float() - out_old.float()).abs().max().item()
        row["identical"] = bool(torch.equal(out_new, out_old))
        row["old_gpu_us"], row["old_call_us"] = time_us(old, smoke)
        row["gpu_ratio_new_over_old"] = row["new_gpu_us"] / row["old_gpu_us"]
    return row


def shadowkv_rows(cases, old_kernel, device, smoke):
    for case in cases:
        q, k, v, valid = shadowkv_inputs(**case, device=device)
        scale = case["D"] ** -0.5
        new = lambda: decode_kernel.masked_decode_attention(q, k, v, valid, scale)  # noqa: E731
        old = (lambda: old_kernel.decode_attention(q, k, v, valid, scale)) if old_kernel else None  # noqa: E731
        splits = decode_kernel.masked_split_plan(case["B"] * case["H"], case["N"], 64, q.device)[0]
        yield dict(ab_row("shadowkv", case, new, old, shadowkv_exact(q, k, v, valid, scale), smoke), splits=splits)


def quantized_rows(cases, old_kernel, device, smoke):
    for case in cases:
        g = torch.Generator().manual_seed(case["L"] + case["bits"])
        B, Hq, Hkv, D, L = (case[n] for n in ("B", "Hq", "Hkv", "D", "L"))
        q = torch.randn(B, Hq, 1, D, generator=g).to(device, torch.bfloat16)
        k, v = (torch.randn(B, Hkv, L, D, generator=g).to(device) for _ in range(2))
        cache = quantize_kv_cache(k, v, bits=case["bits"])
        scale = D ** -0.5
        new = lambda: decode_kernel.decode_forward_triton(q, cache, causal=True, sm_scale=scale)  # noqa: E731
        old = (lambda: old_kernel.decode_forward_triton(q, cache, causal=True, sm_scale=scale)) \
            if old_kernel else None  # noqa: E731  (the cache layout is unchanged: the old kernel reads it as is)
        exact = decode_attention_reference(q.float(), cache, causal=True, sm_scale=scale, dtype=torch.float64)
        yield ab_row("quantized", case, new, old, exact, smoke)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 timed calls (CPU: Triton interpreter)")
    ap.add_argument("--old-src", default=None, help="another tree's src/ holding the old kernels (else new only)")
    ap.add_argument("--results-dir", default=None, help="where the JSON goes (default benchmarks/results)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    old_skv = load_old(args.old_src, "kvcache.attention_kernel") if args.old_src else None
    old_q = load_old(args.old_src, "attention.decode_kernel") if args.old_src else None
    rows = [*shadowkv_rows(SMOKE_SHADOWKV if args.smoke else SHADOWKV_CASES, old_skv, device, args.smoke),
            *quantized_rows(SMOKE_QUANTIZED if args.smoke else QUANTIZED_CASES, old_q, device, args.smoke)]
    bench.print_table(rows, ["kind", "B", "H", "Hkv", "N", "L", "bits", "splits", "old_gpu_us", "new_gpu_us",
                             "gpu_ratio_new_over_old", "old_call_us", "new_call_us", "max_diff", "identical",
                             "err_old", "err_new"])
    summary = {f"{r['kind']}_B{r['B']}_{r.get('N') or r['L']}{'_%dbit' % r['bits'] if 'bits' in r else ''}"
               "_gpu_ratio_new_over_old": r["gpu_ratio_new_over_old"] for r in rows if "gpu_ratio_new_over_old" in r}
    summary["quantized_all_identical"] = all(r.get("identical", True) for r in rows if r["kind"] == "quantized")
    path = bench.write_result("kv_decode_ab", rows, summary, results_dir=args.results_dir,
                              extra=dict(old_src=args.old_src, smoke=args.smoke))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
