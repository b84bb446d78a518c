"""The lossless encoder as Triton kernels (GPU path of LOMO re-encoding): same bits as :func:`reference.encode`.

Steps for one tensor: (1) symbols' histogram (``torch.bincount`` on the exponent bytes: 2 cheap passes) and the
canonical code on the host (256 symbols; the one device-to-host read); (2) ``_lane_bits_kernel``: every lane sums
its code lengths (one vectorized pass over the elements, lane j of a group reads elements j, j+64, ... as the
decoder does); (3) lane starts by a prefix sum of the padded lengths (torch, one value per 64·steps/64 elements,
plus one read of the total for the word count); (4) ``_pack_kernel``: every lane appends its codes MSB-first to a
64-bit buffer in registers and ORs each full 32-bit word into the zeroed stream (``atomic_or``: a lane's first and
last word are shared with its neighbours; ~0.08 atomics per weight), and writes the raw sign+mantissa field of
each element. Pair-coded tensors (reference.py: the symbol of elements 2p and 2p + 1 together, chosen by
:func:`reference.choose_pair_code` from a second histogram, of pairs) run the same kernels with PAIRS: a lane
step reads two elements and looks its pair up in 65536-entry length/code tables. Memory traffic ≈ 2 B read (×2 kernels) + 1 B raw + 0.33 B words per bf16 weight.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import reference as R
from .tensor import code_streams, pair_symbols

GROUPS_PER_PROG = 2
_INT_VIEW = {16: torch.int16, 32: torch.int32}


@triton.jit
def _element(x_ptr, elem, ok, BITS: tl.constexpr, SHIFT: tl.constexpr):
    """(raw bits as int32, 8-bit symbol) of ``elem`` (0 where not ``ok``)."""
    u = tl.load(x_ptr + elem, mask=ok, other=0).to(tl.int32)
    if BITS == 16:
        u = u & 0xFFFF
    return u, (u >> SHIFT) & 0xFF


@triton.jit
def _coded_symbol(x_ptr, sym_idx, lane_ok, n, BITS: tl.constexpr, SHIFT: tl.constexpr, PAIRS: tl.constexpr):
    """(coded symbol, in range) of symbol slot ``sym_idx``: element sym_idx's symbol, or with PAIRS the pair
    symbol of elements 2 sym_idx and 2 sym_idx + 1 (second 0 past an odd end)."""
    if PAIRS:
        e0 = 2 * sym_idx
        ok = lane_ok & (e0 < n)
        sa = _element(x_ptr, e0, ok, BITS, SHIFT)[1]
        sb = _element(x_ptr, e0 + 1, ok & (e0 + 1 < n), BITS, SHIFT)[1]
        return (sa << 8) | sb, ok
    ok = lane_ok & (sym_idx < n)
    return _element(x_ptr, sym_idx, ok, BITS, SHIFT)[1], ok


@triton.jit
def _lane_bits_kernel(x_ptr, len_ptr, out_ptr, n, n_lanes, STEPS: tl.constexpr, GROUP: tl.constexpr,
                      GROUPS_PER_PROG: tl.constexpr, BITS: tl.constexpr, SHIFT: tl.constexpr, PAIRS: tl.constexpr):
    LANES: tl.constexpr = GROUP * GROUPS_PER_PROG
    SYMS: tl.constexpr = STEPS // 2 if PAIRS else STEPS  # coded symbols per lane
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    lane_ok = lane < n_lanes
    sym_idx = (lane // GROUP) * (GROUP * SYMS) + lane % GROUP
    total = tl.zeros([LANES], dtype=tl.int32)
    for _ in range(SYMS):
        sym, ok = _coded_symbol(x_ptr, sym_idx, lane_ok, n, BITS, SHIFT, PAIRS)
        total += tl.where(ok, tl.load(len_ptr + sym), 0)
        sym_idx += GROUP
    tl.store(out_ptr + lane, total, mask=lane_ok)


@triton.jit
def _put_raw(x_ptr, raw_ptr, elem, ok, BITS: tl.constexpr, KEPT: tl.constexpr, RAW_BYTES: tl.constexpr):
    """Writes the raw field (sign above the KEPT low mantissa bits) of ``elem``."""
    u = _element(x_ptr, elem, ok, BITS, 0)[0]
    raw = (((u >> (BITS - 1)) & 1) << KEPT) | (u & ((1 << KEPT) - 1))
    if RAW_BYTES == 1:
        tl.store(raw_ptr + elem, raw.to(tl.uint8), mask=ok)
    else:
        b = raw_ptr + 3 * elem.to(tl.int64)
        tl.store(b, (raw & 0xFF).to(tl.uint8), mask=ok)
        tl.store(b + 1, ((raw >> 8) & 0xFF).to(tl.uint8), mask=ok)
        tl.store(b + 2, ((raw >> 16) & 0xFF).to(tl.uint8), mask=ok)


@triton.jit
def _pack_kernel(x_ptr, len_ptr, code_ptr, start_ptr, words_ptr, raw_ptr, n, n_lanes, STEPS: tl.constexpr,
                 GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, BITS: tl.constexpr, SHIFT: tl.constexpr,
                 KEPT: tl.constexpr, RAW_BYTES: tl.constexpr, PAIRS: tl.constexpr):
    LANES: tl.constexpr = GROUP * GROUPS_PER_PROG
    SYMS: tl.constexpr = STEPS // 2 if PAIRS else STEPS  # coded symbols per lane
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    lane_ok = lane < n_lanes
    sym_idx = (lane // GROUP) * (GROUP * SYMS) + lane % GROUP
    start = tl.load(start_ptr + lane, mask=lane_ok, other=0)  # int64: the lane's first bit
    word = start >> 5
    nb = (start & 31).to(tl.int32)  # bits already in the buffer (the word's part before the lane: zeros)
    buf = tl.zeros([LANES], dtype=tl.uint64)  # valid bits left-aligned
    for _ in range(SYMS):
        sym, ok = _coded_symbol(x_ptr, sym_idx, lane_ok, n, BITS, SHIFT, PAIRS)
        length = tl.where(ok, tl.load(len_ptr + sym), 0)
        code = tl.where(ok, tl.load(code_ptr + sym), 0).to(tl.uint64)
        # past the end (length 0) the shift would reach 64, undefined for a 64-bit shift: shift a zero by 0
        buf = buf | (code << tl.where(ok, 64 - nb - length, 0).to(tl.uint64))
        nb += length
        full = ok & (nb >= 32)
        tl.atomic_or(words_ptr + word, (buf >> 32).to(tl.uint32).to(tl.int32, bitcast=True), mask=full)
        buf = tl.where(full, buf << 32, buf)
        nb = tl.where(full, nb - 32, nb)
        word = tl.where(full, word + 1, word)
        if PAIRS:
            e0 = 2 * sym_idx
            _put_raw(x_ptr, raw_ptr, e0, lane_ok & (e0 < n), BITS, KEPT, RAW_BYTES)
            _put_raw(x_ptr, raw_ptr, e0 + 1, lane_ok & (e0 + 1 < n), BITS, KEPT, RAW_BYTES)
        else:
            _put_raw(x_ptr, raw_ptr, sym_idx, ok, BITS, KEPT, RAW_BYTES)
        sym_idx += GROUP
    tl.atomic_or(words_ptr + word, (buf >> 32).to(tl.uint32).to(tl.int32, bitcast=True), mask=lane_ok & (nb > 0))


def encode_lossless_triton(x: torch.Tensor, steps: int = R.STEPS) -> dict:
    """Streams of ``x`` (bf16 / fp16 / fp32, CUDA or the interpreter), as :func:`encode.encode_lossless`."""
    return encode_block_triton([x], steps)[0][0]


def encode_block_triton(xs, steps: int = R.STEPS) -> tuple[list, list]:
    """Streams of every tensor of a block (as :func:`encode_lossless_triton`, bit for bit) with two
    device-to-host reads for the whole block instead of three per tensor: (1) the symbol and pair histograms
    of all tensors in one copy, (2) every tensor's total padded bit count (the size of its word stream) in
    one copy. Each read waits for the encoder's own queued kernels, so fewer reads let the host run ahead.
    Returns (streams per tensor, each tensor's code as the host built it: for :meth:`BlockPack.replace`)."""
    steps = R.check_steps(steps)
    dev = xs[0].device
    flats, hists = [], []
    for x in xs:
        bits, shift, _ = R.DTYPES[x.dtype]
        flat = x.detach().contiguous().reshape(-1).view(_INT_VIEW[bits])
        sym = (flat >> shift).to(torch.uint8) if bits == 16 else ((flat >> shift) & 0xFF).to(torch.uint8)
        flats.append(flat)
        hists += [torch.bincount(sym, minlength=256), torch.bincount(pair_symbols(sym), minlength=R.PAIR_SYMBOLS)]
    # read 1 (int32 when no count can pass 2^31: half the bytes of the ~0.5 MB per tensor)
    small = max(x.numel() for x in xs) < 2 ** 31
    counts = torch.cat(hists).to(torch.int32 if small else torch.int64).cpu().numpy().astype(np.int64)
    width = 256 + R.PAIR_SYMBOLS
    codes_np, tables = [], []
    for i in range(len(xs)):
        single = counts[i * width: i * width + 256]
        lengths_np = R.code_lengths(single)
        pair_lengths = R.choose_pair_code(counts[i * width + 256: (i + 1) * width], lengths_np, single)
        lengths_np = lengths_np if pair_lengths is None else pair_lengths
        codes_np.append(lengths_np)
        tables += [lengths_np.astype(np.int32), R.canonical_codes(lengths_np).astype(np.int32)]
    # all length and code tables in one host-to-device copy; each tensor's kernels read views of it
    table_dev = torch.from_numpy(np.concatenate(tables)).to(dev)
    views, at = [], 0
    for t in tables:
        views.append(table_dev[at: at + len(t)])
        at += len(t)
    laid = [_lane_lengths(x, flat, views[2 * i], steps, len(codes_np[i]) == R.PAIR_SYMBOLS)
            for i, (x, flat) in enumerate(zip(xs, flats))]
    totals = torch.stack([padded.sum() for padded, _ in laid]).cpu().tolist()  # read 2
    out = []
    for i, (x, flat) in enumerate(zip(xs, flats)):
        padded, start = laid[i]
        out.append(_pack(x, flat, views[2 * i], views[2 * i + 1], padded, start, int(totals[i]), steps,
                         len(codes_np[i]) == R.PAIR_SYMBOLS, codes_np[i]))
    return out, codes_np


def _lane_lengths(x, flat, lengths, steps: int, pairs: bool):
    """(padded lane lengths in bits, int64; each lane's first bit) of one tensor: the lane-sum kernel."""
    n = x.numel()
    bits, shift, _ = R.DTYPES[x.dtype]
    unit = R.lane_unit(steps)
    groups = R.n_groups(n, steps)
    n_lanes = groups * R.GROUP
    lane_bits = torch.zeros(n_lanes, dtype=torch.int32, device=x.device)
    if n:
        grid = (triton.cdiv(max(groups, 1), GROUPS_PER_PROG),)
        _lane_bits_kernel[grid](flat, lengths, lane_bits, n, n_lanes, STEPS=steps, GROUP=R.GROUP,
                                GROUPS_PER_PROG=GROUPS_PER_PROG, BITS=bits, SHIFT=shift, PAIRS=pairs)
    padded = (lane_bits.to(torch.int64) + unit - 1) // unit * unit
    return padded, torch.cumsum(padded, 0) - padded


def _pack(x, flat, lengths, codes, padded, start, total: int, steps: int, pairs: bool, lengths_np) -> dict:
    """One tensor's streams once its total bit count is known: the pack kernel (words and raw fields)."""
    n = x.numel()
    bits, shift, kept = R.DTYPES[x.dtype]
    dev = x.device
    unit = R.lane_unit(steps)
    groups = R.n_groups(n, steps)
    words = torch.zeros(-(-total // 32) + R.WORD_PAD, dtype=torch.int32, device=dev)
    _, field_bits = R.field_layout(x.dtype, None)
    raw = torch.empty(n * field_bits // 8, dtype=torch.uint8, device=dev)
    if n:
        grid = (triton.cdiv(max(groups, 1), GROUPS_PER_PROG),)
        _pack_kernel[grid](flat, lengths, codes, start, words, raw, n, groups * R.GROUP, STEPS=steps,
                           GROUP=R.GROUP, GROUPS_PER_PROG=GROUPS_PER_PROG, BITS=bits, SHIFT=shift, KEPT=kept,
                           RAW_BYTES=field_bits // 8, PAIRS=pairs)
    return {"words": words, "lane_units": (padded // unit).to(torch.uint8),
            "group_offsets": start[:: R.GROUP].contiguous(), "raw": raw,
            **{k: v.to(dev) for k, v in code_streams(lengths_np).items()}}
