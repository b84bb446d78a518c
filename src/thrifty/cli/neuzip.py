"""The NeuZip file verbs: ``thrifty compress MODEL.safetensors OUT [--mantissa-bits k]`` and
``thrifty decompress IN OUT.safetensors``. Every output is written under a temporary name, read back and
compared before it replaces anything."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .._io import atomic_path, check_output_path

# thrifty.neuzip.reference's LANE_STEPS and STEPS, spelled out so that `thrifty --help` imports no torch (a test
# keeps them equal)
LANE_STEPS = (64, 128, 256)
DEFAULT_STEPS = 64


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


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
    from ..neuzip import reference as R

    want = t if mantissa_bits in (None, 7) else R.round_mantissa(t, mantissa_bits)
    return _same_bits(ct.decompress(impl="reference"), want)


def _read_safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own error type for a damaged or foreign file
        raise ValueError(f"cannot read {path}: {err}") from err


class _Tally:
    """Bytes before and after, and the exponent code lengths against their entropy, over all tensors."""

    def __init__(self):
        import numpy as np

        self.before = self.after = self.coded_bits = self.coded_symbols = 0
        self.counts = np.zeros(256, np.int64)

    def kept(self, t):
        self.before += t.numel() * t.element_size()
        self.after += t.numel() * t.element_size()

    def coded(self, t, ct):
        import numpy as np

        from ..neuzip import reference as R

        self.before += t.numel() * t.element_size()
        self.after += ct.nbytes
        self.coded_bits += ct.symbol_bits * ct.numel
        self.coded_symbols += ct.numel
        self.counts += np.bincount(R.split_symbols(R._uint_view(t), t.dtype)[0], minlength=256)


def _compress_one(name, t, args, tally):
    """The entry stored for one tensor: coded when NeuZip codes its dtype and it decodes back, else as is."""
    import torch

    from ..neuzip import compress
    from ..neuzip import reference as R

    if t.dtype not in R.DTYPES or t.numel() == 0:  # integer buffers, float64, float8, empty: any dtype safetensors holds
        tally.kept(t)
        return t
    k = args.mantissa_bits if t.dtype == torch.bfloat16 else None
    try:
        ct = compress(t, k, steps=args.steps)
    except ValueError as err:  # e.g. NaNs with --mantissa-bits 0
        raise ValueError(f"tensor {name!r}: {err}") from err
    if not _restores(ct, t, k):  # never report success for a tensor that would not come back
        print(f"thrifty compress: tensor {name!r} does not decode to its input; stored uncompressed", file=sys.stderr)
        tally.kept(t)
        return t
    tally.coded(t, ct)
    return ct


def cmd_compress(args) -> int:
    from tqdm import tqdm

    from ..neuzip import format as F
    from ..neuzip import reference as R

    t0 = time.perf_counter()
    check_output_path("out", args.out, args.model)
    tensors = _read_safetensors(args.model)
    tally = _Tally()
    entries = {name: _compress_one(name, t, args, tally)
               for name, t in tqdm(tensors.items(), desc="compress", unit="tensor")}
    F.save(args.out, entries)  # writes a temporary file, reads it back, compares, renames
    file_bytes = args.out.stat().st_size
    print(f"tensors: {len(entries)}  before: {_mb(tally.before)}  after: {_mb(tally.after)} (file {_mb(file_bytes)}, "
          f"ratio {tally.after / max(tally.before, 1):.4f})")
    if tally.coded_symbols:
        print(f"bits per exponent: {tally.coded_bits / tally.coded_symbols:.3f} coded vs "
              f"{R.entropy_bits(tally.counts):.3f} Shannon entropy (all tensors pooled)")
    print(f"time: {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_decompress(args) -> int:
    import torch
    from safetensors.torch import load_file, save_file
    from tqdm import tqdm

    from ..neuzip import CompressedTensor
    from ..neuzip import format as F
    from ..triton_utils import interpreting

    t0 = time.perf_counter()
    check_output_path("out", args.out, args.input)
    if args.impl == "triton" and not (torch.cuda.is_available() or interpreting()):
        raise ValueError("--impl triton: needs a CUDA GPU; use --impl reference (or auto)")
    # the Triton decoder runs where the streams are: on the GPU when there is one
    entries = F.load(args.input, device="cuda" if args.impl == "triton" and torch.cuda.is_available() else "cpu")
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


def add_compress(verbs) -> None:
    p = verbs.add_parser("compress", help="NeuZip-compress a .safetensors file",
                         description="NeuZip-compress a safetensors model")
    p.add_argument("model", type=Path, help="input .safetensors")
    p.add_argument("out", type=Path, help="output file (neuzip, safetensors container)")
    p.add_argument("--mantissa-bits", type=int, default=None, choices=(0, 1, 3, 7),
                   help="lossy: keep k mantissa bits of bf16 tensors (7 = lossless); default lossless")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, choices=LANE_STEPS,
                   help=f"symbols per lane (shorter: faster GPU decode, more metadata); default {DEFAULT_STEPS}")
    p.set_defaults(run=cmd_compress)


def add_decompress(verbs) -> None:
    p = verbs.add_parser("decompress", help="restore a NeuZip file to .safetensors",
                         description="Decompress a NeuZip file to safetensors")
    p.add_argument("input", type=Path, help="file written by `thrifty compress`")
    p.add_argument("out", type=Path, help="output .safetensors")
    # thrifty._checks.IMPLS, spelled out: importing it would import torch, and --help must not
    p.add_argument("--impl", default="auto", choices=("auto", "triton", "reference"))
    p.set_defaults(run=cmd_decompress)
