"""The lossless encoder in torch ops, on the tensor's own device: same bits as :func:`reference.encode`.

LOMO re-encodes every weight after every update, so the encoder must not leave the GPU: a host round trip of
the weights (NumPy encoder) costs ~2 x 2 B/weight of PCIe traffic plus ~70 ns/weight of NumPy work (the CPU
reference encodes ~15M weights/s). Here every step is a torch op over all elements: split, a 256-bin histogram
(the only value the host reads, with the total bit count: two small syncs per tensor), canonical Huffman code
lengths on the host (256 symbols, ~1 ms of Python), then per-element code lengths by table gather, lane sums, a
prefix sum for each code's bit position and a scatter-add of the code pieces into the 32-bit words (codes never
overlap, so adding is OR-ing). Not a fused Triton kernel: it makes ~25 passes over int64 temporaries of N
elements (~8 B each), so transient memory is ~8·N·3 B while a tensor is encoded and the time is memory-bound
at roughly 25 × 8 B/weight of traffic (NOTES.md has the arithmetic).
"""

from __future__ import annotations

import numpy as np
import torch

from . import reference as R

_INT_VIEW = {16: torch.int16, 32: torch.int32}


def split_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(symbol int64, raw field int64 = sign above the kept mantissa bits) of every element, lossless."""
    bits, shift, kept = R.DTYPES[x.dtype]
    u = x.detach().contiguous().reshape(-1).view(_INT_VIEW[bits]).to(torch.int64) & ((1 << bits) - 1)
    symbol = (u >> shift) & 0xFF
    raw = ((u >> (bits - 1)) << kept) | (u & ((1 << kept) - 1))
    return symbol, raw


def _pack_raw(raw: torch.Tensor, field_bits: int) -> torch.Tensor:
    if field_bits == 8:
        return raw.to(torch.uint8)
    # 24-bit fields (fp32): three little-endian bytes per element
    return torch.stack([raw & 0xFF, (raw >> 8) & 0xFF, (raw >> 16) & 0xFF], dim=1).reshape(-1).to(torch.uint8)


def encode_lossless(x: torch.Tensor, steps: int = R.STEPS) -> dict:
    """Streams of ``x`` (bf16 / fp16 / fp32) in the format 3 layout, computed on ``x.device``.

    Returns {"words": int32, "lane_units": uint8, "group_offsets": int64, "raw": uint8, "lengths": uint8[256]},
    bit-identical to ``reference.encode(x, None, steps)`` (tested)."""
    steps = R.check_steps(steps)
    dev = x.device
    n = x.numel()
    symbol, raw = split_torch(x)
    counts = torch.bincount(symbol, minlength=256)
    lengths_np = R.code_lengths(counts.cpu().numpy())
    codes_np = R.canonical_codes(lengths_np).astype(np.int64)
    lengths = torch.from_numpy(lengths_np.astype(np.int64)).to(dev)
    codes = torch.from_numpy(codes_np).to(dev)
    unit = R.lane_unit(steps)
    groups = R.n_groups(n, steps)
    lanes = groups * R.GROUP
    # slot (group, lane, step) -> element index (group * 64 * steps + step * 64 + lane)
    idx = torch.arange(lanes * steps, device=dev, dtype=torch.int64).view(groups, steps, R.GROUP)
    idx = idx.transpose(1, 2).reshape(-1)
    valid = idx < n
    sym = symbol[idx.clamp(max=max(n - 1, 0))] if n else torch.zeros_like(idx)
    nbits = torch.where(valid, lengths[sym], 0)
    code = torch.where(valid, codes[sym], 0)
    del sym, idx
    lane_bits = nbits.view(lanes, steps).sum(dim=1)
    padded = (lane_bits + unit - 1) // unit * unit
    pad = padded - lane_bits
    pad_before = torch.cumsum(pad, 0) - pad
    pos = torch.cumsum(nbits, 0) - nbits + torch.repeat_interleave(pad_before, steps)
    total = int(padded.sum())
    n_words = -(-total // 32) + R.WORD_PAD
    # split each code (<= 12 bits at bit offset < 32 of its first word) into a piece for that word and, when
    # it crosses the word's end, a piece for the next one; all values stay positive int64
    end = (pos & 31) + nbits
    crosses = end > 32
    hi = torch.where(crosses, code >> (end - 32).clamp(min=0), code << (32 - end).clamp(min=0))
    lo = torch.where(crosses, (code << (64 - end).clamp(max=63)) & 0xFFFFFFFF, 0)
    word = pos >> 5
    hi, lo = torch.where(valid, hi, 0), torch.where(valid, lo, 0)
    words = torch.zeros(n_words + 1, dtype=torch.int64, device=dev)
    words.index_add_(0, word, hi)
    words.index_add_(0, word + 1, lo)
    words = words[:n_words]
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    lane_start = torch.cumsum(padded, 0) - padded
    kept, field_bits = R.field_layout(x.dtype, None)
    return {
        "words": words,
        "lane_units": (padded // unit).to(torch.uint8),
        "group_offsets": lane_start[:: R.GROUP].contiguous(),
        "raw": _pack_raw(raw, field_bits),
        "lengths": torch.from_numpy(lengths_np.copy()).to(dev),
    }
