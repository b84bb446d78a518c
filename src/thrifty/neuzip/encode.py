"""The lossless encoder in torch ops, on the tensor's own device: same bits as :func:`reference.encode`.

LOMO re-encodes every weight after every update, so the encoder must not leave the GPU: a host round trip of
the weights (NumPy encoder) costs ~2 x 2 B/weight of PCIe traffic plus ~70 ns/weight of NumPy work (the CPU
reference encodes ~15M weights/s). Here every step is a torch op over all elements: split, a 256-bin histogram
(the only value the host reads, with the total bit count: two small syncs per tensor), canonical Huffman code
lengths on the host (256 symbols, ~1 ms of Python), then per-element code lengths by table gather, lane sums, a
prefix sum for each code's bit position and a scatter-add of the code pieces into the 32-bit words (codes never
overlap, so adding is OR-ing). Not a fused Triton kernel: it makes ~40 elementwise passes over int64
temporaries, in chunks of ~1M elements (so ~8 MB each, whatever the tensor's size), i.e. roughly 300 B of memory
traffic per weight and ~10 small launches per chunk (NOTES.md has the arithmetic).
"""

from __future__ import annotations

import numpy as np
import torch

from .._checks import check_impl
from . import reference as R
from .tensor import pair_symbols

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


CHUNK_ELEMENTS = 1 << 20  # elements encoded per pass: bounds the int64 temporaries to ~8 MB each


def _slots(symbol: torch.Tensor, n: int, groups: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(symbol, valid) of every (lane, step) slot of the first ``groups`` groups of ``n`` symbols in lanes of
    ``steps`` symbols, lane-major ([group, lane, step])."""
    idx = torch.arange(groups * R.GROUP * steps, device=symbol.device, dtype=torch.int64)
    idx = idx.view(groups, steps, R.GROUP).transpose(1, 2).reshape(-1)
    valid = idx < n
    return symbol[idx.clamp(max=n - 1)], valid


def encode_lossless(x: torch.Tensor, steps: int = R.STEPS, chunk_elements: int = CHUNK_ELEMENTS) -> dict:
    """Streams of ``x`` (bf16 / fp16 / fp32) in the stored layout (uint8 lane units), computed on ``x.device``.

    Returns {"words": int32, "lane_units": uint8, "group_offsets": int64, "raw": uint8, "lengths": uint8[256]}
    (pair-coded: "pair_syms" + "lengths", :func:`tensor.code_streams`), bit-identical to
    ``reference.encode(x, None, steps)`` (tested). Works in chunks of whole groups (``chunk_elements``; a group
    has an even number of elements, so no pair straddles two chunks), so its temporaries stay small whatever
    the tensor's size: pass 1 counts symbols and pairs, pass 2 sums each lane's code lengths, pass 3 writes
    the codes and the raw fields."""
    from .tensor import code_streams

    steps = R.check_steps(steps)
    dev = x.device
    n = x.numel()
    bits, shift, kept = R.DTYPES[x.dtype]
    flat = x.detach().contiguous().reshape(-1).view(_INT_VIEW[bits])
    unit = R.lane_unit(steps)
    groups = R.n_groups(n, steps)
    per_group = R.GROUP * steps
    chunk = max(1, chunk_elements // per_group)  # groups per chunk
    spans = [(g, min(g + chunk, groups)) for g in range(0, groups, chunk)]

    def symbols(e0, e1):
        u = flat[e0:e1].to(torch.int64) & ((1 << bits) - 1)
        return u, (u >> shift) & 0xFF

    counts = torch.zeros(256, dtype=torch.int64, device=dev)
    pair_counts = torch.zeros(R.PAIR_SYMBOLS, dtype=torch.int64, device=dev)
    for g0, g1 in spans:
        sym_e = symbols(g0 * per_group, min(g1 * per_group, n))[1]
        counts += torch.bincount(sym_e, minlength=256)
        pair_counts += torch.bincount(pair_symbols(sym_e), minlength=R.PAIR_SYMBOLS)
    lengths_np = R.code_lengths(counts.cpu().numpy())
    pair_lengths = R.choose_pair_code(pair_counts.cpu().numpy(), lengths_np, counts.cpu().numpy())
    pairs = pair_lengths is not None
    if pairs:
        lengths_np = pair_lengths
    lengths = torch.from_numpy(lengths_np.astype(np.int64)).to(dev)
    codes = torch.from_numpy(R.canonical_codes(lengths_np).astype(np.int64)).to(dev)
    per_lane = R.symbols_per_lane(steps, lengths_np)

    def coded(sym_e):
        """(the coded symbols of a chunk's element symbols: one per element or per pair, their count)."""
        return (pair_symbols(sym_e), -(-sym_e.numel() // 2)) if pairs else (sym_e, sym_e.numel())

    lane_bits = torch.zeros(groups * R.GROUP, dtype=torch.int64, device=dev)
    for g0, g1 in spans:
        sym, valid = _slots(*coded(symbols(g0 * per_group, min(g1 * per_group, n))[1]), g1 - g0, per_lane)
        lane_bits[g0 * R.GROUP: g1 * R.GROUP] = torch.where(valid, lengths[sym], 0).view(-1, per_lane).sum(1)
    padded = (lane_bits + unit - 1) // unit * unit
    lane_start = torch.cumsum(padded, 0) - padded
    total = int(padded.sum())
    n_words = -(-total // 32) + R.WORD_PAD
    words = torch.zeros(n_words + 1, dtype=torch.int64, device=dev)
    kept_bits, field_bits = R.field_layout(x.dtype, None)
    raw_out = torch.empty(n * field_bits // 8, dtype=torch.uint8, device=dev)
    for g0, g1 in spans:
        e0, e1 = g0 * per_group, min(g1 * per_group, n)
        u, sym_e = symbols(e0, e1)
        raw = ((u >> (bits - 1)) << kept) | (u & ((1 << kept) - 1))
        raw_out[e0 * field_bits // 8: e1 * field_bits // 8] = _pack_raw(raw, field_bits)
        sym, valid = _slots(*coded(sym_e), g1 - g0, per_lane)
        nbits = torch.where(valid, lengths[sym], 0)
        code = torch.where(valid, codes[sym], 0)
        within = nbits.view(-1, per_lane).cumsum(1) - nbits.view(-1, per_lane)
        pos = (lane_start[g0 * R.GROUP: g1 * R.GROUP, None] + within).reshape(-1)
        # split each code (<= 12 bits at bit offset < 32 of its first word) into a piece for that word and,
        # when it crosses the word's end, a piece for the next one; all values stay positive int64
        end = (pos & 31) + nbits
        crosses = end > 32
        hi = torch.where(crosses, code >> (end - 32).clamp(min=0), code << (32 - end).clamp(min=0))
        lo = torch.where(crosses, (code << (64 - end).clamp(max=63)) & 0xFFFFFFFF, 0)
        word = pos >> 5
        words.index_add_(0, word, torch.where(valid, hi, 0))
        words.index_add_(0, word + 1, torch.where(valid, lo, 0))
    words = words[:n_words]
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return {
        "words": words,
        "lane_units": (padded // unit).to(torch.uint8),
        "group_offsets": lane_start[:: R.GROUP].contiguous(),
        "raw": raw_out,
        **{k: v.to(dev) for k, v in code_streams(lengths_np).items()},
    }


def encode_on_device(x: torch.Tensor, steps: int = R.STEPS, impl: str = "auto") -> dict:
    """The encoder for ``x``'s device: the Triton kernels (:mod:`encode_kernel`) on CUDA, these torch ops
    elsewhere ("auto"); "triton" forces the kernels (the interpreter on CPU), "reference" the torch ops.
    ``impl`` follows :data:`thrifty._checks.IMPLS` (TypeError / ValueError naming ``impl`` otherwise)."""
    check_impl(impl)
    if impl == "auto":
        impl = "triton" if x.is_cuda else "reference"
    if impl == "triton":
        from .encode_kernel import encode_lossless_triton

        return encode_lossless_triton(x, steps)
    return encode_lossless(x, steps)
