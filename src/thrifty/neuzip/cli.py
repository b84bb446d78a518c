"""``thrifty compress MODEL.safetensors OUT [--mantissa-bits k]`` and ``thrifty decompress IN OUT.safetensors``.

Entry points: :func:`compress_main` and :func:`decompress_main` (argv lists, return an exit code); :func:`main`
dispatches ``compress ...`` / ``decompress ...`` for ``python -m thrifty.neuzip.cli``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def compress_main(argv=None) -> int:
    import torch
    from safetensors.torch import load_file
    from tqdm import tqdm

    from . import format as F
    from . import reference as R
    from .tensor import compress

    p = argparse.ArgumentParser(prog="thrifty compress", description="NeuZip-compress a safetensors model")
    p.add_argument("model", type=Path, help="input .safetensors")
    p.add_argument("out", type=Path, help="output file (neuzip, safetensors container)")
    p.add_argument("--mantissa-bits", type=int, default=None, choices=(0, 1, 3, 7),
                   help="lossy: keep k mantissa bits of bf16 tensors (7 = lossless); default lossless")
    p.add_argument("--steps", type=int, default=R.STEPS, choices=R.LANE_STEPS,
                   help=f"symbols per lane (shorter: faster GPU decode, more metadata); default {R.STEPS}")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        tensors = load_file(str(args.model))
    except Exception as err:
        print(f"thrifty compress: cannot read {args.model}: {err}", file=sys.stderr)
        return 2
    entries, before, after = {}, 0, 0
    counts = np.zeros(256, np.int64)
    coded_bits = coded_symbols = 0
    for name, t in tqdm(tensors.items(), desc="compress", unit="tensor"):
        before += t.numel() * t.element_size()
        if t.dtype in R.DTYPES and t.numel() > 0:
            k = args.mantissa_bits if t.dtype == torch.bfloat16 else None
            try:
                ct = compress(t, k, steps=args.steps)
            except ValueError as err:  # e.g. NaNs with --mantissa-bits 0
                print(f"thrifty compress: tensor {name!r}: {err}", file=sys.stderr)
                return 2
            entries[name] = ct
            after += ct.nbytes
            coded_bits += ct.symbol_bits * ct.numel
            coded_symbols += ct.numel
            counts += np.bincount(R.split_symbols(R._uint_view(t), t.dtype)[0], minlength=256)
        else:  # integer buffers, float64, empty: stored as is
            entries[name] = t
            after += t.numel() * t.element_size()
    F.save(args.out, entries)
    seconds = time.perf_counter() - t0
    file_bytes = args.out.stat().st_size
    print(f"tensors: {len(entries)}  before: {_mb(before)}  after: {_mb(after)} (file {_mb(file_bytes)}, "
          f"ratio {after / max(before, 1):.4f})")
    if coded_symbols:
        print(f"bits per exponent: {coded_bits / coded_symbols:.3f} coded vs {R.entropy_bits(counts):.3f} "
              f"Shannon entropy (all tensors pooled)")
    print(f"time: {seconds:.1f} s")
    return 0


def decompress_main(argv=None) -> int:
    from safetensors.torch import save_file
    from tqdm import tqdm

    from . import format as F
    from .tensor import CompressedTensor

    p = argparse.ArgumentParser(prog="thrifty decompress", description="Decompress a NeuZip file to safetensors")
    p.add_argument("input", type=Path, help="file written by `thrifty compress`")
    p.add_argument("out", type=Path, help="output .safetensors")
    p.add_argument("--impl", default="auto", choices=("auto", "triton", "reference"))
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        entries = F.load(args.input)
    except (OSError, ValueError) as err:
        print(f"thrifty decompress: {err}", file=sys.stderr)
        return 2
    out, before, after = {}, 0, 0
    for name, e in tqdm(entries.items(), desc="decompress", unit="tensor"):
        if isinstance(e, CompressedTensor):
            before += e.nbytes
            out[name] = e.decompress(impl=args.impl).cpu().contiguous()
        else:
            before += e.numel() * e.element_size()
            out[name] = e
        after += out[name].numel() * out[name].element_size()
    save_file(out, str(args.out))
    print(f"tensors: {len(out)}  compressed: {_mb(before)}  decompressed: {_mb(after)}  "
          f"time: {time.perf_counter() - t0:.1f} s")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("compress", "decompress"):
        print("usage: python -m thrifty.neuzip.cli {compress,decompress} ...", file=sys.stderr)
        return 2
    return (compress_main if argv[0] == "compress" else decompress_main)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
