"""Triton decoder: the lane-parallel algorithm of :mod:`thrifty.neuzip.reference`, one lane per vector slot.

A program owns ``GROUPS_PER_PROG`` groups of 64 lanes. Each lane keeps a 64-bit bit buffer (valid bits
left-aligned) in registers and refills it with one 32-bit word whenever 32 or fewer bits remain, so a word
load is needed only every ~12 symbols; a symbol costs one lookup in the 4096-entry table (16 KB, stays in L1)
and a few integer ops. At every step the program loads and stores consecutive elements (64 per group), so the
raw fields and the output move coalesced; the output is written straight into the caller's buffer.

Two kernels, same bits: ``_decode_kernel`` (v1, the plain loop) and ``_decode_kernel_pipelined`` (v2, the
default: memory latency taken off the per-step chain; 2-3x faster below ~20M weights, see NOTES.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference as R


@triton.jit
def _decode_kernel(words_ptr, lane_bits_ptr, group_off_ptr, raw_ptr, table_ptr, small_ptr, out_ptr, n, n_lanes,
                   STEPS: tl.constexpr, GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                   FIELD_BITS: tl.constexpr, KEPT: tl.constexpr, SYM_SHIFT: tl.constexpr,
                   SIGN_SHIFT: tl.constexpr, TABLE_BITS: tl.constexpr, SMALL_TABLE: tl.constexpr):
    LANES: tl.constexpr = GROUP * GROUPS_PER_PROG
    pid = tl.program_id(0)
    lane = pid * LANES + tl.arange(0, LANES)
    lane_ok = lane < n_lanes
    bits = tl.load(lane_bits_ptr + lane, mask=lane_ok, other=0).to(tl.int32) & 0xFFFF
    base = tl.load(group_off_ptr + pid * GROUPS_PER_PROG)  # int64: first bit of this program's lanes
    start = base + (tl.cumsum(bits, axis=0) - bits).to(tl.int64)
    word = (start >> 5).to(tl.int32)
    off = (start & 31).to(tl.int32)
    w0 = tl.load(words_ptr + word, mask=lane_ok, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    w1 = tl.load(words_ptr + word + 1, mask=lane_ok, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    buf = ((w0 << 32) | w1) << off.to(tl.uint64)
    avail = 64 - off  # valid bits in buf
    next_word = word + 2
    elem = (lane // GROUP) * (GROUP * STEPS) + lane % GROUP
    for _ in range(STEPS):
        valid = elem < n
        entry = _lookup(buf, table_ptr, small_ptr, TABLE_BITS, SMALL_TABLE)
        length = tl.where(valid, entry & 15, 0)
        symbol = entry >> 4
        buf = buf << length.to(tl.uint64)
        avail -= length
        refill = avail <= 32
        w = tl.load(words_ptr + next_word, mask=refill, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
        buf = buf | (w << tl.where(refill, 32 - avail, 0).to(tl.uint64))
        avail = tl.where(refill, avail + 32, avail)
        next_word = tl.where(refill, next_word + 1, next_word)
        # raw field: sign above KEPT mantissa bits
        if FIELD_BITS == 24:
            b = raw_ptr + 3 * elem.to(tl.int64)
            field = (tl.load(b, mask=valid, other=0).to(tl.int32)
                     | (tl.load(b + 1, mask=valid, other=0).to(tl.int32) << 8)
                     | (tl.load(b + 2, mask=valid, other=0).to(tl.int32) << 16))
        elif FIELD_BITS == 8:
            field = tl.load(raw_ptr + elem, mask=valid, other=0).to(tl.int32)
        else:
            bitpos = elem * FIELD_BITS
            byte = tl.load(raw_ptr + (bitpos >> 3), mask=valid, other=0).to(tl.int32)
            field = (byte >> (bitpos & 7)) & ((1 << FIELD_BITS) - 1)
        value = ((field >> KEPT) << SIGN_SHIFT) | (symbol << SYM_SHIFT)
        value = value | ((field & ((1 << KEPT) - 1)) << (SYM_SHIFT - KEPT))
        if SIGN_SHIFT == 15:
            tl.store(out_ptr + elem, value.to(tl.int16), mask=valid)
        else:
            tl.store(out_ptr + elem, value, mask=valid)
        elem += GROUP


@triton.jit
def _lookup(buf, table_ptr, small_ptr, TABLE_BITS: tl.constexpr, SMALL_TABLE: tl.constexpr):
    """(symbol << 4) | code length of the code at the top of ``buf``."""
    if SMALL_TABLE:
        # codes <= 8 bits (~99% of weight exponents) from a 256-entry int16 table (512 B: few cache
        # lines per warp-wide gather); the rest from the full table, loaded for those lanes only
        entry = tl.load(small_ptr + (buf >> 56).to(tl.int32)).to(tl.int32)
        long_code = entry == 0
        full = tl.load(table_ptr + (buf >> (64 - TABLE_BITS)).to(tl.int32), mask=long_code, other=0)
        entry = tl.where(long_code, full, entry)
    else:
        entry = tl.load(table_ptr + (buf >> (64 - TABLE_BITS)).to(tl.int32))
    return entry


@triton.jit
def _load_field(raw_ptr, elem, valid, FIELD_BITS: tl.constexpr):
    """The raw field (sign above the kept mantissa bits) of each element; ".cg": stream through L2 only, so
    the lanes' words stay in L1."""
    if FIELD_BITS == 24:
        b = raw_ptr + 3 * elem.to(tl.int64)
        field = (tl.load(b, mask=valid, other=0, cache_modifier=".cg").to(tl.int32)
                 | (tl.load(b + 1, mask=valid, other=0, cache_modifier=".cg").to(tl.int32) << 8)
                 | (tl.load(b + 2, mask=valid, other=0, cache_modifier=".cg").to(tl.int32) << 16))
    elif FIELD_BITS == 8:
        field = tl.load(raw_ptr + elem, mask=valid, other=0, cache_modifier=".cg").to(tl.int32)
    else:
        bitpos = elem * FIELD_BITS
        byte = tl.load(raw_ptr + (bitpos >> 3), mask=valid, other=0, cache_modifier=".cg").to(tl.int32)
        field = (byte >> (bitpos & 7)) & ((1 << FIELD_BITS) - 1)
    return field


@triton.jit
def _step(buf, avail, next_word, field, elem, n, words_ptr, table_ptr, small_ptr, out_ptr,
          GROUP: tl.constexpr, KEPT: tl.constexpr, SYM_SHIFT: tl.constexpr, SIGN_SHIFT: tl.constexpr,
          TABLE_BITS: tl.constexpr, SMALL_TABLE: tl.constexpr):
    """Decodes one symbol per lane and stores its element; the next word is loaded *before* the lookup
    (for lanes that may need it: <= 44 bits left), so its latency overlaps the table's."""
    valid = elem < n
    maybe = avail <= 32 + 12
    w = tl.load(words_ptr + next_word, mask=maybe, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    entry = _lookup(buf, table_ptr, small_ptr, TABLE_BITS, SMALL_TABLE)
    length = tl.where(valid, entry & 15, 0)
    buf = buf << length.to(tl.uint64)
    avail -= length
    refill = avail <= 32  # implies `maybe`: a code takes at most 12 bits
    buf = buf | tl.where(refill, w << tl.where(refill, 32 - avail, 0).to(tl.uint64), 0)
    avail = tl.where(refill, avail + 32, avail)
    next_word = tl.where(refill, next_word + 1, next_word)
    value = ((field >> KEPT) << SIGN_SHIFT) | ((entry >> 4) << SYM_SHIFT)
    value = value | ((field & ((1 << KEPT) - 1)) << (SYM_SHIFT - KEPT))
    if SIGN_SHIFT == 15:
        tl.store(out_ptr + elem, value.to(tl.int16), mask=valid)
    else:
        tl.store(out_ptr + elem, value, mask=valid)
    return buf, avail, next_word


@triton.jit
def _decode_kernel_pipelined(words_ptr, lane_bits_ptr, group_off_ptr, raw_ptr, table_ptr, small_ptr, out_ptr,
                             n, n_lanes, n_words,
                             STEPS: tl.constexpr, GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                             FIELD_BITS: tl.constexpr, KEPT: tl.constexpr, SYM_SHIFT: tl.constexpr,
                             SIGN_SHIFT: tl.constexpr, TABLE_BITS: tl.constexpr, SMALL_TABLE: tl.constexpr):
    """v2: the same decode, with every memory latency taken off the per-step chain. Raw fields are loaded
    4 steps ahead (the loop body is unrolled by 4), the next word one step ahead, and each lane's whole word
    stream (~84 B) is pulled into L1 at the start (one wait instead of a miss every few steps)."""
    LANES: tl.constexpr = GROUP * GROUPS_PER_PROG
    pid = tl.program_id(0)
    lane = pid * LANES + tl.arange(0, LANES)
    lane_ok = lane < n_lanes
    bits = tl.load(lane_bits_ptr + lane, mask=lane_ok, other=0).to(tl.int32) & 0xFFFF
    base = tl.load(group_off_ptr + pid * GROUPS_PER_PROG)
    start = base + (tl.cumsum(bits, axis=0) - bits).to(tl.int64)
    word = (start >> 5).to(tl.int32)
    off = (start & 31).to(tl.int32)
    last_word = word + ((off + bits) >> 5) + 2
    # touch every 32-byte sector of the lane's stream now; `junk` is always 0 but the compiler cannot know
    junk = tl.zeros([LANES], dtype=tl.int32)
    for k in tl.static_range(1, 13):  # up to 12 sectors = 3072 bits, the longest possible lane
        pw = word + 8 * k
        junk |= tl.load(words_ptr + pw, mask=lane_ok & (pw <= last_word) & (pw < n_words), other=0) & (lane < 0)
    w0 = tl.load(words_ptr + word, mask=lane_ok, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    w1 = tl.load(words_ptr + word + 1, mask=lane_ok, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    buf = ((w0 << 32) | w1) << off.to(tl.uint64)
    avail = 64 - off + junk
    next_word = word + 2
    elem = (lane // GROUP) * (GROUP * STEPS) + lane % GROUP
    f0 = _load_field(raw_ptr, elem, elem < n, FIELD_BITS)
    f1 = _load_field(raw_ptr, elem + GROUP, elem + GROUP < n, FIELD_BITS)
    f2 = _load_field(raw_ptr, elem + 2 * GROUP, elem + 2 * GROUP < n, FIELD_BITS)
    f3 = _load_field(raw_ptr, elem + 3 * GROUP, elem + 3 * GROUP < n, FIELD_BITS)
    for _ in range(0, STEPS, 4):
        ahead = elem + 4 * GROUP  # fields for the next round, loaded right after each one is used
        buf, avail, next_word = _step(buf, avail, next_word, f0, elem, n, words_ptr, table_ptr, small_ptr,
                                      out_ptr, GROUP, KEPT, SYM_SHIFT, SIGN_SHIFT, TABLE_BITS, SMALL_TABLE)
        f0 = _load_field(raw_ptr, ahead, ahead < n, FIELD_BITS)
        buf, avail, next_word = _step(buf, avail, next_word, f1, elem + GROUP, n, words_ptr, table_ptr, small_ptr,
                                      out_ptr, GROUP, KEPT, SYM_SHIFT, SIGN_SHIFT, TABLE_BITS, SMALL_TABLE)
        f1 = _load_field(raw_ptr, ahead + GROUP, ahead + GROUP < n, FIELD_BITS)
        buf, avail, next_word = _step(buf, avail, next_word, f2, elem + 2 * GROUP, n, words_ptr, table_ptr,
                                      small_ptr, out_ptr, GROUP, KEPT, SYM_SHIFT, SIGN_SHIFT, TABLE_BITS,
                                      SMALL_TABLE)
        f2 = _load_field(raw_ptr, ahead + 2 * GROUP, ahead + 2 * GROUP < n, FIELD_BITS)
        buf, avail, next_word = _step(buf, avail, next_word, f3, elem + 3 * GROUP, n, words_ptr, table_ptr,
                                      small_ptr, out_ptr, GROUP, KEPT, SYM_SHIFT, SIGN_SHIFT, TABLE_BITS,
                                      SMALL_TABLE)
        f3 = _load_field(raw_ptr, ahead + 3 * GROUP, ahead + 3 * GROUP < n, FIELD_BITS)
        elem = ahead


def decode_into(words: torch.Tensor, lane_bits: torch.Tensor, group_offsets: torch.Tensor, raw: torch.Tensor,
                table: torch.Tensor, out: torch.Tensor, kept: int, groups_per_prog: int = 2,
                num_warps: int = 4, small_table: torch.Tensor | None = None, pipelined: bool = True) -> torch.Tensor:
    """Launches the decoder; ``out`` (contiguous, dtype bf16/fp16/fp32) receives the tensor's elements.

    words: int32 (the uint32 stream); lane_bits: int16 (uint16 lengths); group_offsets: int64; raw: uint8;
    table: int32[4096] from :func:`reference.decode_table`; small_table: optional int16[256] from
    :func:`small_table` (faster lookups for codes of <= 8 bits). pipelined: the v2 kernel (latency off the
    per-step chain; v1 is the plain loop). All on one device.
    """
    n = out.numel()
    assert R.STEPS % 4 == 0, "the pipelined kernel unrolls the step loop by 4"
    if n == 0:
        return out
    bits, shift, _ = R.DTYPES[out.dtype]
    n_lanes = lane_bits.numel()
    n_groups = group_offsets.numel()
    grid = (triton.cdiv(n_groups, groups_per_prog),)
    # group_offsets is read at pid * groups_per_prog, always < n_groups; lanes past n_lanes are masked.
    kernel, extra = (_decode_kernel_pipelined, (words.numel(),)) if pipelined else (_decode_kernel, ())
    kernel[grid](words, lane_bits, group_offsets, raw, table,
                         small_table if small_table is not None else table,
                         out.view(torch.int16 if bits == 16 else torch.int32), n, n_lanes, *extra,
                         STEPS=R.STEPS, GROUP=R.GROUP, GROUPS_PER_PROG=groups_per_prog,
                         FIELD_BITS=kept + 1, KEPT=kept, SYM_SHIFT=shift, SIGN_SHIFT=bits - 1,
                         TABLE_BITS=R.MAX_CODE_BITS, SMALL_TABLE=small_table is not None, num_warps=num_warps)
    return out


def small_table(table: torch.Tensor) -> torch.Tensor:
    """int16[256] first-level table indexed by the next 8 bits: the full entry for codes <= 8 bits, else 0."""
    shift = R.MAX_CODE_BITS - 8
    entry = table[:: 1 << shift]
    return torch.where((entry & 15) <= 8, entry, 0).to(torch.int16)
