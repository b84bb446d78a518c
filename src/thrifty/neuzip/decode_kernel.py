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

import os

import torch
import triton
import triton.language as tl

from . import reference as R
from ..triton_utils import FastLauncher


@triton.jit
def _lane_starts(lane_bits_ptr, group_off_ptr, n_lanes, GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                 LANE_SHIFT: tl.constexpr):
    """This program's lanes: (lane index, in range, bit length, first 32-bit word, bit offset in it)."""
    LANES: tl.constexpr = GROUP * GROUPS_PER_PROG
    pid = tl.program_id(0)
    lane = pid * LANES + tl.arange(0, LANES)
    lane_ok = lane < n_lanes
    # lane lengths: uint8 units of 2^LANE_SHIFT bits
    bits = tl.load(lane_bits_ptr + lane, mask=lane_ok, other=0).to(tl.int32) << LANE_SHIFT
    base = tl.load(group_off_ptr + pid * GROUPS_PER_PROG)  # int64: first bit of this program's lanes
    start = base + (tl.cumsum(bits, axis=0) - bits).to(tl.int64)
    return lane, lane_ok, bits, (start >> 5).to(tl.int32), (start & 31).to(tl.int32)


@triton.jit
def _decode_kernel(words_ptr, lane_bits_ptr, group_off_ptr, raw_ptr, table_ptr, small_ptr, out_ptr, n, n_lanes,
                   STEPS: tl.constexpr, GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                   FIELD_BITS: tl.constexpr, KEPT: tl.constexpr, SYM_SHIFT: tl.constexpr,
                   SIGN_SHIFT: tl.constexpr, TABLE_BITS: tl.constexpr, SMALL_TABLE: tl.constexpr,
                   LANE_SHIFT: tl.constexpr):
    lane, lane_ok, _bits, word, off = _lane_starts(lane_bits_ptr, group_off_ptr, n_lanes, GROUP, GROUPS_PER_PROG,
                                                  LANE_SHIFT)
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
                             SIGN_SHIFT: tl.constexpr, TABLE_BITS: tl.constexpr, SMALL_TABLE: tl.constexpr,
                             LANE_SHIFT: tl.constexpr):
    """v2: the same decode, with every memory latency taken off the per-step chain. Raw fields are loaded
    4 steps ahead (the loop body is unrolled by 4), the next word one step ahead, and each lane's whole word
    stream (~84 B) is pulled into L1 at the start (one wait instead of a miss every few steps)."""
    LANES: tl.constexpr = GROUP * GROUPS_PER_PROG
    lane, lane_ok, bits, word, off = _lane_starts(lane_bits_ptr, group_off_ptr, n_lanes, GROUP, GROUPS_PER_PROG,
                                                  LANE_SHIFT)
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


# ------------------------------------------------------------------------------------------------ v3
@triton.jit
def _funnel(hi, lo, sh, ASM: tl.constexpr):
    """Top 32 bits of the 64-bit word pair (hi:lo) << (sh mod 32), as uint32 (hi, lo: int32 bit patterns)."""
    if ASM:  # one SHF instead of an emulated 64-bit shift
        out = tl.inline_asm_elementwise("shf.l.wrap.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, sh],
                                        dtype=tl.int32, is_pure=True, pack=1).to(tl.uint32, bitcast=True)
    else:  # plain tl (the interpreter runs no inline asm)
        pair = (hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | lo.to(tl.uint32, bitcast=True).to(tl.uint64)
        out = ((pair << (sh & 31).to(tl.uint64)) >> 32).to(tl.uint32)
    return out


@triton.jit
def _at(base_ptr, idx, SHIFT: tl.constexpr, SIZE: tl.constexpr, ASM: tl.constexpr):
    """Pointer to base_ptr[idx >> SHIFT] (idx: uint32 / non-negative int32; SIZE: bytes per element, 2 or
    4; SHIFT: 0, 20 or 24): one IMAD.WIDE.U32 with inline PTX, where plain pointer arithmetic costs a LEA pair
    (the index is zero-extended first)."""
    if ASM:
        tl.static_assert((SHIFT == 0 or SHIFT == 20 or SHIFT == 24) and (SIZE == 2 or SIZE == 4))
        if SHIFT == 0:
            code: tl.constexpr = "mad.wide.u32 $0, $1, 4, $2;" if SIZE == 4 else "mad.wide.u32 $0, $1, 2, $2;"
        elif SHIFT == 20:
            code: tl.constexpr = ("{ .reg .u32 t; shr.u32 t, $1, 20; mad.wide.u32 $0, t, 4, $2; }" if SIZE == 4
                                  else "{ .reg .u32 t; shr.u32 t, $1, 20; mad.wide.u32 $0, t, 2, $2; }")
        else:
            code: tl.constexpr = ("{ .reg .u32 t; shr.u32 t, $1, 24; mad.wide.u32 $0, t, 4, $2; }" if SIZE == 4
                                  else "{ .reg .u32 t; shr.u32 t, $1, 24; mad.wide.u32 $0, t, 2, $2; }")
        addr = tl.inline_asm_elementwise(code, "=l,r,l", [idx, tl.cast(base_ptr, tl.int64)], dtype=tl.int64,
                                         is_pure=True, pack=1)
        ptr = addr.to(base_ptr.dtype)
    else:
        ptr = base_ptr + (idx >> SHIFT)
    return ptr


@triton.jit
def _field_v3(rptr, raw_ptr, elem, valid, FIELD_BITS: tl.constexpr, MASKED: tl.constexpr):
    """The raw field (sign above the kept mantissa bits) of ``elem``; rptr = raw_ptr + elem (8-bit fields).
    ".cg": stream through L2 only, so that the lanes' words stay in L1."""
    if FIELD_BITS == 24:
        b = raw_ptr + 3 * elem.to(tl.int64)
        if MASKED:
            field = (tl.load(b, mask=valid, other=0, cache_modifier=".cg").to(tl.int32)
                     | (tl.load(b + 1, mask=valid, other=0, cache_modifier=".cg").to(tl.int32) << 8)
                     | (tl.load(b + 2, mask=valid, other=0, cache_modifier=".cg").to(tl.int32) << 16))
        else:
            field = (tl.load(b, cache_modifier=".cg").to(tl.int32)
                     | (tl.load(b + 1, cache_modifier=".cg").to(tl.int32) << 8)
                     | (tl.load(b + 2, cache_modifier=".cg").to(tl.int32) << 16))
    elif FIELD_BITS == 8:
        if MASKED:
            field = tl.load(rptr, mask=valid, other=0, cache_modifier=".cg").to(tl.int32)
        else:
            field = tl.load(rptr, cache_modifier=".cg").to(tl.int32)
    else:
        bitpos = elem * FIELD_BITS
        if MASKED:
            byte = tl.load(raw_ptr + (bitpos >> 3), mask=valid, other=0, cache_modifier=".cg").to(tl.int32)
        else:
            byte = tl.load(raw_ptr + (bitpos >> 3), cache_modifier=".cg").to(tl.int32)
        field = (byte >> (bitpos & 7)) & ((1 << FIELD_BITS) - 1)
    return field


@triton.jit
def _put_v3(optr, valid, entry, field, KEPT: tl.constexpr, SYM_SHIFT: tl.constexpr, SIGN_SHIFT: tl.constexpr,
            MASKED: tl.constexpr):
    """Stores sign | symbol | kept mantissa bits; ``entry`` = (symbol << SYM_SHIFT) | code length."""
    if SIGN_SHIFT == 15 and KEPT == 7 and SYM_SHIFT == 7:
        # lossless 16-bit: field * 0x101 puts the sign at bit 15 and keeps the mantissa in bits 0..6; every
        # other bit below 16 (the symbol's) comes from entry; the int16 store drops bits 16 and up
        x = field * 0x101
        value = ((x & 0x807F) | (entry & ~0x807F)).to(tl.int16)
    else:
        value = (entry & (0xFF << SYM_SHIFT)) | ((field >> KEPT) << SIGN_SHIFT)
        value = value | ((field & ((1 << KEPT) - 1)) << (SYM_SHIFT - KEPT))
        if SIGN_SHIFT == 15:
            value = value.to(tl.int16)
    if MASKED:
        tl.store(optr, value, mask=valid)
    else:
        tl.store(optr, value)


@triton.jit
def _lookup_v3(hi, lo, off, table_ptr, small_ptr, TSIZE: tl.constexpr, SMALL: tl.constexpr, ASM: tl.constexpr):
    """Table entry of the code at bit ``off`` of (hi:lo). SMALL: codes of <= 8 bits (~99% of weight exponents)
    from a 256-entry first level (4 cache lines at int16, so a warp's gather touches few lines), the rest
    from the full table, loaded for those lanes only."""
    peek = _funnel(hi, lo, off, ASM)
    if SMALL:
        entry = tl.load(_at(small_ptr, peek, 24, TSIZE, ASM)).to(tl.int32)
        # masked load with other=entry: no select afterwards (entry is 0 exactly where the load happens)
        entry = tl.load(_at(table_ptr, peek, 20, TSIZE, ASM), mask=entry == 0,
                        other=entry.to(table_ptr.dtype.element_ty)).to(tl.int32)
    else:
        entry = tl.load(_at(table_ptr, peek, 20, TSIZE, ASM)).to(tl.int32)
    return entry


@triton.jit
def _two_codes(hi, lo, w, off, nw, sym, n_sym, words_ptr, table_ptr, small_ptr, GROUP: tl.constexpr,
               MASKED: tl.constexpr, ASM: tl.constexpr, TSIZE: tl.constexpr, SMALL: tl.constexpr):
    """Table entries of symbols ``sym`` and ``sym + GROUP`` of each lane (of ``n_sym``). The unread bits start
    at bit ``off`` < 32 of the word pair (hi:lo), so >= 33 bits are at hand: enough for two codes of <= 12
    bits, with a single refill check (one word at most) per two codes. ``w`` = words[nw] is the next word."""
    ea = _lookup_v3(hi, lo, off, table_ptr, small_ptr, TSIZE, SMALL, ASM)
    la = ea & 15
    if MASKED:  # past the end a lane stands still, so it never reads past the stream
        la = tl.where(sym < n_sym, la, 0)
    off = off + la  # < 44
    # second code: if off >= 32 its <= 12 bits lie in lo alone (off - 32 <= 11), so funnel (lo:lo)
    eb = _lookup_v3(tl.where(off >= 32, lo, hi), lo, off, table_ptr, small_ptr, TSIZE, SMALL, ASM)
    lb = eb & 15
    if MASKED:
        lb = tl.where(sym + GROUP < n_sym, lb, 0)
    off = off + lb  # < 56: at most one word used up
    used = off >= 32
    hi = tl.where(used, lo, hi)
    lo = tl.where(used, w, lo)
    nw = nw + (off >> 5)
    off = off & 31
    w = tl.load(_at(words_ptr, nw, 0, 4, ASM), mask=used, other=w)  # needed two codes later at the earliest
    return hi, lo, w, off, nw, ea, eb


@triton.jit
def _two_symbols(hi, lo, w, off, nw, fa, fb, elem, optr, n, words_ptr, table_ptr, small_ptr,
                 GROUP: tl.constexpr, KEPT: tl.constexpr, SYM_SHIFT: tl.constexpr, SIGN_SHIFT: tl.constexpr,
                 MASKED: tl.constexpr, ASM: tl.constexpr, TSIZE: tl.constexpr, SMALL: tl.constexpr):
    """Decodes and stores elements ``elem`` and ``elem + GROUP`` of each lane (single symbols)."""
    hi, lo, w, off, nw, ea, eb = _two_codes(hi, lo, w, off, nw, elem, n, words_ptr, table_ptr, small_ptr, GROUP,
                                            MASKED, ASM, TSIZE, SMALL)
    _put_v3(optr, elem < n, ea, fa, KEPT, SYM_SHIFT, SIGN_SHIFT, MASKED)
    _put_v3(optr + GROUP, elem + GROUP < n, eb, fb, KEPT, SYM_SHIFT, SIGN_SHIFT, MASKED)
    return hi, lo, w, off, nw


@triton.jit
def _lanes_v3(hi, lo, w, off, nw, elem, n, words_ptr, raw_ptr, table_ptr, small_ptr, out_ptr,
              STEPS: tl.constexpr, GROUP: tl.constexpr, FIELD_BITS: tl.constexpr, KEPT: tl.constexpr,
              SYM_SHIFT: tl.constexpr, SIGN_SHIFT: tl.constexpr, MASKED: tl.constexpr, ASM: tl.constexpr,
              TSIZE: tl.constexpr, SMALL: tl.constexpr):
    """All STEPS symbols of each lane, 4 per iteration; the raw fields are loaded an iteration ahead. The
    raw and output pointers advance by constants, so loads and stores take immediate offsets."""
    optr = out_ptr + elem
    rptr = raw_ptr + elem
    f0 = _field_v3(rptr, raw_ptr, elem, elem < n, FIELD_BITS, MASKED)
    f1 = _field_v3(rptr + GROUP, raw_ptr, elem + GROUP, elem + GROUP < n, FIELD_BITS, MASKED)
    f2 = _field_v3(rptr + 2 * GROUP, raw_ptr, elem + 2 * GROUP, elem + 2 * GROUP < n, FIELD_BITS, MASKED)
    f3 = _field_v3(rptr + 3 * GROUP, raw_ptr, elem + 3 * GROUP, elem + 3 * GROUP < n, FIELD_BITS, MASKED)
    for _ in range(0, STEPS, 4):
        ahead = elem + 4 * GROUP  # unmasked: in bounds, as this is not the last program
        rptr += 4 * GROUP
        hi, lo, w, off, nw = _two_symbols(hi, lo, w, off, nw, f0, f1, elem, optr, n, words_ptr, table_ptr, small_ptr,
                                          GROUP, KEPT, SYM_SHIFT, SIGN_SHIFT, MASKED, ASM, TSIZE, SMALL)
        f0 = _field_v3(rptr, raw_ptr, ahead, ahead < n, FIELD_BITS, MASKED)
        f1 = _field_v3(rptr + GROUP, raw_ptr, ahead + GROUP, ahead + GROUP < n, FIELD_BITS, MASKED)
        hi, lo, w, off, nw = _two_symbols(hi, lo, w, off, nw, f2, f3, elem + 2 * GROUP, optr + 2 * GROUP, n,
                                          words_ptr, table_ptr, small_ptr, GROUP, KEPT, SYM_SHIFT, SIGN_SHIFT, MASKED, ASM, TSIZE, SMALL)
        f2 = _field_v3(rptr + 2 * GROUP, raw_ptr, ahead + 2 * GROUP, ahead + 2 * GROUP < n, FIELD_BITS, MASKED)
        f3 = _field_v3(rptr + 3 * GROUP, raw_ptr, ahead + 3 * GROUP, ahead + 3 * GROUP < n, FIELD_BITS, MASKED)
        optr += 4 * GROUP
        elem = ahead


@triton.jit
def _decode_kernel_v3(words_ptr, lane_bits_ptr, group_off_ptr, raw_ptr, table_ptr, small_ptr, out_ptr,
                      n, n_lanes, n_words, n_full_progs,
                      STEPS: tl.constexpr, GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                      FIELD_BITS: tl.constexpr, KEPT: tl.constexpr, SYM_SHIFT: tl.constexpr,
                      SIGN_SHIFT: tl.constexpr, ASM: tl.constexpr, TSIZE: tl.constexpr, SMALL: tl.constexpr,
                      LANE_SHIFT: tl.constexpr):
    """v3: 32-bit word pair + funnel shift instead of a uint64 buffer, two symbols per refill check, a
    table entry that holds the symbol at its place in the output, and no masks outside the last program.
    Same bits as v1/v2 and the reference."""
    LANES: tl.constexpr = GROUP * GROUPS_PER_PROG
    pid = tl.program_id(0)
    lane, lane_ok, bits, word, off = _lane_starts(lane_bits_ptr, group_off_ptr, n_lanes, GROUP, GROUPS_PER_PROG,
                                                  LANE_SHIFT)
    last_word = word + ((off + bits) >> 5) + 2
    # touch every 32-byte sector of the lane's stream now (one wait); `junk` is 0, the compiler cannot know
    junk = tl.zeros([LANES], dtype=tl.int32)
    for k in tl.static_range(1, (STEPS * 12 + 255) // 256 + 1):
        pw = word + 8 * k
        junk |= tl.load(words_ptr + pw, mask=lane_ok & (pw <= last_word) & (pw < n_words), other=0) & (lane < 0)
    hi = tl.load(words_ptr + word, mask=lane_ok, other=0)
    lo = tl.load(words_ptr + word + 1, mask=lane_ok, other=0)
    w = tl.load(words_ptr + word + 2, mask=lane_ok, other=0)  # WORD_PAD >= 3 keeps these in bounds
    off = off + junk
    nw = word + 2
    elem = (lane // GROUP) * (GROUP * STEPS) + lane % GROUP
    if pid < n_full_progs:
        _lanes_v3(hi, lo, w, off, nw, elem, n, words_ptr, raw_ptr, table_ptr, small_ptr, out_ptr, STEPS, GROUP,
                  FIELD_BITS, KEPT, SYM_SHIFT, SIGN_SHIFT, False, ASM, TSIZE, SMALL)
    else:
        _lanes_v3(hi, lo, w, off, nw, elem, n, words_ptr, raw_ptr, table_ptr, small_ptr, out_ptr, STEPS, GROUP,
                  FIELD_BITS, KEPT, SYM_SHIFT, SIGN_SHIFT, True, ASM, TSIZE, SMALL)


# ------------------------------------------------------------------------------------- pair symbols
# A pair table entry (int32): the first element's symbol at bits 7..14 and the second's at 23..30, i.e. where
# a bf16/fp16 pair written as one little-endian int32 has them; the code length in bits 0..3. The other bits
# (0..6, 15, 16..22, 31: the two signs and mantissas) come from the raw fields.
PAIR_SYMBOL_BITS = 0x7F807F80


@triton.jit
def _pair_value16(f16, entry, ASM: tl.constexpr):
    """Lossless 16-bit: both elements of a pair as one int32, from the pair's two raw bytes ``f16`` (first
    element's byte low; int32, bits above 15 ignored) and its table entry. PRMT spreads the bytes to
    (f_a, f_a, f_b, f_b): each copy puts the sign at the element's bit 15 and the mantissa at bits 0..6."""
    if ASM:
        y = tl.inline_asm_elementwise("prmt.b32 $0, $1, $1, 0x1100;", "=r,r", [f16], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:
        y = ((f16 & 0xFF) | ((f16 & 0xFF00) << 8)) * 0x101
    return (y & ~0x7F807F80) | (entry & 0x7F807F80)


@triton.jit
def _put_pair(out_ptr, raw_ptr, q, n, entry, FIELD_BITS: tl.constexpr, KEPT: tl.constexpr,
              SYM_SHIFT: tl.constexpr, SIGN_SHIFT: tl.constexpr, MASKED: tl.constexpr):
    """Stores elements 2q and 2q + 1 one by one (any dtype and raw layout; masked at the end of a tensor)."""
    e0 = 2 * q
    e1 = e0 + 1
    fa = _field_v3(raw_ptr + e0, raw_ptr, e0, e0 < n, FIELD_BITS, MASKED)
    fb = _field_v3(raw_ptr + e1, raw_ptr, e1, e1 < n, FIELD_BITS, MASKED)
    _put_v3(out_ptr + e0, e0 < n, ((entry >> 7) & 0xFF) << SYM_SHIFT, fa, KEPT, SYM_SHIFT, SIGN_SHIFT, MASKED)
    _put_v3(out_ptr + e1, e1 < n, ((entry >> 23) & 0xFF) << SYM_SHIFT, fb, KEPT, SYM_SHIFT, SIGN_SHIFT, MASKED)


@triton.jit
def _pair_lanes(hi, lo, w, off, nw, q, n, words_ptr, raw_ptr, table_ptr, out_ptr, PAIRS: tl.constexpr,
                GROUP: tl.constexpr, FIELD_BITS: tl.constexpr, KEPT: tl.constexpr, SYM_SHIFT: tl.constexpr,
                SIGN_SHIFT: tl.constexpr, FAST: tl.constexpr, MASKED: tl.constexpr, ASM: tl.constexpr):
    """All PAIRS pair symbols of each lane; ``q``: each lane's first pair (elements 2q, 2q + 1), then every
    GROUP pairs. FAST (lossless 16-bit, unmasked, 4-byte aligned output and 2-byte aligned raw fields): one
    16-bit raw load (an iteration ahead) and one 32-bit store per pair; else element by element."""
    n_pairs = (n + 1) // 2
    if FAST:
        o32 = out_ptr.to(tl.pointer_type(tl.int32)) + q
        r16 = raw_ptr.to(tl.pointer_type(tl.int16)) + q
        f0 = tl.load(r16, cache_modifier=".cg").to(tl.int32)
        f1 = tl.load(r16 + GROUP, cache_modifier=".cg").to(tl.int32)
        f2 = tl.load(r16 + 2 * GROUP, cache_modifier=".cg").to(tl.int32)
        f3 = tl.load(r16 + 3 * GROUP, cache_modifier=".cg").to(tl.int32)
        for _ in range(0, PAIRS, 4):
            r16 += 4 * GROUP  # the last iteration reads the next program's fields: in bounds, unused
            hi, lo, w, off, nw, ea, eb = _two_codes(hi, lo, w, off, nw, q, n_pairs, words_ptr, table_ptr, table_ptr,
                                                    GROUP, False, ASM, 4, False)
            tl.store(o32, _pair_value16(f0, ea, ASM))
            tl.store(o32 + GROUP, _pair_value16(f1, eb, ASM))
            f0 = tl.load(r16, cache_modifier=".cg").to(tl.int32)
            f1 = tl.load(r16 + GROUP, cache_modifier=".cg").to(tl.int32)
            hi, lo, w, off, nw, ea, eb = _two_codes(hi, lo, w, off, nw, q, n_pairs, words_ptr, table_ptr, table_ptr,
                                                    GROUP, False, ASM, 4, False)
            tl.store(o32 + 2 * GROUP, _pair_value16(f2, ea, ASM))
            tl.store(o32 + 3 * GROUP, _pair_value16(f3, eb, ASM))
            f2 = tl.load(r16 + 2 * GROUP, cache_modifier=".cg").to(tl.int32)
            f3 = tl.load(r16 + 3 * GROUP, cache_modifier=".cg").to(tl.int32)
            o32 += 4 * GROUP
    else:
        for _ in range(0, PAIRS, 2):
            hi, lo, w, off, nw, ea, eb = _two_codes(hi, lo, w, off, nw, q, n_pairs, words_ptr, table_ptr, table_ptr,
                                                    GROUP, MASKED, ASM, 4, False)
            _put_pair(out_ptr, raw_ptr, q, n, ea, FIELD_BITS, KEPT, SYM_SHIFT, SIGN_SHIFT, MASKED)
            _put_pair(out_ptr, raw_ptr, q + GROUP, n, eb, FIELD_BITS, KEPT, SYM_SHIFT, SIGN_SHIFT, MASKED)
            q += 2 * GROUP


def pair_kernel_table(table: torch.Tensor) -> torch.Tensor:
    """The pair kernel's int32 table from the reference one ((pair << 4) | length; see PAIR_SYMBOL_BITS)."""
    pair = table.to(torch.int64) >> 4
    return (((pair & 0xFF) << 23) | ((pair >> 8) << 7) | (table & 15)).to(torch.int32)


# Triton's launch path (argument binding, specialization lookup) costs ~30 µs per call, as long as decoding a
# 10M-weight tensor; the cached launcher skips it on repeated calls (layer-by-layer decompression).
_V3_LAUNCH = FastLauncher(_decode_kernel_v3)


def kernel_table(table: torch.Tensor, dtype: torch.dtype, table16: bool = False, small: bool = False) -> torch.Tensor:
    """The v3 table from the reference one ((symbol << 4) | length): (symbol << SYM_SHIFT) | length, so the
    symbol sits at its place in the output element. table16: int16 entries (16-bit dtypes only; 8 KB).
    small: the 256-entry first level indexed by the next 8 bits (0 where the code is longer)."""
    shift = R.DTYPES[dtype][1]
    t = ((table >> 4) << shift) | (table & 15)
    if small:
        t = t[:: 1 << (R.MAX_CODE_BITS - 8)]
        t = torch.where((t & 15) <= 8, t, 0)
    if table16:
        if R.DTYPES[dtype][0] != 16:
            raise ValueError(f"table16: int16 entries need a 16-bit dtype, got {dtype}")
        return t.to(torch.int16)
    return t.to(torch.int32)


KERNELS = ("v3", "v2", "v1")


def decode_into(words: torch.Tensor, lane_bits: torch.Tensor, group_offsets: torch.Tensor, raw: torch.Tensor,
                table: torch.Tensor, out: torch.Tensor, kept: int, steps: int = R.STEPS,
                kernel: str = "v3", groups_per_prog: int | None = None, num_warps: int = 4,
                small_table: torch.Tensor | None = None, v3_table: torch.Tensor | None = None,
                v3_small: torch.Tensor | None = None, asm: bool | None = None,
                pipelined: bool | None = None) -> torch.Tensor:
    """Launches the decoder; ``out`` (contiguous, dtype bf16/fp16/fp32) receives the tensor's elements.

    words: int32 (the uint32 stream); lane_bits: each lane's length, uint8 units of ``steps // 16`` bits (the
    ``lane_units`` stream); group_offsets: int64; raw: uint8;
    table: int32[4096] from :func:`reference.decode_table`; steps: symbols per lane (the tensor's layout).
    kernel: "v3" (default), "v2" (pipelined uint64 buffer) or "v1" (plain loop); ``pipelined`` (old flag):
    True = v2, False = v1. v1/v2: small_table, an optional int16[256] from :func:`small_table`. v3:
    v3_table from :func:`kernel_table` (made here when None: int16 entries for 16-bit dtypes) and optionally v3_small, its first level
    (``kernel_table(..., small=True)``, same entry dtype); asm: funnel shifts by inline PTX (default:
    on CUDA, off under the interpreter). All on one device.
    """
    if pipelined is not None:
        kernel = "v2" if pipelined else "v1"
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    if groups_per_prog is None:  # the fastest on the H100 (v3) and the H200 (v2), NOTES.md
        groups_per_prog = 4 if kernel == "v3" else 2
    steps = R.check_steps(steps)
    n = out.numel()
    if n == 0:
        return out
    bits, shift, _ = R.DTYPES[out.dtype]
    if lane_bits.dtype != torch.uint8:
        raise TypeError(f"lane_bits: expected uint8 (lengths in units of steps // 16 bits), got {lane_bits.dtype}")
    lane_shift = R.lane_unit(steps).bit_length() - 1
    n_lanes = lane_bits.numel()
    n_groups = group_offsets.numel()
    if n_groups != R.n_groups(n, steps) or n_lanes != n_groups * R.GROUP:
        raise ValueError(f"lane_bits/group_offsets: {n_lanes} lanes in {n_groups} groups do not fit {n} "
                         f"elements in lanes of {steps}")
    grid = (triton.cdiv(n_groups, groups_per_prog),)
    out_bits = out.view(torch.int16 if bits == 16 else torch.int32)
    # group_offsets is read at pid * groups_per_prog, always < n_groups; lanes past n_lanes are masked.
    if kernel == "v3":
        if v3_table is None:
            v3_table = kernel_table(table, out.dtype, table16=bits == 16)
        if asm is None:
            asm = words.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
        # programs whose elements all lie below n, the last one excluded (its look-ahead loads would not)
        n_full = min(n // (groups_per_prog * R.GROUP * steps), grid[0] - 1)
        if v3_small is not None and v3_small.dtype != v3_table.dtype:
            raise ValueError(f"v3_small: entries must have v3_table's dtype {v3_table.dtype}, got {v3_small.dtype}")
        _V3_LAUNCH(grid, words, lane_bits, group_offsets, raw, v3_table,
                   v3_small if v3_small is not None else v3_table, out_bits, n, n_lanes,
                   words.numel(), n_full, STEPS=steps, GROUP=R.GROUP, GROUPS_PER_PROG=groups_per_prog,
                   FIELD_BITS=kept + 1, KEPT=kept, SYM_SHIFT=shift, SIGN_SHIFT=bits - 1, ASM=asm,
                   TSIZE=v3_table.element_size(), SMALL=v3_small is not None,
                   LANE_SHIFT=lane_shift, num_warps=num_warps, num_stages=3)
        return out
    kern, extra = (_decode_kernel_pipelined, (words.numel(),)) if kernel == "v2" else (_decode_kernel, ())
    kern[grid](words, lane_bits, group_offsets, raw, table,
               small_table if small_table is not None else table,
               out_bits, n, n_lanes, *extra,
               STEPS=steps, GROUP=R.GROUP, GROUPS_PER_PROG=groups_per_prog,
               FIELD_BITS=kept + 1, KEPT=kept, SYM_SHIFT=shift, SIGN_SHIFT=bits - 1,
               TABLE_BITS=R.MAX_CODE_BITS, SMALL_TABLE=small_table is not None, LANE_SHIFT=lane_shift,
               num_warps=num_warps)
    return out


def small_table(table: torch.Tensor) -> torch.Tensor:
    """int16[256] first-level table indexed by the next 8 bits: the full entry for codes <= 8 bits, else 0."""
    shift = R.MAX_CODE_BITS - 8
    entry = table[:: 1 << shift]
    return torch.where((entry & 15) <= 8, entry, 0).to(torch.int16)
