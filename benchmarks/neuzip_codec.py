"""NeuZip codec on the GPU: ratio (lossless, k = 0/1/3/7; lane lengths 64/128/256), bits per exponent vs
entropy, decode GB/s vs DFloat11 0.5.0 and vs the HBM copy bandwidth, on two real sets carried in
.neuzip_tensors/ (SmolLM2-135M layers 0/14/29, Q4_1-dequantized; 42 matrices of a 30m model trained in this
project, genuine bf16) and a Llama-shaped random init made here. Every decode is checked bit for bit
against the original first. Decode variants: the v3 kernel per lane length and launch config (asm funnel
shifts on/off, int32/int16 table), and v2 (the previous kernel) on 256-symbol lanes as the baseline; they decode
single-symbol codes (``compress(..., pairs=False)``; ratios are the default format's, pair symbols where
``compress`` picks them).

    python benchmarks/neuzip_codec.py [--tensors FILE ...] [--quick] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import sys
import time

import numpy as np
import torch

from thrifty import bench
from thrifty.neuzip import compress
from thrifty.neuzip import reference as R
from thrifty.neuzip.decode_kernel import decode_into, kernel_table, small_table

DEV = "cuda"
# v3 launch variants: (groups_per_prog, num_warps, int16 table, 8-bit first-level table, inline-asm funnel shifts)
# (1 group on 4 warps replicates lanes across threads: slow, left out)
V3_LAUNCHES = [(1, 2, True, False, True), (2, 4, True, False, True), (4, 4, True, False, True),
               (4, 4, False, False, True), (2, 4, True, True, True), (4, 4, True, True, True),
               (4, 4, True, False, False)]  # the last: the plain-tl path (what the interpreter runs)
# v2 baseline (NOTES.md): 256-symbol lanes, 2 groups per program, 4 warps, full / first-level table
V2_LAUNCHES = [(2, 4, False), (2, 4, True)]


REAL_FILES = (".neuzip_tensors/smollm2_layers.safetensors", ".neuzip_tensors/trained30m_layers.safetensors")


def real_set_name(path) -> str:
    """smollm2_layers.safetensors -> "smollm2", trained30m_layers... -> "trained30m"."""
    return os.path.basename(path).split(".")[0].removesuffix("_layers")


def load_real(path):
    from safetensors.torch import load_file

    if not os.path.exists(path):
        return {}
    return {k: v.bfloat16().contiguous() for k, v in sorted(load_file(path).items())}


def uint_view(x: torch.Tensor) -> np.ndarray:
    """The raw bits of a float tensor as an unsigned NumPy array (uint16 / uint32), flattened: what the codec reads."""
    bits = R.DTYPES[x.dtype][0]
    ints = x.detach().contiguous().reshape(-1).cpu().view(torch.int16 if bits == 16 else torch.int32)
    return ints.numpy().view(np.uint16 if bits == 16 else np.uint32)


def decode_tables(c, device) -> dict:
    """``c``'s decode tables on ``device``, built as ``CompressedTensor.decompress`` builds them: "ref" the
    int32[4096] of ``reference.decode_table``, "small" its int16[256] first level (v1/v2), "v3" / "v3_16" the v3
    kernel's (int32 / int16) and "v3_small" / "v3_small16" their 256-entry first levels."""
    ref = torch.from_numpy(R.decode_table(c.code_lengths())).to(device)
    tables = {"ref": ref, "small": small_table(ref)}
    for kind in ("v3", "v3_16", "v3_small", "v3_small16"):
        tables[kind] = kernel_table(ref, c.dtype, table16=kind.endswith("16"), small="small" in kind)
    return tables


def single_symbol(x, steps, mantissa_bits=None):
    """``x`` coded for the v2/v3 decode kernels this benchmark times: single symbols (``pairs=False``). Since format
    4 ``compress`` picks pair symbols where they pay (the random 11008 x 4096 init's rows, for one), and a
    pair-coded tensor decodes through the block kernel only (neuzip_decode.py times that)."""
    return compress(x, mantissa_bits, steps=steps, pairs=False)


def llama_init(seed=0):
    """Llama-7B-shaped matrices with the usual N(0, 0.02) init, as bf16."""
    g = torch.Generator().manual_seed(seed)
    return {"q_proj_4096x4096": (torch.randn(4096, 4096, generator=g) * 0.02).bfloat16(),
            "gate_proj_11008x4096": (torch.randn(11008, 4096, generator=g) * 0.02).bfloat16()}


# --------------------------------------------------------------------------------------------- DFloat11
def dfloat11_module():
    """dfloat11's encoder (dfloat11_utils) and its PTX decode kernel, without importing dfloat11/__init__
    (which pulls in accelerate/transformers and pkg_resources)."""
    spec = importlib.util.find_spec("dfloat11")
    if spec is None:
        return None
    pkg = spec.submodule_search_locations[0]
    u_spec = importlib.util.spec_from_file_location("df11_utils", os.path.join(pkg, "dfloat11_utils.py"))
    utils = importlib.util.module_from_spec(u_spec)
    u_spec.loader.exec_module(utils)
    if not torch.cuda.is_available():
        return utils, None
    import cupy as cp

    kernel = cp.RawModule(path=os.path.join(pkg, "decode.ptx")).get_function("decode")
    return utils, kernel


def dfloat11_encode(utils, weights, threads=512, bytes_per_thread=8):
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its code table
        _, counter = utils.get_codec(torch.cat([w.reshape(-1) for w in weights]))
        codec, _, table = utils.get_32bit_codec(counter)
        luts = utils.get_luts(table)
        enc, other, pos, gaps, _ = utils.encode_weights([w.reshape(-1) for w in weights], codec, bytes_per_thread,
                                                       threads)
    pos_np = pos.numpy().astype(np.int64)
    shared = threads * 4 + 4 + int((pos_np[1:] - pos_np[:-1]).max()) * 2
    parts = {"luts": luts, "encoded": enc, "other": other, "pos": pos.view(torch.int32), "gaps": gaps}
    nbytes = sum(t.numel() * t.element_size() for t in parts.values())
    return parts, shared, nbytes


def dfloat11_decoder(kernel, parts, shared, n, threads=512, bytes_per_thread=8):
    import cupy as cp

    d = {k: v.cuda() for k, v in parts.items()}
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    n_bytes = d["encoded"].numel()
    grid = ((n_bytes + threads * bytes_per_thread - 1) // (threads * bytes_per_thread),)
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def run():
        kernel(grid=grid, block=(threads,), shared_mem=shared, stream=stream,
               args=[d["luts"].data_ptr(), d["encoded"].data_ptr(), d["other"].data_ptr(), d["pos"].data_ptr(),
                     d["gaps"].data_ptr(), out.data_ptr(), d["luts"].shape[0], n_bytes, n])
    return run, out


# ----------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tensors", nargs="+", default=list(REAL_FILES),
                   help="real weight sets (safetensors); the first is the headline set")
    p.add_argument("--quick", action="store_true", help="fewer launch configs and reps")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1")
    args = p.parse_args(argv)
    global DEV
    DEV = "cpu" if args.smoke else "cuda"
    assert args.smoke or torch.cuda.is_available(), "needs CUDA (or --smoke with TRITON_INTERPRET=1)"
    v3_launches = V3_LAUNCHES[2::3] if args.quick else V3_LAUNCHES
    rows, t_start = [], time.time()

    # HBM copy bandwidth, same run: 1 GiB device-to-device, bytes read + written
    src = torch.empty(2**16 if args.smoke else 2**29, dtype=torch.bfloat16, device=DEV).normal_()
    dst = torch.empty_like(src)
    t = bench.time_fn(lambda: dst.copy_(src), reps=20, device=DEV)
    copy_gbps = 2 * src.numel() * 2 / (t.median_ms * 1e-3) / 1e9
    rows.append({"set": "copy_1GiB", "codec": "torch.copy_", "decode_gbps": copy_gbps / 2, "copy_rw_gbps": copy_gbps})
    print(f"HBM copy: {copy_gbps:.0f} GB/s read+write", flush=True)
    del src, dst

    reals = {}  # set name -> {matrix name: bf16 tensor}
    for path in args.tensors:
        real = load_real(path)
        if not real:
            print(f"missing or empty: {path}", flush=True)
            continue
        if args.smoke:
            real = {k: v.reshape(-1)[:3000] for k, v in list(real.items())[:2]}
        reals[real_set_name(path)] = real
    init = {k: v[:2] for k, v in llama_init().items()} if args.smoke else llama_init()
    sets = {f"{name}_layers_concat": [torch.cat([w.reshape(-1) for w in real.values()])] for name, real in reals.items()}
    sets.update({k: [v] for k, v in init.items()})  # made here, not carried
    df11 = dfloat11_module() if importlib.util.find_spec("dfloat11") else None
    print(f"sets: {list(sets)}; real tensors: { {k: len(v) for k, v in reals.items()} }; dfloat11: {df11 is not None}",
          flush=True)

    # ---- ratios (lossless and lossy) on the real matrices, per matrix as stored, and on the init
    ratio_rows = []
    ratio_sets = [(f"{name}_layers", list(real.values())) for name, real in reals.items()]
    for set_name_, tensors in ratio_sets + [("llama_init", [init["q_proj_4096x4096"]])]:
        if not tensors:
            continue
        orig = sum(t.numel() * 2 for t in tensors)
        for k in (None, 0, 1, 3, 7):
            for steps in (R.LANE_STEPS if k is None else (R.STEPS,)):
                cs = [compress(t, k, steps=steps) for t in tensors]
                row = {"set": set_name_, "codec": "neuzip", "mantissa_bits": "lossless" if k is None else k,
                       "steps": steps, "ratio": sum(c.nbytes for c in cs) / orig}
                if k is None:
                    counts = sum(np.bincount(R.split_symbols(uint_view(t), t.dtype)[0], minlength=256)
                                 for t in tensors)
                    row["entropy_bits"] = R.entropy_bits(counts)  # pooled; per-matrix codes can do slightly better
                    row["coded_bits"] = sum(c.symbol_bits * c.numel for c in cs) / sum(c.numel for c in cs)
                    row["entropy_bound_ratio"] = (8 + sum(c.symbol_entropy * c.numel for c in cs)
                                                  / sum(c.numel for c in cs)) / 16
                ratio_rows.append(row)
                print(row, flush=True)

    # ---- decode throughput, bit-exact check first
    summary = {"copy_gbps": copy_gbps, "default_steps": R.STEPS}
    reps = 2 if args.smoke else 30 if args.quick else 100
    for set_name, tensors in sets.items():
        x = tensors[0]
        n = x.numel()
        out = torch.empty(n, dtype=torch.bfloat16, device=DEV)
        x_gpu = x.reshape(-1).to(DEV)
        per_steps = {}
        variants = [(steps, "v3", launch) for steps in R.LANE_STEPS for launch in v3_launches]
        variants += [(256, "v2", launch) for launch in V2_LAUNCHES]  # v2 timed at the longest lanes
        cs = {}
        for steps, kernel, launch in variants:
            if steps not in cs:
                c = single_symbol(x, steps).to(DEV)
                tables = decode_tables(c, DEV)
                cs[steps] = (c, c.streams, tables["ref"], tables["small"],
                             {k: tables[k] for k in ("v3", "v3_16", "v3_small", "v3_small16")})
            c, s, table, small_tab, t3 = cs[steps]
            if kernel == "v3":
                g, w, use16, small, asm = launch
                kw = dict(kernel="v3", v3_table=t3["v3_16" if use16 else "v3"], asm=asm and not args.smoke,
                          v3_small=t3["v3_small16" if use16 else "v3_small"] if small else None)
                name = (f"v3 s{steps} g{g}w{w}{' t16' if use16 else ' t32'}{' small' if small else ''}"
                        f"{'' if asm else ' noasm'}")
            else:
                g, w, small = launch
                kw = dict(kernel="v2", small_table=small_tab if small else None)
                name = f"v2 s{steps} g{g}w{w}{' small' if small else ''}"
            out.fill_(0)
            run = lambda: decode_into(s["words"], s["lane_units"], s["group_offsets"], s["raw"], table, out, 7,
                                      steps=steps, groups_per_prog=g, num_warps=w, **kw)
            run()
            exact = torch.equal(out.view(torch.int16), x_gpu.view(torch.int16))
            t = bench.time_fn(run, reps=reps, flush_l2=True, device=DEV)
            # GPU time alone (a spin kernel hides the host's launch path): small sets are host-bound otherwise
            tg = bench.time_fn(run, reps=reps, flush_l2=True, gpu_only=True, device=DEV)
            gbps = 2 * n / (t.median_ms * 1e-3) / 1e9
            row = {"set": set_name, "codec": f"neuzip {name}", "kernel": kernel, "steps": steps, "launch": name,
                   "n": n, "ratio": c.ratio, "exact": exact, "us": t.median_ms * 1e3, "decode_gbps": gbps,
                   "spread_pct": t.spread_pct, "us_gpu_only": tg.median_ms * 1e3,
                   "decode_gbps_gpu_only": 2 * n / (tg.median_ms * 1e-3) / 1e9, "spread_pct_gpu_only": tg.spread_pct}
            rows.append(row)
            print(row, flush=True)
            if not exact:  # recorded (all_exact turns False), never a candidate for the best launch
                print(f"NOT BIT-EXACT: {set_name} {name}", flush=True)
                continue
            key = (kernel, steps)
            if key not in per_steps or gbps > per_steps[key]["decode_gbps"]:
                per_steps[key] = row
        for (kernel, steps), r in sorted(per_steps.items()):
            label = f"neuzip {kernel} steps={steps} (best launch)"
            rows.append(dict(r, codec=label))
        best = dict(per_steps[("v3", R.STEPS)], codec="neuzip (best launch)")  # the default layout
        rows.append(best)
        if df11 is not None and df11[1] is not None and n <= 20_000_000:  # its Python encoder runs ~0.8M symbols/s: skip the 45M matrix
            t0 = time.time()
            parts, shared, nbytes = dfloat11_encode(df11[0], [x])
            enc_s = time.time() - t0
            run, dout = dfloat11_decoder(df11[1], parts, shared, n)
            run()
            torch.cuda.synchronize()
            exact = torch.equal(dout.view(torch.int16), x_gpu.view(torch.int16))
            t = bench.time_fn(run, reps=30 if args.quick else 100, flush_l2=True)
            tg = bench.time_fn(run, reps=30 if args.quick else 100, flush_l2=True, gpu_only=True)
            row = {"set": set_name, "codec": "dfloat11 0.5.0", "n": n, "ratio": nbytes / (2 * n), "exact": exact,
                   "us": t.median_ms * 1e3, "decode_gbps": 2 * n / (t.median_ms * 1e-3) / 1e9,
                   "spread_pct": t.spread_pct, "encode_s": enc_s, "us_gpu_only": tg.median_ms * 1e3,
                   "decode_gbps_gpu_only": 2 * n / (tg.median_ms * 1e-3) / 1e9, "spread_pct_gpu_only": tg.spread_pct}
            rows.append(row)
            print(row, flush=True)
            best["vs_dfloat11"] = best["decode_gbps"] / row["decode_gbps"]
            gpu_best = max((r for r in rows if r["set"] == set_name and r.get("kernel") == "v3"
                            and r.get("steps") == R.STEPS and r.get("exact") and "launch" in r
                            and not r["codec"].endswith("(best launch)")), key=lambda r: r["decode_gbps_gpu_only"])
            best["decode_gbps_gpu_only"] = gpu_best["decode_gbps_gpu_only"]
            best["launch_gpu_only"] = gpu_best["launch"]
            best["vs_dfloat11_gpu_only"] = gpu_best["decode_gbps_gpu_only"] / row["decode_gbps_gpu_only"]
            for r in rows:
                if r["set"] == set_name and r["codec"].endswith("(best launch)") and r is not best:
                    r["vs_dfloat11"] = r["decode_gbps"] / row["decode_gbps"]
        best["of_copy_rw"] = best["decode_gbps"] / copy_gbps
        print("BEST", best, flush=True)
        del out, x_gpu, cs
        if DEV == "cuda":
            torch.cuda.empty_cache()

    # lossy decode speed (k = 3) on the 4096^2 init, default layout and launch
    x = init["q_proj_4096x4096"]
    c3 = single_symbol(x, R.STEPS, 3).to(DEV)
    ref3 = c3.decompress(impl="reference").to(DEV)
    out = torch.empty_like(ref3)
    tables3 = decode_tables(c3, DEV)
    s3, tab3, v3tab3 = c3.streams, tables3["ref"], tables3["v3_16"]
    run = lambda: decode_into(s3["words"], s3["lane_units"], s3["group_offsets"], s3["raw"], tab3, out, 3,
                              steps=c3.steps, v3_table=v3tab3, asm=not args.smoke)  # default launch
    run()
    exact = torch.equal(out.view(torch.int16), ref3.view(torch.int16))
    t = bench.time_fn(run, reps=2 if args.smoke else 50, flush_l2=True, device=DEV)
    rows.append({"set": "q_proj_4096x4096", "codec": "neuzip k=3", "n": x.numel(), "ratio": c3.ratio,
                 "steps": c3.steps, "exact": exact, "us": t.median_ms * 1e3,
                 "decode_gbps": 2 * x.numel() / (t.median_ms * 1e-3) / 1e9})
    print(rows[-1], flush=True)

    bests = {r["set"]: r for r in rows if r.get("codec") == "neuzip (best launch)"}
    dfs = {r["set"]: r for r in rows if r.get("codec") == "dfloat11 0.5.0"}
    real_concat = [f"{name}_layers_concat" for name in reals]
    head = real_concat[0] if real_concat else "q_proj_4096x4096"  # smollm2 by default, as before
    lossless_real = {r["set"]: r["ratio"] for r in ratio_rows if r["set"] != "llama_init"
                     and r["mantissa_bits"] == "lossless" and r["steps"] == R.STEPS}
    summary.update({
        "lossless_ratio_real": max(lossless_real.values()) if lossless_real else None,  # the worse real set
        "lossless_ratio_llama_init": [r for r in ratio_rows if r["set"] == "llama_init"
                                      and r["mantissa_bits"] == "lossless" and r["steps"] == R.STEPS][0]["ratio"],
        "decode_launch": bests[head]["launch"],
        "decode_gbps": bests[head]["decode_gbps"],
        "decode_set": head,
        "decode_ratio_vs_dfloat11": (bests[head]["decode_gbps"] / dfs[head]["decode_gbps"]) if head in dfs else None,
        "decode_of_copy_rw": bests[head]["decode_gbps"] / copy_gbps,
        "dfloat11_gbps": dfs[head]["decode_gbps"] if head in dfs else None,
        # the same with GPU time alone (bench.time_fn gpu_only): the kernels without the host's launch path
        "decode_gbps_gpu_only": bests[head].get("decode_gbps_gpu_only"),
        "decode_ratio_vs_dfloat11_gpu_only": bests[head].get("vs_dfloat11_gpu_only"),
        "decode_of_copy_rw_gpu_only": (bests[head]["decode_gbps_gpu_only"] / copy_gbps
                                       if bests[head].get("decode_gbps_gpu_only") else None),
        "all_exact": all(r.get("exact", True) for r in rows),
        "seconds": time.time() - t_start,
    })
    for r in ratio_rows:
        if r["mantissa_bits"] == "lossless":
            summary[f"lossless_ratio_{r['set']}_steps{r['steps']}"] = r["ratio"]
    for r in rows:
        if r["codec"].startswith("neuzip v") and r["codec"].endswith("(best launch)"):
            summary[f"decode_gbps_{r['set']}_{r['kernel']}_steps{r['steps']}"] = r["decode_gbps"]
    for name, r in bests.items():
        summary[f"decode_gbps_{name}"] = r["decode_gbps"]
        if name in real_concat:  # short per-set keys: decode_gbps_trained30m, decode_ratio_vs_dfloat11_trained30m
            short = name.removesuffix("_layers_concat")
            summary[f"decode_gbps_{short}"] = r["decode_gbps"]
            summary[f"decode_of_copy_rw_{short}"] = r["decode_gbps"] / copy_gbps
            summary[f"decode_ratio_vs_dfloat11_{short}"] = (r["decode_gbps"] / dfs[name]["decode_gbps"]
                                                            if name in dfs else None)
            summary[f"lossless_ratio_{short}"] = lossless_real.get(f"{short}_layers")
            summary[f"decode_gbps_gpu_only_{short}"] = r.get("decode_gbps_gpu_only")
            summary[f"decode_ratio_vs_dfloat11_gpu_only_{short}"] = r.get("vs_dfloat11_gpu_only")
        if name in dfs:
            summary[f"dfloat11_gbps_{name}"] = dfs[name]["decode_gbps"]
            summary[f"dfloat11_ratio_{name}"] = dfs[name]["ratio"]
    print("SUMMARY", summary, flush=True)
    plot_rows = [r for r in rows if (r["codec"].startswith("neuzip v") and r["codec"].endswith("(best launch)"))
                 or r["codec"] in ("dfloat11 0.5.0", "torch.copy_", "neuzip k=3")]
    path = bench.write_result("neuzip_codec", rows + ratio_rows, summary, device="smoke" if args.smoke else None,
                              extra={"dfloat11": "0.5.0", "copy": "1 GiB bf16 copy_, read+write bytes",
                                     "real_weights": {
                                         "smollm2": "SmolLM2-135M layers 0/14/29 (Q4_1-dequantized GGUF -> fp32 -> "
                                                    "bf16: exponent statistics are distorted)",
                                         "trained30m": "42 matrices of a 30m model trained in this project (bf16)"},
                                     "lossless_ratio_real": "the worse (larger) lossless ratio of the real sets, "
                                                            "per matrix, default lane length",
                                     "decode_gbps": "headline: the first real set (SmolLM2 concat), default "
                                                    "lane length, best launch; per-set keys decode_gbps_<set>; "
                                                    "decode speed is bytes of bf16 output per second, L2 "
                                                    "flushed before each call"})
    try:
        bench.plot_rows(plot_rows, x="set", y="decode_gbps", hue="codec", path=path.with_suffix(".png"),
                        title="decode, GB/s of bf16 output (copy_: half the read+write copy rate)")
    except Exception as err:  # a plot failure must not lose the numbers
        print("plot failed:", err)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
