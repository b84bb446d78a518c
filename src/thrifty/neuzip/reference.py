"""NeuZip codec, the spec and the CPU path (NumPy, vectorized across lanes).

Layout of one compressed tensor of N elements (bf16, fp16 or fp32, read as raw bits):

* Each element is split into an 8-bit **symbol** (entropy coded) and a **raw field** (stored as is):
  - bf16 / fp32: symbol = the 8-bit exponent; raw = sign + mantissa (8 / 24 bits).
  - fp16: symbol = the 5-bit exponent + the top 3 mantissa bits (bits 14..7), so that fp16 shares bf16's
    byte layout; raw = sign + the low 7 mantissa bits.
  - lossy bf16 (``mantissa_bits=k``, k in {0, 1, 3}): the mantissa is first rounded to k bits (round to
    nearest even, carry into the exponent), raw = sign + k bits, packed 8/(k+1) fields per byte.
* Symbols are coded with one **canonical Huffman code per tensor**, lengths <= ``MAX_CODE_BITS`` (12), over
  the symbols that occur. The code is stored once as 256 code lengths.
* **Lanes**: elements are cut into groups of ``GROUP * steps`` consecutive elements; lane j of a group
  decodes elements j, j + 64, j + 128, ... (``steps`` of them). The lane length ``steps`` is a per-tensor
  codec parameter, a power of two in ``LANE_STEPS`` (64, 128 or 256); shorter lanes give a GPU decoder more,
  shorter dependency chains. So at every step the 64 lanes of a group
  read/write 64 *consecutive* elements (coalesced on a GPU) while each lane has its own bit stream. Lane
  streams are concatenated MSB-first into 32-bit words, each lane padded with zero bits to a multiple of
  its **unit** of ``steps // 16`` bits (4 / 8 / 16 for 64 / 128 / 256); ``lane_units`` (uint8) holds each
  lane's padded length in units and ``group_offsets`` (int64) each group's first bit, so every lane starts
  at group_offset + unit * (exclusive prefix sum of the lane units within its group) and decodes
  independently. Exact for every input: a lane has at most 12 * steps bits = 192 units < 256.
  Metadata cost: 8 bits per lane + (unit - 1) / 2 padding bits on average (code lengths spread the lane
  ends evenly), i.e. (8 + 1.5) / 64 = 0.148, (8 + 3.5) / 128 = 0.090, (8 + 7.5) / 256 = 0.061 bits per
  weight for 64 / 128 / 256 (+ 64 bits per group of 64 * steps elements).
* **Pair symbols** (chosen per tensor, :func:`choose_pair_code`): the coded symbol may instead be
  the *pair* of the symbols of elements 2p and 2p + 1 (``(s[2p] << 8) | s[2p + 1]``; past an odd end the
  second is 0), coded with one canonical Huffman code over the pairs that occur (lengths <= 12, so at most
  4096 pairs; the code is stored as the sorted pair list ``pair_syms`` + their ``lengths``). The lanes are
  the same with pairs for symbols: lane j of a group decodes pairs j, j + 64, ... (``steps // 2`` of them),
  i.e. elements 2j, 2j + 1, 2j + 128, 2j + 129, ...; a group still covers ``GROUP * steps`` elements, and
  the lane-length unit and metadata are unchanged. Why: one table lookup decodes two elements, and a lane
  writes two adjacent elements (one 32-bit store for bf16) per step (NOTES.md, "pair symbols").

The decoder below is the same lane-parallel algorithm as the Triton kernel (a Python loop over the
``steps`` steps, NumPy over all lanes), so both give the same bits by construction.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

MAX_CODE_BITS = 12  # one 4096-entry decode table; costs ~0.003 bits/symbol vs unlimited Huffman
GROUP = 64  # lanes per group: 64 consecutive elements per step (128 B of bf16)
LANE_STEPS = (64, 128, 256)  # allowed symbols per lane
STEPS = 64  # default lane length (GPU decode speed vs metadata, NOTES.md): 0.087 bits/weight more than 256
WORD_PAD = 4  # zero words after the stream so a decoder's look-ahead never reads past the end
ALIGN_BYTES = 16  # each tensor's part of a block pack's stream starts at a multiple of this (block_decode)

# dtype -> (bits per element, position of the symbol's lowest bit, raw bits kept below the symbol)
DTYPES = {
    torch.bfloat16: (16, 7, 7),
    torch.float16: (16, 7, 7),
    torch.float32: (32, 23, 23),
}
LOSSY_MANTISSA_BITS = (0, 1, 3, 7)
PAIR_SYMBOLS = 1 << 16  # pair symbols: (first << 8) | second
MAX_PAIRS = 1 << MAX_CODE_BITS  # a prefix code of lengths <= 12 has at most 4096 codes
PAIR_SIZE_SLACK = 1.01  # pairs are kept if at most 1% larger than single symbols: they decode ~2x fewer lookups  # bf16 only; 7 is every bf16 mantissa bit, i.e. lossless


# ----------------------------------------------------------------------------------------- bit fields
def _uint_view(x: torch.Tensor) -> np.ndarray:
    """The raw bits of a float tensor as an unsigned NumPy array (uint16 / uint32), flattened."""
    bits = DTYPES[x.dtype][0]
    ints = x.detach().contiguous().reshape(-1).cpu().view(torch.int16 if bits == 16 else torch.int32)
    return ints.numpy().view(np.uint16 if bits == 16 else np.uint32)


def _from_uint(u: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    bits = DTYPES[dtype][0]
    ints = torch.from_numpy(np.ascontiguousarray(u).view(np.int16 if bits == 16 else np.int32).copy())
    return ints.view(dtype).reshape(shape)


def split_fields(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sign, exponent, mantissa) of every element as NumPy integer arrays (IEEE fields, flattened)."""
    bits = DTYPES[x.dtype][0]
    exp_bits = {torch.bfloat16: 8, torch.float16: 5, torch.float32: 8}[x.dtype]
    man_bits = bits - 1 - exp_bits
    u = _uint_view(x).astype(np.uint32)
    return u >> (bits - 1), (u >> man_bits) & ((1 << exp_bits) - 1), u & ((1 << man_bits) - 1)


def merge_fields(sign, exponent, mantissa, dtype: torch.dtype, shape) -> torch.Tensor:
    """Inverse of :func:`split_fields`."""
    bits = DTYPES[dtype][0]
    exp_bits = {torch.bfloat16: 8, torch.float16: 5, torch.float32: 8}[dtype]
    man_bits = bits - 1 - exp_bits
    u = (np.asarray(sign, np.uint32) << (bits - 1)) | (np.asarray(exponent, np.uint32) << man_bits)
    u = u | np.asarray(mantissa, np.uint32)
    return _from_uint(u.astype(np.uint16 if bits == 16 else np.uint32), dtype, shape)


def split_symbols(u: np.ndarray, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Codec split of raw bits: (8-bit symbol, raw field = sign above the kept low bits)."""
    bits, shift, kept = DTYPES[dtype]
    u = u.astype(np.uint32)
    symbol = ((u >> shift) & 0xFF).astype(np.uint8)
    raw = ((u >> (bits - 1)) << kept) | (u & ((1 << kept) - 1))
    return symbol, raw


def merge_symbols(symbol: np.ndarray, raw: np.ndarray, dtype: torch.dtype, kept: int) -> np.ndarray:
    """Inverse of :func:`split_symbols` for a raw field of ``kept`` mantissa bits (lossy: kept < full)."""
    bits, shift, _ = DTYPES[dtype]
    raw = raw.astype(np.uint32)
    u = ((raw >> kept) << (bits - 1)) | (symbol.astype(np.uint32) << shift)
    u = u | ((raw & ((1 << kept) - 1)) << (shift - kept))
    return u.astype(np.uint16 if bits == 16 else np.uint32)


# ------------------------------------------------------------------------------------- lossy rounding
def round_mantissa(x: torch.Tensor, k: int) -> torch.Tensor:
    """Rounds bf16 ``x`` to k mantissa bits, round to nearest even on the magnitude's bits.

    A carry out of the mantissa increments the exponent (still within 2^-(k+1) relative). A finite value that
    would round up to infinity is truncated instead (relative change < 2^-k). Infinities stay; a NaN stays a
    NaN (its top mantissa bit is forced on so it survives the cut; payload bits below k are lost; k=0 has no mantissa bit for it, so NaN input raises ValueError). Subnormals
    get an absolute error <= 2^-(k+1) * 2^-126 (relative to the smallest normal).
    """
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x: lossy rounding is implemented for torch.bfloat16, got {x.dtype}")
    u = _uint_view(x).astype(np.uint32)
    drop = 7 - k
    if drop == 0:
        return x.clone()
    sign, mag = u & 0x8000, u & 0x7FFF
    special = mag >= 0x7F80
    if k == 0 and (mag > 0x7F80).any():  # no mantissa bit left to tell a NaN from an infinity
        raise ValueError(f"mantissa_bits=0 cannot represent NaN; the tensor holds {(mag > 0x7F80).sum()} NaNs")
    lsb = (mag >> drop) & 1
    rounded = ((mag + (1 << (drop - 1)) - 1 + lsb) >> drop) << drop
    truncated = (mag >> drop) << drop
    rounded = np.where(rounded >= 0x7F80, truncated, rounded)  # never overflow a finite value to inf
    nan_quiet = (mag | 0x0040) >> drop << drop  # quiet bit (mantissa bit 6) kept for every k >= 1
    out = np.where(special, np.where(mag > 0x7F80, nan_quiet, mag), rounded)
    return _from_uint((sign | out).astype(np.uint16), torch.bfloat16, x.shape)


# ------------------------------------------------------------------------------------ Huffman code
def code_lengths(counts: np.ndarray, max_bits: int = MAX_CODE_BITS) -> np.ndarray:
    """Huffman code lengths (uint8[256], 0 = absent) for symbol counts, limited to ``max_bits``.

    Length limit by halving the counts (keeping them >= 1) until the tree is shallow enough: on weight
    exponents this costs < 0.01 bits/symbol. A lone symbol gets length 1.
    """
    counts = np.asarray(counts, dtype=np.int64)
    present = np.flatnonzero(counts)
    lengths = np.zeros(len(counts), dtype=np.uint8)
    if len(present) == 0:
        return lengths
    if len(present) == 1:
        lengths[present[0]] = 1
        return lengths
    c = counts.copy()
    while True:
        depth = _huffman_depths([int(v) for v in c[present]], [int(v) for v in present])
        if max(depth) <= max_bits:
            lengths[present] = depth
            return lengths
        c[present] = np.maximum(c[present] >> 1, 1)


def _huffman_depths(weights: list, symbols: list) -> list:
    """Leaf depths of the Huffman tree that merges the two lightest nodes, ties broken by each node's smallest
    symbol (unique among live nodes, so the merge order is fully determined). Pure Python on ints with
    parent links: a leaf's depth is the number of merges above it. (The former version added 1 to a NumPy
    fancy index of every merged leaf list: ~100 µs per round of the length limit, up to ~13 rounds per tensor.)"""
    m = len(weights)
    heap = [(w, t, i) for i, (w, t) in enumerate(zip(weights, symbols))]
    heapq.heapify(heap)
    parent = [-1] * (2 * m - 1)
    node = m
    while len(heap) > 1:
        w1, t1, a = heapq.heappop(heap)
        w2, t2, b = heapq.heappop(heap)
        parent[a] = parent[b] = node
        heapq.heappush(heap, (w1 + w2, min(t1, t2), node))
        node += 1
    depth = [0] * (2 * m - 1)
    for i in range(2 * m - 3, -1, -1):  # parents are created after their children: fill from the root down
        depth[i] = depth[parent[i]] + 1
    return depth[:m]


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical Huffman codes (uint32[256]) for code lengths: shorter first, then by symbol."""
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = np.zeros(len(lengths), dtype=np.uint32)
    present = np.flatnonzero(lengths)
    order = present[np.lexsort((present, lengths[present]))]
    if len(order) == 0:
        return codes
    # In (length, symbol) order each code is the previous + 1, shifted left by the step in length: so the first
    # code of each length comes from a loop over the <= 12 distinct lengths and the others count up from it
    # (the canonical definition's values; vectorized because pair codes have ~300 symbols per tensor).
    n = lengths[order]
    uniq, start, count = np.unique(n, return_index=True, return_counts=True)
    first, code, prev = np.zeros(len(uniq), np.int64), 0, int(uniq[0])
    for k, length in enumerate(uniq.tolist()):
        code <<= length - prev
        first[k], code, prev = code, code + int(count[k]), length
    k = np.searchsorted(uniq, n)
    codes[order] = first[k] + np.arange(len(order)) - start[k]
    return codes


def limited_lengths(counts: np.ndarray, max_bits: int = MAX_CODE_BITS) -> np.ndarray:
    """Optimal code lengths (uint8, 0 = absent) limited to ``max_bits``, by package-merge; for pair symbols,
    where :func:`code_lengths`' halving of the counts costs ~0.05 bits per element (4096² N(0, 0.02)).

    Leaves sorted by (count, symbol); at each of the ``max_bits`` levels the list is the leaves merged
    (stably, leaves first on ties) with the pairwise packages of the level below. The first 2m - 2 items of
    the top list are selected; a selected package selects the first 2 items per package of the level below,
    and each leaf gets one bit per level where it is selected. Deterministic, so every encoder agrees."""
    counts = np.asarray(counts, dtype=np.int64)
    present = np.flatnonzero(counts)
    lengths = np.zeros(len(counts), dtype=np.uint8)
    m = len(present)
    if m > 1 << max_bits:
        raise ValueError(f"counts: {m} symbols cannot have a prefix code of lengths <= {max_bits}")
    if m <= 1:
        lengths[present] = 1
        return lengths
    leaves = present[np.lexsort((present, counts[present]))]
    weights = counts[leaves]
    levels = []  # per level above the bottom: is_package flags of the merged list
    items = weights
    for _ in range(max_bits - 1):
        packages = items[0: len(items) // 2 * 2: 2] + items[1: len(items) // 2 * 2: 2]
        merged = np.concatenate([weights, packages])
        order = np.argsort(merged, kind="stable")
        levels.append(order >= m)
        items = merged[order]
    depth = np.zeros(m, dtype=np.int64)
    take = 2 * m - 2
    for is_package in reversed(levels):
        chosen = is_package[:take]
        leaves_taken = take - int(chosen.sum())
        depth[:leaves_taken] += 1
        take = 2 * int(chosen.sum())
    depth[:take] += 1
    lengths[leaves] = depth
    return lengths


def pair_symbols(symbol: np.ndarray) -> np.ndarray:
    """Pair symbols (int64) of an element-symbol array: (s[2p] << 8) | s[2p + 1], 0 past an odd end."""
    s = np.asarray(symbol).astype(np.int64)
    if len(s) % 2:
        s = np.concatenate([s, np.zeros(1, np.int64)])
    return (s[0::2] << 8) | s[1::2]


def choose_pair_code(pair_counts: np.ndarray, single_lengths: np.ndarray, single_counts: np.ndarray):
    """Pair code lengths (uint8[65536]) if a tensor is coded in pairs, else None.

    Pairs when at most 4096 pairs occur and the pair stream + its stored code (3 B per pair) is at most
    ``PAIR_SIZE_SLACK`` times the single-symbol stream + its 256 lengths: pairs decode twice the elements
    per table lookup. fp16 (exponent + 3 mantissa bits per symbol) usually has too many pairs."""
    pair_counts = np.asarray(pair_counts, dtype=np.int64)
    m = int(np.count_nonzero(pair_counts))
    if m == 0 or m > MAX_PAIRS:
        return None
    lengths = limited_lengths(pair_counts)
    pair_bits = int((pair_counts * lengths).sum()) + 24 * m
    single_bits = int((np.asarray(single_counts, np.int64) * single_lengths.astype(np.int64)).sum()) + 8 * 256
    return lengths if pair_bits <= PAIR_SIZE_SLACK * single_bits else None


def decode_table(lengths: np.ndarray) -> np.ndarray:
    """4096-entry int32 table indexed by the next 12 stream bits: (symbol << 4) | code length (symbols:
    0..255, or pair symbols 0..65535 when ``lengths`` has 65536 entries)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    table = np.full(1 << MAX_CODE_BITS, 1, dtype=np.int32)  # unused entries (never hit on valid streams)
    present = np.flatnonzero(lengths)
    # canonical order (length, symbol) is ascending code, and a code of n bits fills the 2^(12-n) entries from
    # code << (12-n): the ranges are adjacent from 0, so the table is the entries repeated (vectorized; cut at
    # 4096 entries if the lengths overfill the table, as the former per-symbol slices were), then the unused
    # tail of an incomplete code
    order = present[np.lexsort((present, lengths[present]))]
    n = lengths[order]
    filled = np.repeat(((order << 4) | n).astype(np.int32), 1 << (MAX_CODE_BITS - n))[: len(table)]
    table[: len(filled)] = filled
    return table


def entropy_bits(counts: np.ndarray) -> float:
    """Shannon entropy, bits per symbol."""
    p = np.asarray(counts, dtype=np.float64)
    p = p[p > 0] / p.sum() if p.sum() else p[:0]
    return float(-(p * np.log2(p)).sum())


# ------------------------------------------------------------------------------------ lanes and streams
def check_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)):
        raise TypeError(f"steps: expected an int (symbols per lane), got {type(steps).__name__}")
    if int(steps) not in LANE_STEPS:
        raise ValueError(f"steps: expected one of {list(LANE_STEPS)} (symbols per lane), got {steps!r}")
    return int(steps)


def n_groups(n: int, steps: int) -> int:
    return -(-n // (GROUP * steps))


def lane_order(n: int, steps: int = STEPS) -> np.ndarray:
    """Element index of every (lane, step) slot in lane-major order; -1 where past the tensor's end."""
    groups = n_groups(n, steps)
    idx = np.arange(groups * GROUP * steps, dtype=np.int64).reshape(groups, steps, GROUP)
    idx = idx.transpose(0, 2, 1).reshape(-1)  # [group, lane, step]
    return np.where(idx < n, idx, -1)


def lane_unit(steps: int) -> int:
    """Bits per unit of a stored lane length: steps / 16, so that the longest lane (12 bits per symbol) is
    192 units and fits a uint8."""
    return check_steps(steps) // 16


def lane_bit_lengths(lane_len: np.ndarray, steps: int) -> np.ndarray:
    """Each lane's (padded) length in bits, int64, from the stored uint8 lengths in units of lane_unit(steps)."""
    return np.asarray(lane_len, dtype=np.uint8).astype(np.int64) * lane_unit(steps)


@dataclass
class Streams:
    """The encoded parts of one tensor (all NumPy, as stored on disk)."""

    words: np.ndarray  # uint32, MSB-first bit stream of all lanes, + WORD_PAD zero words
    lane_len: np.ndarray  # per lane: uint8, the padded length in units of ``unit`` bits
    group_offsets: np.ndarray  # int64 per group: first bit of the group's first lane
    raw: np.ndarray  # uint8: raw fields (1 or 3 bytes per element, or packed (k+1)-bit fields)
    lengths: np.ndarray  # uint8[256] code lengths
    counts: np.ndarray  # int64[256] symbol histogram (not stored; for reports)
    steps: int  # elements per lane
    pairs: bool = False  # pair symbols: ``lengths`` then has 65536 entries (one per pair symbol)
    coded_bits: int = 0  # sum of the code lengths (set by encode; not stored)

    @property
    def unit(self) -> int:
        """Bits per stored lane-length unit: :func:`lane_unit`."""
        return lane_unit(self.steps)

    @property
    def lane_symbols(self) -> int:
        """Coded symbols per lane: steps, or steps // 2 pairs."""
        return self.steps // 2 if self.pairs else self.steps


def symbols_per_lane(steps: int, lengths: np.ndarray) -> int:
    """Coded symbols in a lane of ``steps`` elements: all of them, or steps // 2 pairs (65536 lengths)."""
    return steps // 2 if len(lengths) == PAIR_SYMBOLS else steps


def encode_symbols(symbol: np.ndarray, lengths: np.ndarray, steps: int = STEPS
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Huffman-encodes symbols into (words, lane_len, group_offsets), lanes of ``steps`` elements: uint8
    symbols (``steps`` per lane), or pair symbols when ``lengths`` has 65536 entries (``steps // 2`` per lane).
    Each lane is zero-padded to a multiple of :func:`lane_unit` bits; lane_len holds its length in units
    (uint8)."""
    unit = lane_unit(steps)
    steps = symbols_per_lane(steps, lengths)
    n = len(symbol)
    codes = canonical_codes(lengths).astype(np.uint64)
    slot = lane_order(n, steps)
    valid = slot >= 0
    sym = np.where(valid, symbol[np.maximum(slot, 0)] if n else 0, 0)
    nbits = np.where(valid, lengths.astype(np.int64)[sym], 0)
    code = np.where(valid, codes[sym], 0).astype(np.uint64)
    lanes = len(slot) // steps
    lane_bits = nbits.reshape(lanes, steps).sum(axis=1)
    padded = -(-lane_bits // unit) * unit
    # first bit of each code: its place in the unpadded concatenation + the padding of the lanes before it
    pad_before = np.cumsum(padded - lane_bits) - (padded - lane_bits)
    pos = np.cumsum(nbits) - nbits + np.repeat(pad_before, steps)
    total = int(padded.sum())
    n_words = -(-total // 32) + WORD_PAD
    # Left-justify each code in a 64-bit window starting at its word: high half -> word, low half -> word+1.
    # Codes never overlap, so summing the pieces per word (exactly, in float64: each sum < 2^32) ORs them.
    word = (pos >> 5)[valid]
    window = code[valid] << (np.uint64(64) - nbits[valid].astype(np.uint64) - (pos[valid] & 31).astype(np.uint64))
    hi = (window >> np.uint64(32)).astype(np.float64)
    lo = (window & np.uint64(0xFFFFFFFF)).astype(np.float64)
    words = np.bincount(word, weights=hi, minlength=n_words) + np.bincount(word + 1, weights=lo, minlength=n_words)
    words = words[:n_words].astype(np.uint64).astype(np.uint32)
    lane_start = np.cumsum(padded) - padded
    group_offsets = lane_start[::GROUP].astype(np.int64)
    lane_len = (padded // unit).astype(np.uint8)
    return words, lane_len, group_offsets


def decode_symbols(words: np.ndarray, lane_len: np.ndarray, group_offsets: np.ndarray, lengths: np.ndarray,
                   n: int, steps: int = STEPS) -> np.ndarray:
    """Lane-parallel decoder: one Python step per symbol position, NumPy across all lanes. ``n`` symbols in
    lanes of ``steps`` elements: uint8 symbols, or int64 pair symbols when ``lengths`` has 65536 entries."""
    lane_bits = lane_bit_lengths(lane_len, steps)
    steps = symbols_per_lane(steps, lengths)
    lanes = len(lane_len)
    table = decode_table(lengths)
    # zero words past the end: a lane whose stored length understates its codes (forged) reads zeros, not
    # past the array (a lane reads at most 12 * steps bits from its start)
    w64 = np.concatenate([np.asarray(words, dtype=np.uint64),
                          np.zeros(MAX_CODE_BITS * steps // 32 + 2, np.uint64)])
    within = np.cumsum(lane_bits.reshape(-1, GROUP), axis=1) - lane_bits.reshape(-1, GROUP)
    pos = (np.asarray(group_offsets, dtype=np.int64)[:, None] + within).reshape(-1)
    lane = np.arange(lanes, dtype=np.int64)
    first = (lane // GROUP) * GROUP * steps + lane % GROUP  # element index of each lane's first symbol
    out = np.zeros(n, dtype=np.uint8 if len(lengths) <= 256 else np.int64)
    for step in range(steps):
        elem = first + step * GROUP
        valid = elem < n
        if not valid.any():
            break
        w = pos >> 5
        window = ((w64[w] << np.uint64(32)) | w64[w + 1]) << (pos & 31).astype(np.uint64)
        entry = table[(window >> np.uint64(64 - MAX_CODE_BITS)).astype(np.int64)]
        out[elem[valid]] = entry[valid] >> 4
        pos = pos + np.where(valid, entry & 15, 0)
    return out


# --------------------------------------------------------------------------------- raw field packing
def pack_fields(raw: np.ndarray, field_bits: int) -> np.ndarray:
    """Packs raw fields: 8 -> 1 byte each, 24 -> 3 little-endian bytes, 1/2/4 -> 8/field_bits per byte
    (element i in the bits (i * field_bits) % 8 upward of byte i * field_bits // 8)."""
    raw = raw.astype(np.uint32)
    if field_bits == 8:
        return raw.astype(np.uint8)
    if field_bits == 24:
        return raw.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :3].reshape(-1).copy()
    per_byte = 8 // field_bits
    pad = (-len(raw)) % per_byte
    r = np.concatenate([raw, np.zeros(pad, np.uint32)]).reshape(-1, per_byte)
    shifts = (np.arange(per_byte) * field_bits).astype(np.uint32)
    return np.bitwise_or.reduce(r << shifts, axis=1).astype(np.uint8)


def unpack_fields(packed: np.ndarray, field_bits: int, n: int) -> np.ndarray:
    packed = np.asarray(packed, dtype=np.uint8)
    if field_bits == 8:
        return packed[:n].astype(np.uint32)
    if field_bits == 24:
        b = packed[: 3 * n].reshape(-1, 3).astype(np.uint32)
        return b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    per_byte = 8 // field_bits
    i = np.arange(n)
    return (packed[i // per_byte].astype(np.uint32) >> ((i % per_byte) * field_bits).astype(np.uint32)) & (
        (1 << field_bits) - 1)


# ------------------------------------------------------------------------------------------- codec
def field_layout(dtype: torch.dtype, mantissa_bits) -> tuple[int, int]:
    """(kept mantissa bits in the raw field, raw field bits incl. sign)."""
    _, _, full = DTYPES[dtype]
    kept = full if mantissa_bits is None else mantissa_bits
    return kept, kept + 1


def encode(x: torch.Tensor, mantissa_bits=None, steps: int = STEPS, pairs: bool | None = None) -> Streams:
    """Encodes a bf16/fp16/fp32 tensor (lossless, or bf16 rounded to ``mantissa_bits``) in lanes of ``steps``
    elements. pairs: None = pair symbols when :func:`choose_pair_code` says so, False = single symbols, True =
    pair symbols (ValueError if more than 4096 pairs occur). No other validation here."""
    if mantissa_bits is not None and mantissa_bits < 7:
        x = round_mantissa(x, mantissa_bits)
    elif mantissa_bits == 7:
        mantissa_bits = None
    u = _uint_view(x)
    symbol, raw = split_symbols(u, x.dtype)
    kept, field_bits = field_layout(x.dtype, mantissa_bits)
    full = DTYPES[x.dtype][2]
    raw = ((raw >> full) << kept) | ((raw & ((1 << full) - 1)) >> (full - kept))  # keep the top `kept` bits
    counts = np.bincount(symbol, minlength=256).astype(np.int64)
    lengths = code_lengths(counts)
    pair_lengths = None
    coded_bits = int((counts * lengths.astype(np.int64)).sum())
    if pairs is not False:
        pair = pair_symbols(symbol)
        pair_counts = np.bincount(pair, minlength=PAIR_SYMBOLS)
        if pairs:
            if np.count_nonzero(pair_counts) > MAX_PAIRS:
                raise ValueError(f"pairs: {np.count_nonzero(pair_counts)} distinct pairs, a pair code holds {MAX_PAIRS}")
            pair_lengths = limited_lengths(pair_counts)
        else:
            pair_lengths = choose_pair_code(pair_counts, lengths, counts)
    if pair_lengths is None:
        words, lane_len, group_offsets = encode_symbols(symbol, lengths, steps)
    else:
        words, lane_len, group_offsets = encode_symbols(pair, pair_lengths, steps)
        lengths = pair_lengths
        coded_bits = int((pair_counts * lengths.astype(np.int64)).sum())
    return Streams(words, lane_len, group_offsets, pack_fields(raw, field_bits), lengths, counts, steps,
                   pair_lengths is not None, coded_bits)


def decode(s: Streams, dtype: torch.dtype, shape, mantissa_bits=None) -> torch.Tensor:
    """CPU decoder: the spec the Triton kernel must match bit for bit."""
    n = int(np.prod(shape, dtype=np.int64))
    kept, field_bits = field_layout(dtype, None if mantissa_bits == 7 else mantissa_bits)
    if s.pairs:
        pair = decode_symbols(s.words, s.lane_len, s.group_offsets, s.lengths, -(-n // 2), s.steps)
        symbol = np.stack([pair >> 8, pair & 0xFF], axis=1).reshape(-1)[:n].astype(np.uint8)
    else:
        symbol = decode_symbols(s.words, s.lane_len, s.group_offsets, s.lengths, n, s.steps)
    raw = unpack_fields(s.raw, field_bits, n)
    return _from_uint(merge_symbols(symbol, raw, dtype, kept), dtype, shape)
