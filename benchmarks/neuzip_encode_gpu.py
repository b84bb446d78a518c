"""GPU time of the block encoder (LOMO's per-step re-encode), old vs new tree in the same run.

Block: a 1.1B Llama's (TinyLlama shape: q, o 2048x2048; k, v 256x2048; gate, up, down 5632x2048 = 44.0M weights),
bf16 N(0, 0.02), as views of one flat buffer (as LOMO encodes them). Per repetition: host ms of
``encode_block_triton`` (it returns after its last launch; its two reads wait for its own kernels), GPU ms
between CUDA events around it, synchronizing calls (torch's sync debug mode), and the bf16 input rate
(2 B x weights / GPU time). Checks the streams against the torch encoder (``encode.encode_lossless``) once.

Stages (this tree only: a tree whose ``encode_block_triton`` has no ``profile`` argument gives totals only): in
separate repetitions (the events cost a little), ``encode_kernel.EncodeProfile`` splits one encode into its
launch groups (GPU ms between CUDA events, host ms of queuing them), its two host reads (``read1``/``read2``:
host ms = the wait for everything queued before them) and the host code building (host ms only:
``code_lengths``, ``pair_code``, ``canonical``, ``code_streams``); then LOMO's pack update after it
(``pack_replace``: ``BlockPack.replace``, the streams' concatenation; ``pack_tables``: decode tables;
``pack_launch``: launch rows), as a compressed model's re-encode (``model.neuzip``) runs them. Median over
the repetitions per stage; summary keys ``encode_stage_<name>_host_ms`` / ``_gpu_ms``.

Re-encode with code reuse (this tree only: ``encode_kernel.reencode_block_triton``, LOMO's default): a code is
built once (a covering code), then per repetition the block drifts by an AdamW-like step (every weight +-1e-4, in
place) and is re-encoded with the last code; host ms, GPU ms, syncs, how many repetitions reused the code, and
each drifted block decoded back (NumPy reference, two tensors) against its weights (``reencode_lossless``). Its
stage split (then the pack update with kept tables) in ``reuse_stages``; keys ``reencode_reuse_ms`` (GPU ms,
median), ``reencode_reuse_host_ms``, ``reencode_reuse_syncs``, ``reencode_reused`` (fraction),
``reencode_stage_<name>_host_ms`` / ``_gpu_ms``.

    python benchmarks/neuzip_encode_gpu.py [--baseline-src OLD/src] [--reps 10] [--smoke]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import os
import subprocess
import sys
import time
import warnings

import torch

SHAPES = [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (5632, 2048), (5632, 2048), (2048, 5632)]
ROWS_MARK = "ROWS "


def measure(device, reps: int, smoke: bool) -> dict:
    from thrifty.neuzip import reference as R
    from thrifty.neuzip.encode_kernel import encode_block_triton

    shapes = [(s[0] // 64, s[1] // 64) for s in SHAPES] if smoke else SHAPES
    n = sum(a * b for a, b in shapes)
    g = torch.Generator(device="cpu").manual_seed(0)
    buf = (torch.randn(n, generator=g) * 0.02).bfloat16().to(device)
    views, at = [], 0
    for s in shapes:
        views.append(buf[at: at + s[0] * s[1]].view(s))
        at += s[0] * s[1]
    cuda = device.type == "cuda"
    encode_block_triton(views, R.STEPS)  # compile, caches
    host, gpu, syncs = [], [], []
    for _ in range(1 if smoke else reps):
        if cuda:
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        with warnings.catch_warnings(record=True) as log:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            t0 = time.perf_counter()
            streams, _ = encode_block_triton(views, R.STEPS)
            host.append((time.perf_counter() - t0) * 1e3)
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum(1 for w in log if "synchroniz" in str(w.message)))
        if cuda:
            e1.record()
            torch.cuda.synchronize()
            gpu.append(e0.elapsed_time(e1))
    from thrifty.neuzip.encode import encode_lossless

    exact = 1
    for v, s in zip(views[:2], streams[:2]):  # the torch encoder on the same device (slow: two tensors)
        ref = encode_lossless(v, R.STEPS)
        exact &= int(all(torch.equal(ref[k].cpu(), s[k].cpu()) for k in ref))
    ms = min(gpu) if gpu else min(host)
    row = {"weights": n, "host_ms": min(host), "gpu_ms": ms, "gb_per_s": 2 * n / ms / 1e6,
           "syncs": max(syncs), "exact": exact}
    if "profile" in inspect.signature(encode_block_triton).parameters:
        row["stages"] = stages(views, device, 1 if smoke else reps)
    try:
        from thrifty.neuzip.encode_kernel import reencode_block_triton  # noqa: F401
    except ImportError:  # an older tree: no code reuse
        return row
    row.update(reuse(buf, views, device, 2 if smoke else reps))
    return row


def _drift(buf, g) -> None:
    """An AdamW-like step in place: every weight moves by 1e-4 (Adam's early steps are ~lr x sign)."""
    step = torch.randint(0, 2, buf.shape, generator=g).float().mul_(2e-4).sub_(1e-4).to(buf.device)
    buf.copy_((buf.float() - step).to(buf.dtype))


def reuse(buf, views, device, reps: int) -> dict:
    """Re-encodes of a drifting block with code reuse (module docstring): times, syncs, reuse rate, lossless."""
    from thrifty.neuzip import reference as R
    from thrifty.neuzip.block_decode import BlockPack
    from thrifty.neuzip.encode_kernel import reencode_block_triton
    from thrifty.neuzip.tensor import CompressedTensor

    cuda = device.type == "cuda"
    g = torch.Generator(device="cpu").manual_seed(1)
    streams, lengths, code, _ = reencode_block_triton(views, None)
    pack = BlockPack([CompressedTensor(s, v.dtype, v.shape, steps=R.STEPS) for s, v in zip(streams, views)])
    pack.replace(streams, lengths)
    host, gpu, syncs, reused_n, exact = [], [], [], 0, 1
    for _ in range(reps):
        _drift(buf, g)
        if cuda:
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        with warnings.catch_warnings(record=True) as log:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            t0 = time.perf_counter()
            streams, lengths, code, reused = reencode_block_triton(views, code)
            host.append((time.perf_counter() - t0) * 1e3)
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum(1 for w in log if "synchroniz" in str(w.message)))
        if cuda:
            e1.record()
            torch.cuda.synchronize()
            gpu.append(e0.elapsed_time(e1))
        reused_n += reused
        for v, s in zip(views[1:3], streams[1:3]):  # the two small tensors (the NumPy decode is slow)
            got = CompressedTensor(s, v.dtype, v.shape, steps=R.STEPS).decompress(impl="reference").to(v.device)
            exact &= int(torch.equal(got.view(torch.int16), v.view(torch.int16)))
    state = {"code": code}

    def encode(prof):  # a reuse after a drift; LOMO's pack update after it keeps the tables when reused
        streams, lengths, state["code"], reused = reencode_block_triton(views, state["code"], profile=prof)
        return (streams, lengths), {"keep_tables": reused}

    rows = _stage_split(encode, pack, device, reps, prepare=lambda: _drift(buf, g))
    return {"reuse_host_ms": statistics.median(host), "reuse_gpu_ms": statistics.median(gpu or host),
            "reuse_syncs": max(syncs), "reused": reused_n / reps, "reuse_lossless": exact, "reuse_stages": rows}


def stages(views, device, reps: int) -> list:
    """[(stage, median host ms, median GPU ms or None)] of the encode and the pack update after it."""
    from thrifty.neuzip import reference as R
    from thrifty.neuzip.block_decode import BlockPack
    from thrifty.neuzip.encode_kernel import encode_block_triton
    from thrifty.neuzip.tensor import CompressedTensor

    streams, _ = encode_block_triton(views, R.STEPS)
    pack = BlockPack([CompressedTensor(s, v.dtype, v.shape, steps=R.STEPS) for s, v in zip(streams, views)])
    return _stage_split(lambda prof: (encode_block_triton(views, R.STEPS, profile=prof), {}), pack, device, reps)


def _stage_split(encode, pack, device, reps: int, prepare=None) -> list:
    """[(stage, median host ms, median GPU ms or None)] of ``encode(profile)`` -> ((streams, lengths), replace
    options) and the pack update after it (``BlockPack.replace``, decode tables, launch table), ``reps`` times;
    ``prepare()`` runs before each, untimed."""
    from thrifty.neuzip.encode_kernel import EncodeProfile

    per = {}
    for _ in range(reps):
        if prepare is not None:
            prepare()
        if device.type == "cuda":
            torch.cuda.synchronize()
        prof = EncodeProfile(device)
        with prof.stage("total"):
            out, options = encode(prof)
        with prof.stage("pack_replace"):
            pack.replace(*out, **options)
        with prof.stage("pack_tables"):
            pack.kernel_tables(pack.device)
        with prof.stage("pack_launch"):
            pack.launch_table(pack.device)
        for name, h, g in prof.rows():
            per.setdefault(name, []).append((h, g))
    rows = []
    for name, v in per.items():
        gs = [g for _, g in v if g is not None]
        rows.append((name, statistics.median(h for h, _ in v), statistics.median(gs) if gs else None))
    return rows


def print_stages(rows) -> None:
    print(f"{'stage':<16}{'host ms':>10}{'gpu ms':>10}")
    for name, h, g in rows:
        print(f"{name:<16}{h:>10.3f}{'' if g is None else f'{g:.3f}':>10}")


def baseline_row(src: str, reps: int, smoke: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    args = [sys.executable, __file__, "--rows-only", "--reps", str(reps)] + (["--smoke"] if smoke else [])
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=540)
    lines = [l for l in out.stdout.splitlines() if l.startswith(ROWS_MARK)]
    if out.returncode != 0 or not lines:
        return {"tree": "baseline", "error": out.stderr[-800:]}
    return dict(json.loads(lines[-1][len(ROWS_MARK):]), tree="baseline")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="CPU, 1/4096 of the block, Triton interpreter")
    p.add_argument("--baseline-src", default=None, help="src/ of another thrifty tree, timed in the same run")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cpu" if args.smoke else "cuda")
    row = measure(device, args.reps, args.smoke)
    if args.rows_only:
        print(ROWS_MARK + json.dumps(row), flush=True)
        return 0
    rows = [dict(row, tree="this")]
    if args.baseline_src:
        rows.append(baseline_row(args.baseline_src, args.reps, args.smoke))
    summary = {"encode_block_gpu_ms": row["gpu_ms"], "encode_block_host_ms": row["host_ms"],
               "encode_gb_per_s": row["gb_per_s"], "encode_syncs": row["syncs"], "encode_exact": row["exact"]}
    if len(rows) > 1 and "gpu_ms" in rows[1]:
        summary.update(encode_block_gpu_ms_baseline=rows[1]["gpu_ms"], encode_syncs_baseline=rows[1]["syncs"],
                       encode_speedup_vs_baseline=rows[1]["gpu_ms"] / row["gpu_ms"])
    for name, h, g in row.get("stages", []):
        summary[f"encode_stage_{name}_host_ms"] = h
        if g is not None:
            summary[f"encode_stage_{name}_gpu_ms"] = g
    if "reuse_gpu_ms" in row:
        summary.update(reencode_reuse_ms=row["reuse_gpu_ms"], reencode_reuse_host_ms=row["reuse_host_ms"],
                       reencode_reuse_syncs=row["reuse_syncs"], reencode_reused=row["reused"],
                       reencode_lossless=row["reuse_lossless"])
        for name, h, g in row["reuse_stages"]:
            summary[f"reencode_stage_{name}_host_ms"] = h
            if g is not None:
                summary[f"reencode_stage_{name}_gpu_ms"] = g
    for r in rows:
        print({k: v for k, v in r.items() if k not in ("stages", "reuse_stages")})
    if "stages" in row:
        print_stages(row["stages"])
    if "reuse_stages" in row:
        print("re-encode with code reuse:")
        print_stages(row["reuse_stages"])
    print("SUMMARY", summary)
    if not args.smoke:
        from thrifty import bench

        path = bench.write_result("neuzip_encode_gpu", rows, summary, device=bench.detect_device(device),
                                  extra={"weights": "N(0, 0.02) bf16, 1.1B Llama block", "args": vars(args)})
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
