"""Host time of re-encoding one 1B-shaped block (CPU; the GPU box's host path without its kernels).

Block: q, o 2048x2048; k, v 256x2048; gate, up, down 5632x2048; bf16 N(0, 0.02). The histograms (device work
on a GPU) are computed before timing; timed: what the host does with them per block (code lengths, pair
choice, canonical codes, stored code, decode tables, launch table).

    PYTHONPATH=src python benchmarks/neuzip_encode_host.py [--reps 3]
"""

import argparse
import time

import numpy as np
import torch

from thrifty.neuzip import reference as R
from thrifty.neuzip.block_decode import BlockPack
from thrifty.neuzip.tensor import CompressedTensor

SHAPES = [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (5632, 2048), (5632, 2048), (2048, 5632)]


def block(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for s in SHAPES]


def uint_view(x: torch.Tensor) -> np.ndarray:
    """The raw bits of a float tensor as an unsigned NumPy array (uint16 / uint32), flattened: what the codec reads."""
    bits = R.DTYPES[x.dtype][0]
    ints = x.detach().contiguous().reshape(-1).cpu().view(torch.int16 if bits == 16 else torch.int32)
    return ints.numpy().view(np.uint16 if bits == 16 else np.uint32)


def histograms(ws):
    out = []
    for w in ws:
        sym = R.split_symbols(uint_view(w), w.dtype)[0]
        out.append((np.bincount(sym, minlength=256), np.bincount(R.pair_symbols(sym), minlength=R.PAIR_SYMBOLS)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    ws = block()
    hists = histograms(ws)
    pack = BlockPack([CompressedTensor(_streams(w, R.STEPS), w.dtype, w.shape, None, steps=R.STEPS) for w in ws])
    streams = [t.streams for t in (pack.tensor(i) for i in range(len(ws)))]
    best = {}
    for _ in range(args.reps):
        t = {}
        t0 = time.perf_counter()
        codes = [host_code(c, pc) for c, pc in hists]
        t["code"] = time.perf_counter() - t0
        pack.replace(streams, codes)  # (its concatenations are device copies on a GPU: not timed)
        t0 = time.perf_counter()
        pack.kernel_tables("cpu")
        t["kernel_tables"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        pack.launch_table("cpu")
        t["launch_table"] = time.perf_counter() - t0
        for k, v in t.items():
            best[k] = min(best.get(k, 1e9), v)
    total = sum(best.values())
    print(" ".join(f"{k} {v * 1e3:.2f} ms" for k, v in best.items()), f"| total {total * 1e3:.2f} ms per block",
          f"| pairs {sum(len(c) == R.PAIR_SYMBOLS for c in codes)}/7")


def _streams(w, steps):
    from thrifty.neuzip.encode import encode_lossless
    return encode_lossless(w, steps)


def host_code(counts, pair_counts):
    """The per-tensor host work of the encoders on a histogram: lengths, pair choice, canonical codes, stored code."""
    from thrifty.neuzip.tensor import code_streams
    lengths = R.code_lengths(counts)
    pl = R.choose_pair_code(pair_counts, lengths, counts)
    lengths = lengths if pl is None else pl
    R.canonical_codes(lengths)
    code_streams(lengths)
    return lengths


if __name__ == "__main__":
    main()
