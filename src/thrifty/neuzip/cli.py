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

from .._io import atomic_path, check_output_path


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _user_error(cmd: str, err: Exception) -> int:
    print(f"thrifty {cmd}: {err}", file=sys.stderr)
    return 2


def _same_bits(a, b) -> bool:
    """Bit-for-bit equality (NaN payloads and -0.0 included), any dtype."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    import torch

    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def _restores(ct, t, mantissa_bits) -> bool:
    """Does ``ct`` decode (reference decoder) to ``t``, or to ``t`` rounded to ``mantissa_bits``?"""
    from . import reference as R

    want = t if mantissa_bits in (None, 7) else R.round_mantissa(t, mantissa_bits)
    return _same_bits(ct.decompress(impl="reference"), want)


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
        check_output_path("out", args.out, args.model)
    except ValueError as err:
        return _user_error("compress", err)
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
            if not _restores(ct, t, k):  # never report success for a tensor that would not come back
                print(f"thrifty compress: tensor {name!r} does not decode to its input; stored uncompressed",
                      file=sys.stderr)
                entries[name] = t
                after += t.numel() * t.element_size()
                continue
            entries[name] = ct
            after += ct.nbytes
            coded_bits += ct.symbol_bits * ct.numel
            coded_symbols += ct.numel
            counts += np.bincount(R.split_symbols(R._uint_view(t), t.dtype)[0], minlength=256)
        else:  # integer buffers, float64, float8, empty: stored as is (any dtype safetensors holds)
            entries[name] = t
            after += t.numel() * t.element_size()
    try:  # writes a temporary file, reads it back, compares, renames: no partial or unrestorable output
        F.save(args.out, entries)
    except (ValueError, TypeError) as err:  # e.g. a tensor name the format cannot hold
        return _user_error("compress", err)
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
    import torch
    from safetensors.torch import load_file, save_file

    from ..triton_utils import interpreting
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
        check_output_path("out", args.out, args.input)
        if args.impl == "triton" and not (torch.cuda.is_available() or interpreting()):
            raise ValueError("--impl triton: needs a CUDA GPU; use --impl reference (or auto)")
        # the Triton decoder runs where the streams are: on the GPU when there is one
        entries = F.load(args.input, device="cuda" if args.impl == "triton" and torch.cuda.is_available() else "cpu")
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
    with atomic_path(args.out) as tmp:  # read back and compared before it replaces anything
        save_file(out, str(tmp))
        back = load_file(str(tmp))
        if set(back) != set(out) or any(not _same_bits(back[n], t) for n, t in out.items()):
            raise RuntimeError(f"{args.out}: the written file does not read back as decoded; nothing was written")
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
