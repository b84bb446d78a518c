"""The lossless encoder as Triton kernels (GPU path of LOMO re-encoding): same bits as :func:`reference.encode`.

A whole block (every tensor of a :class:`BlockPack`, one dtype) is encoded by four Triton launches over all its
tensors at once (each program finds its tensor in a small per-tensor table, ``_tensor_of``) and ~25 small torch
ops, with **two device-to-host reads** and no other synchronization (no ``torch.bincount``: it reads the input's
min and max on the host, two syncs per call, and its 65536-bin pair histogram ran on contended global atomics):

1. ``_sym_hist_kernel``: 256-bin histogram of the element symbols per program (``tl.histogram``), added to the
   tensor's row (one atomic per present bin per program).
2. Ranks (torch, on the device): each tensor's ``WINDOW`` most frequent symbols get ranks 0..WINDOW-1.
3. ``_pair_hist_kernel``: pairs whose two symbols are both ranked count in a WINDOW² histogram per program
   (``tl.histogram``) then one atomic per present bin into the tensor's 65536-bin row; the rare others (a symbol
   outside the window) add one atomic each. Exact counts whatever the data (the window only decides the speed).
4. **Read 1**: both histograms of every tensor (one copy, pinned). The host builds each code (as before:
   ``code_lengths`` / ``choose_pair_code`` / ``canonical_codes``) and uploads one packed table (``(code << 4) |
   length`` per present symbol) and the stored code streams in one non-blocking copy; a scatter fills the
   per-tensor 65536-entry lookup table on the device.
5. ``_lane_bits_kernel``: each lane sums its code lengths (lane j of a group reads elements j, j + 64, ... or
   pairs, as the decoder). Padded lane lengths and their prefix sum over the whole block (torch); **read 2**:
   each tensor's total bit count (the size of its word stream).
6. ``_pack_kernel``: every lane appends its codes MSB-first to a 64-bit register buffer and ORs each full 32-bit
   word into the zeroed stream (relaxed ``atomic_or``: a lane's first and last word are shared with its
   neighbours), and writes the raw sign+mantissa field of each element (the element is loaded once).

Code reuse (:func:`reencode_block_triton`, LOMO's default): with the block's previous :class:`BlockCode`, only
5 and 6 run (the lane kernel also counts symbols the old code has no code for) with **one** read (the sizes and
those counts); an uncovered symbol falls back to a fresh encode. The codes built for reuse are single-symbol codes
covering every exponent up to ``HEADROOM`` octaves above the block's largest, so AdamW's new small exponents do
not force a rebuild. NOTES.md "Re-encode" has the design.

Traffic ≈ 4 reads of the 2 B bf16 weight (2 histograms, lane sums, pack) + 1 B raw + 0.33 B words ≈ 9.3 B per
weight: ~0.41 GB for a 44M-weight block, ~0.15 ms at HBM speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import numpy as np
import torch
import triton
import triton.language as tl

from . import reference as R
from .tensor import code_streams

GROUPS_PER_PROG = 2  # groups of 64 lanes per program of the lane kernels (128 lanes, 4 warps: a lane per thread)
HIST_BLOCK = 4096  # elements (symbol histogram) or pairs (pair histogram) per histogram program
WINDOW = 32  # symbols per tensor counted in the registers' pair histogram (32² bins)
META_W = 9  # int64 fields per tensor row of the block table (``_block_meta``)
HIST_W = 256 + R.PAIR_SYMBOLS  # one tensor's histogram row: 256 symbol bins, then 65536 pair bins
_INT_VIEW = {16: torch.int16, 32: torch.int32}
_META_CACHE: dict = {}  # (device, dtype, offsets, numels, steps) -> the device block table


@triton.jit
def _tensor_of(meta_ptr, pid, col: tl.constexpr, T, TP: tl.constexpr, META_W: tl.constexpr):
    """(tensor index, program index within it) of program ``pid``: column ``col`` holds each tensor's first
    program (ascending)."""
    t_idx = tl.arange(0, TP)
    first = tl.load(meta_ptr + t_idx * META_W + col, mask=t_idx < T, other=1 << 62)
    t = tl.sum((pid >= first).to(tl.int32), axis=0) - 1
    return t, pid - tl.load(meta_ptr + t * META_W + col)


@triton.jit
def _symbols_at(x_ptr, elem, ok, BITS: tl.constexpr, SHIFT: tl.constexpr):
    """(raw bits as int32, 8-bit symbol) of ``elem`` (0 where not ``ok``)."""
    u = tl.load(x_ptr + elem, mask=ok, other=0).to(tl.int32)
    if BITS == 16:
        u = u & 0xFFFF
    return u, (u >> SHIFT) & 0xFF


@triton.jit
def _sym_hist_kernel(x_ptr, meta_ptr, hist_ptr, T, TP: tl.constexpr, META_W: tl.constexpr, HIST_W: tl.constexpr,
                     BLOCK: tl.constexpr, BITS: tl.constexpr, SHIFT: tl.constexpr):
    t, local = _tensor_of(meta_ptr, tl.program_id(0), 2, T, TP, META_W)
    base = tl.load(meta_ptr + t * META_W)
    n = tl.load(meta_ptr + t * META_W + 1)
    e = local * BLOCK + tl.arange(0, BLOCK)
    ok = e < n
    sym = _symbols_at(x_ptr + base, e, ok, BITS, SHIFT)[1]
    h = tl.histogram(sym, 256, mask=ok)
    tl.atomic_add(hist_ptr + t * HIST_W + tl.arange(0, 256), h, mask=h > 0, sem="relaxed")


@triton.jit
def _pair_hist_kernel(x_ptr, meta_ptr, rank_ptr, symof_ptr, hist_ptr, T, TP: tl.constexpr, META_W: tl.constexpr,
                      HIST_W: tl.constexpr, WINDOW: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                      SHIFT: tl.constexpr):
    t, local = _tensor_of(meta_ptr, tl.program_id(0), 3, T, TP, META_W)
    base = tl.load(meta_ptr + t * META_W)
    n = tl.load(meta_ptr + t * META_W + 1)
    e0 = 2 * (local * BLOCK + tl.arange(0, BLOCK))
    ok = e0 < n
    sa = _symbols_at(x_ptr + base, e0, ok, BITS, SHIFT)[1]
    sb = _symbols_at(x_ptr + base, e0 + 1, ok & (e0 + 1 < n), BITS, SHIFT)[1]  # 0 past an odd end
    ra = tl.load(rank_ptr + t * 256 + sa)
    rb = tl.load(rank_ptr + t * 256 + sb)
    win = ok & (ra < WINDOW) & (rb < WINDOW)
    h = tl.histogram(tl.where(win, ra * WINDOW + rb, 0), WINDOW * WINDOW, mask=win)
    row = hist_ptr + t * HIST_W + 256
    b = tl.arange(0, WINDOW * WINDOW)
    pair = (tl.load(symof_ptr + t * WINDOW + b // WINDOW) << 8) | tl.load(symof_ptr + t * WINDOW + b % WINDOW)
    tl.atomic_add(row + pair, h, mask=h > 0, sem="relaxed")
    tl.atomic_add(row + ((sa << 8) | sb), tl.full([BLOCK], 1, tl.int32), mask=ok & ~win, sem="relaxed")


@triton.jit
def _lane_bits_kernel(x_ptr, meta_ptr, pairs_ptr, tab_ptr, padded_ptr, units_ptr, sizes_ptr, T, TP: tl.constexpr,
                      META_W: tl.constexpr, STEPS: tl.constexpr, GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                      BITS: tl.constexpr, SHIFT: tl.constexpr, CHECK: tl.constexpr, UNIT: tl.constexpr,
                      TAB_W: tl.constexpr):
    """Each lane's code bits padded to the lane unit (int32, for the prefix sum) and in units (uint8: the
    stream's ``lane_units``), at the lane's block-wide index; each tensor's stream bits added to
    ``sizes_ptr[t]`` (one atomic per program: the stream sizes without a pass over the prefix sum). CHECK (a
    reused code): also adds to ``sizes_ptr[T + t]`` the number of the tensor's symbols (or pairs) that have no
    code in the table (length 0), so the coverage of an old code is read with the stream sizes."""
    LANES: tl.constexpr = GROUP * GROUPS_PER_PROG
    t, local = _tensor_of(meta_ptr, tl.program_id(0), 4, T, TP, META_W)
    x = x_ptr + tl.load(meta_ptr + t * META_W)
    n = tl.load(meta_ptr + t * META_W + 1)
    n_lanes = tl.load(meta_ptr + t * META_W + 6) * GROUP
    tab = tab_ptr + t.to(tl.int64) * TAB_W
    lane = local * LANES + tl.arange(0, LANES)
    lane_ok = lane < n_lanes
    total = tl.zeros([LANES], dtype=tl.int32)
    missing = tl.zeros([LANES], dtype=tl.int32)
    if tl.load(pairs_ptr + t) != 0:
        p = (lane // GROUP) * (GROUP * (STEPS // 2)) + lane % GROUP
        for _ in range(STEPS // 2):
            e0 = 2 * p
            ok = lane_ok & (e0 < n)
            sa = _symbols_at(x, e0, ok, BITS, SHIFT)[1]
            sb = _symbols_at(x, e0 + 1, ok & (e0 + 1 < n), BITS, SHIFT)[1]
            length = tl.load(tab + ((sa << 8) | sb), mask=ok, other=0) & 15
            total += length
            if CHECK:
                missing += (ok & (length == 0)).to(tl.int32)
            p += GROUP
    else:
        e = (lane // GROUP) * (GROUP * STEPS) + lane % GROUP
        for _ in range(STEPS):
            ok = lane_ok & (e < n)
            s = _symbols_at(x, e, ok, BITS, SHIFT)[1]
            length = tl.load(tab + s, mask=ok, other=0) & 15
            total += length
            if CHECK:
                missing += (ok & (length == 0)).to(tl.int32)
            e += GROUP
    padded = tl.where(lane_ok, (total + (UNIT - 1)) // UNIT * UNIT, 0)
    at = tl.load(meta_ptr + t * META_W + 5) + lane
    tl.store(padded_ptr + at, padded, mask=lane_ok)
    tl.store(units_ptr + at, (padded // UNIT).to(tl.uint8), mask=lane_ok)
    tl.atomic_add(sizes_ptr + t, tl.sum(padded.to(tl.int64), axis=0), sem="relaxed")
    if CHECK:
        n_missing = tl.sum(missing, axis=0).to(tl.int64)
        tl.atomic_add(sizes_ptr + T + t, n_missing, mask=n_missing > 0, sem="relaxed")


@triton.jit
def _put_raw(raw_ptr, u, elem, ok, BITS: tl.constexpr, KEPT: tl.constexpr, RAW_BYTES: tl.constexpr):
    """Writes the raw field (sign above the KEPT low mantissa bits) of raw bits ``u`` at ``elem``."""
    raw = (((u >> (BITS - 1)) & 1) << KEPT) | (u & ((1 << KEPT) - 1))
    if RAW_BYTES == 1:
        tl.store(raw_ptr + elem, raw.to(tl.uint8), mask=ok)
    else:
        b = raw_ptr + 3 * elem.to(tl.int64)
        tl.store(b, (raw & 0xFF).to(tl.uint8), mask=ok)
        tl.store(b + 1, ((raw >> 8) & 0xFF).to(tl.uint8), mask=ok)
        tl.store(b + 2, ((raw >> 16) & 0xFF).to(tl.uint8), mask=ok)


@triton.jit
def _append(words, buf, nb, word, entry, ok):
    """Appends the code of table ``entry`` ((code << 4) | length) to a lane's left-aligned 64-bit buffer; ORs
    the buffer's top word into the stream once it is full. Returns (buf, nb, word)."""
    length = tl.where(ok, entry & 15, 0)
    code = tl.where(ok, entry >> 4, 0).to(tl.uint64)
    # past the end (length 0) the shift would reach 64, undefined for a 64-bit shift: shift a zero by 0
    buf = buf | (code << tl.where(ok, 64 - nb - length, 0).to(tl.uint64))
    nb += length
    full = ok & (nb >= 32)
    tl.atomic_or(words + word, (buf >> 32).to(tl.uint32).to(tl.int32, bitcast=True), mask=full, sem="relaxed")
    buf = tl.where(full, buf << 32, buf)
    nb = tl.where(full, nb - 32, nb)
    word = tl.where(full, word + 1, word)
    return buf, nb, word


@triton.jit
def _pack_kernel(x_ptr, meta_ptr, pairs_ptr, tab_ptr, ends_ptr, padded_ptr, wbase_ptr, words_ptr, raw_ptr, goff_ptr,
                 T, TP: tl.constexpr, META_W: tl.constexpr, STEPS: tl.constexpr, GROUP: tl.constexpr,
                 GROUPS_PER_PROG: tl.constexpr, BITS: tl.constexpr, SHIFT: tl.constexpr, KEPT: tl.constexpr,
                 RAW_BYTES: tl.constexpr, TAB_W: tl.constexpr):
    """Words and raw fields of every lane (module docstring, 6), and each group's first bit relative to its
    tensor's stream (``group_offsets``, int64 at the group's block-wide index)."""
    LANES: tl.constexpr = GROUP * GROUPS_PER_PROG
    t, local = _tensor_of(meta_ptr, tl.program_id(0), 4, T, TP, META_W)
    x = x_ptr + tl.load(meta_ptr + t * META_W)
    n = tl.load(meta_ptr + t * META_W + 1)
    n_lanes = tl.load(meta_ptr + t * META_W + 6) * GROUP
    lane0 = tl.load(meta_ptr + t * META_W + 5)  # the tensor's first lane, block-wide
    raw = raw_ptr + tl.load(meta_ptr + t * META_W + 7)
    words = words_ptr + tl.load(wbase_ptr + t)
    tab = tab_ptr + t.to(tl.int64) * TAB_W
    lane = local * LANES + tl.arange(0, LANES)
    lane_ok = lane < n_lanes
    # the lane's first bit within its tensor: the block-wide inclusive prefix sum minus the lane's own bits, minus
    # the tensor's first lane's start
    first = tl.load(ends_ptr + lane0, mask=n_lanes > 0, other=0) - tl.load(padded_ptr + lane0, mask=n_lanes > 0,
                                                                            other=0)
    start = (tl.load(ends_ptr + lane0 + lane, mask=lane_ok, other=0)
             - tl.load(padded_ptr + lane0 + lane, mask=lane_ok, other=0).to(tl.int64) - first)
    goff = goff_ptr + tl.load(meta_ptr + t * META_W + 8)  # the tensor's first group offset (16-byte aligned)
    tl.store(goff + lane // GROUP, start, mask=lane_ok & (lane % GROUP == 0))
    word = start >> 5
    nb = (start & 31).to(tl.int32)  # bits already in the buffer (the word's part before the lane: zeros)
    buf = tl.zeros([LANES], dtype=tl.uint64)  # valid bits left-aligned
    if tl.load(pairs_ptr + t) != 0:
        p = (lane // GROUP) * (GROUP * (STEPS // 2)) + lane % GROUP
        for _ in range(STEPS // 2):
            e0 = 2 * p
            ok = lane_ok & (e0 < n)
            ok_b = ok & (e0 + 1 < n)
            ua, sa = _symbols_at(x, e0, ok, BITS, SHIFT)
            ub, sb = _symbols_at(x, e0 + 1, ok_b, BITS, SHIFT)
            entry = tl.load(tab + ((sa << 8) | sb), mask=ok, other=0)
            buf, nb, word = _append(words, buf, nb, word, entry, ok)
            _put_raw(raw, ua, e0, ok, BITS, KEPT, RAW_BYTES)
            _put_raw(raw, ub, e0 + 1, ok_b, BITS, KEPT, RAW_BYTES)
            p += GROUP
    else:
        e = (lane // GROUP) * (GROUP * STEPS) + lane % GROUP
        for _ in range(STEPS):
            ok = lane_ok & (e < n)
            u, s = _symbols_at(x, e, ok, BITS, SHIFT)
            entry = tl.load(tab + s, mask=ok, other=0)
            buf, nb, word = _append(words, buf, nb, word, entry, ok)
            _put_raw(raw, u, e, ok, BITS, KEPT, RAW_BYTES)
            e += GROUP
    tl.atomic_or(words + word, (buf >> 32).to(tl.uint32).to(tl.int32, bitcast=True), mask=lane_ok & (nb > 0),
                 sem="relaxed")


# ------------------------------------------------------------------------------------------------ host side
class EncodeProfile:
    """Per-stage times of :func:`encode_block_triton` (benchmarks; ``profile=None`` there records nothing).

    ``stage(name)``: a span of host code, timed with ``time.perf_counter`` (host ms) and, on CUDA, with two
    events on the current stream (GPU ms: from the stream reaching the stage's first queued work to the end of
    its last; for a stage that queues nothing this is the GPU's idle gap while the host runs it). ``add_host``:
    host time only, summed over calls (the per-tensor code building). A stage entered twice adds up.
    ``rows()`` waits for the device (once, after the encode) and returns ``[(name, host_ms, gpu_ms or None)]``
    in first-seen order."""

    def __init__(self, device=None):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self._host: dict = {}
        self._events: dict = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        e0 = e1 = None
        if self.cuda:
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._host[name] = self._host.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
            if self.cuda:
                e1 = torch.cuda.Event(enable_timing=True)
                e1.record()
                self._events.setdefault(name, []).append((e0, e1))
            else:
                self._events.setdefault(name, [])

    def add_host(self, name: str, ms: float) -> None:
        self._host[name] = self._host.get(name, 0.0) + ms

    def rows(self) -> list:
        if self.cuda:
            torch.cuda.synchronize()
        out = []
        for name, host_ms in self._host.items():
            ev = self._events.get(name)
            gpu = sum(a.elapsed_time(b) for a, b in ev) if ev else None
            out.append((name, host_ms, gpu))
        return out


def _stage(profile, name: str):
    return _NULL_STAGE if profile is None else profile.stage(name)


_NULL_STAGE = contextlib.nullcontext()


def _to_host(t: torch.Tensor) -> np.ndarray:
    """A device-to-host read (the encoder's only synchronizations: two per block). CUDA: into pinned memory,
    then one wait for this stream (which holds only the encoder's own queued work on LOMO's side stream)."""
    if t.device.type != "cuda":
        return t.numpy()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host.numpy()


def _to_device(a: np.ndarray, device) -> torch.Tensor:
    """A host-to-device copy that does not wait (pinned source, non-blocking; the caching host allocator keeps
    the pinned block until the copy is done)."""
    t = torch.from_numpy(a)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _flat_source(xs) -> tuple[torch.Tensor, list]:
    """(one int view covering every tensor, each tensor's element offset in it): the tensors' common storage
    when they are contiguous views of one buffer (LOMO's block buffer: no copy), else a concatenation."""
    bits = R.DTYPES[xs[0].dtype][0]
    storage = xs[0].untyped_storage()
    if all(x.is_contiguous() and x.untyped_storage().data_ptr() == storage.data_ptr() for x in xs):
        elem = xs[0].element_size()
        whole = torch.empty(0, dtype=xs[0].dtype, device=xs[0].device).set_(storage, 0, (storage.nbytes() // elem,))
        return whole.view(_INT_VIEW[bits]), [x.storage_offset() for x in xs]
    flat = torch.cat([x.detach().reshape(-1) for x in xs]).view(_INT_VIEW[bits])
    return flat, np.concatenate([[0], np.cumsum([x.numel() for x in xs])[:-1]]).tolist()


def _block_meta(device, dtype, offsets, numels, steps):
    """Per tensor int64[META_W] (cached per block layout: uploaded once): element offset, n, first program of
    the symbol histogram, of the pair histogram and of the lane kernels, first lane (block-wide), groups, raw
    byte offset, first group offset. Also the host's (programs per kernel, lane bases, lanes, raw offsets and
    sizes, group offset bases). The raw fields and group offsets of each tensor start 16-byte aligned, as
    :class:`BlockPack` lays its streams out, so the pack adopts the encoder's buffers without a copy."""
    key = (str(device), dtype, tuple(offsets), tuple(numels), steps)
    if key not in _META_CACHE:
        if len(_META_CACHE) > 256:  # a model has ~2 layouts per block (two buffers); tests make many
            _META_CACHE.clear()
        n = np.array(numels, np.int64)
        groups = -(-n // (R.GROUP * steps))
        progs = [np.maximum(-(-n // HIST_BLOCK), 1), np.maximum(-(-(-(-n // 2)) // HIST_BLOCK), 1),
                 np.maximum(-(-groups // GROUPS_PER_PROG), 1)]
        first = [np.cumsum(p) - p for p in progs]
        lanes = groups * R.GROUP
        raw_bytes = n * (R.field_layout(dtype, None)[1] // 8)
        raw_off, raw_total = _aligned_bases(raw_bytes, R.ALIGN_BYTES)
        goff_base, goff_total = _aligned_bases(groups, R.ALIGN_BYTES // 8)
        meta = np.stack([np.array(offsets, np.int64), n, *first, np.cumsum(lanes) - lanes, groups, raw_off,
                         goff_base], 1)
        lane0 = np.cumsum(lanes) - lanes
        host = dict(programs=[int(p.sum()) for p in progs], lane0=lane0.tolist(), lanes_total=int(lanes.sum()),
                    lanes=lanes.tolist(), raw_off=raw_off.tolist(), raw_bytes=raw_bytes.tolist(),
                    raw_total=raw_total, goff_base=goff_base.tolist(), groups=groups.tolist(), goff_total=goff_total)
        _META_CACHE[key] = (torch.from_numpy(np.ascontiguousarray(meta, np.int64)).to(device), host)
    return _META_CACHE[key]


def _aligned_bases(sizes: np.ndarray, align: int) -> tuple[np.ndarray, int]:
    """(each part's start, the total) when parts of these sizes follow each other, each padded to ``align``
    elements (:meth:`BlockPack._set_streams`' layout)."""
    padded = -(-np.asarray(sizes, np.int64) // align) * align
    return np.cumsum(padded) - padded, int(padded.sum())


def encode_lossless_triton(x: torch.Tensor, steps: int = R.STEPS) -> dict:
    """Streams of ``x`` (bf16 / fp16 / fp32, CUDA or the interpreter), as :func:`encode.encode_lossless`."""
    return encode_block_triton([x], steps)[0][0]


@dataclasses.dataclass(frozen=True)
class BlockCode:
    """A block's code as the encoder built it, kept so the next re-encode can reuse it (LOMO: a step barely moves
    the exponent histogram, and rebuilding the Huffman codes on the host was ~90% of a re-encode).

    layout: (device, dtype, numels, steps) of the block it codes. table: the int32 lookup table on the device,
    ``width`` entries ((code << 4) | length, 0 = no code) per tensor (256 for the single-symbol codes built for
    reuse: 1 KB per tensor, kept). pairs: int32[T] per-tensor pair flags on the device. stored: each tensor's stored code streams (device). lengths: each tensor's code lengths (host; what
    :meth:`BlockPack.replace` takes). fresh_bits: the block's coded bits when this code was built. stale: rebuild
    at the next encode (the coded bits grew past ``REBUILD_GROWTH`` under this code)."""

    layout: tuple
    table: torch.Tensor
    width: int
    pairs: torch.Tensor
    stored: list
    lengths: list
    fresh_bits: int
    stale: bool = False


# a reused code is rebuilt at the next encode once the block's coded bits exceed those of its fresh build by this
# fraction (the code drifted away from the weights; ~1% of the coded part is ~0.3% of the stream). Not tuned: the
# read of the stream sizes gives the check for free, and a LOMO step moves the bits by far less.
REBUILD_GROWTH = 0.01
# A code built for reuse is a single-symbol code over every symbol from 0 (zero and the smallest exponents) up to
# HEADROOM above the largest that occurs. Why: AdamW moves a weight by ~lr whatever its size, so weights near
# zero land on exponents no earlier step had (Table 1, H200, 6ba285a: with +-1 spares and pair codes nearly every
# block fell back, 62 reads per step for 22 blocks), while the top of the range grows by at most an octave per
# doubling. Cost against the fresh (often pair) code, bf16 N(0, 0.02) / N(0, 0.006), 2M weights: +0.036 /
# +0.050 bits per weight (~0.4% of a ~10.6-bit stream); covering all 256 symbols would cost +0.076 / +0.10.
HEADROOM = 2


def _layout(xs, steps: int) -> tuple:
    return (str(xs[0].device), xs[0].dtype, tuple(x.numel() for x in xs), steps)


def encode_block_triton(xs, steps: int = R.STEPS, profile: "EncodeProfile | None" = None) -> tuple[list, list]:
    """Streams of every tensor of a block (one dtype; as :func:`encode_lossless_triton`, bit for bit): four
    Triton launches for the whole block and two device-to-host reads (the histograms; the stream sizes), no
    other synchronization (module docstring). Returns (streams per tensor, each tensor's code as the host built
    it: for :meth:`BlockPack.replace`). profile: an :class:`EncodeProfile` to record each stage's host and GPU
    time in (benchmarks); None records nothing."""
    streams, lengths, _ = _encode_fresh(xs, R.check_steps(steps), profile)
    return streams, lengths


def reencode_block_triton(xs, previous: "BlockCode | None", steps: int = R.STEPS,
                          profile: "EncodeProfile | None" = None) -> tuple[list, list, BlockCode, bool]:
    """The block encoded with ``previous`` (the code of its last encode) when that code still has a code for
    every symbol (or pair) that occurs, else with a fresh code (:func:`encode_block_triton`'s bytes).

    Reuse: one lane-bits launch that also counts uncovered symbols on the device, the prefix sum, **one**
    device-to-host read (stream sizes and those counts together), the pack launch; no histograms, no host code
    build, no table upload. Uncovered (a new exponent appeared): the fresh encode after it (3 reads in all).
    A reused stream decodes to the same bits (lossless) but its bytes are not the fresh code's.

    Returns (streams, code lengths per tensor, the code to pass next time, whether ``previous`` was reused)."""
    steps = R.check_steps(steps)
    if previous is not None and not isinstance(previous, BlockCode):
        raise TypeError(f"previous: expected a BlockCode or None, got {type(previous).__name__}")
    if previous is not None and previous.layout != _layout(xs, steps):
        raise ValueError(f"previous: a code of block layout {previous.layout}, not of these tensors' "
                         f"{_layout(xs, steps)}")
    if previous is not None and not previous.stale:
        reused = _encode_reusing(xs, steps, previous, profile)
        if reused is not None:
            return (*reused, True)
    return (*_encode_fresh(xs, steps, profile, covering=True), False)


def _prepare(xs, steps: int, profile):
    """(flat int view, block table, host layout, common kernel arguments) of a block; checks the tensors."""
    dtype, dev = xs[0].dtype, xs[0].device
    if any(x.dtype != dtype or x.device != dev for x in xs):
        raise ValueError("xs: a block is encoded with one dtype on one device")
    bits, shift, _ = R.DTYPES[dtype]
    with _stage(profile, "setup"):  # one int view of the block (a copy unless views of one buffer), the table
        flat, offsets = _flat_source(xs)
        meta, host = _block_meta(dev, dtype, offsets, [x.numel() for x in xs], steps)
    T = len(xs)
    lane_args = dict(TP=max(2, triton.next_power_of_2(T)), META_W=META_W, STEPS=steps, GROUP=R.GROUP,
                     GROUPS_PER_PROG=GROUPS_PER_PROG, BITS=bits, SHIFT=shift)
    return flat, meta, host, lane_args


def _encode_fresh(xs, steps: int, profile, covering: bool = False) -> tuple[list, list, BlockCode]:
    """A fresh code for every tensor: histograms, read 1, host code build, upload, lanes, read 2, pack.
    covering: a code to reuse, a single-symbol code that also covers the symbols a later step may add
    (``HEADROOM``; not the reference's bytes, but as lossless; no pair histogram needed); False: byte for byte
    the reference's streams."""
    flat, meta, host, lane_args = _prepare(xs, steps, profile)
    dtype, dev, T = xs[0].dtype, xs[0].device, len(xs)
    hist = _histograms(flat, meta, host, T, lane_args, profile, pairs=not covering)
    with _stage(profile, "read1"):
        counts = _to_host(hist)  # read 1 (int32; each code function widens the rows it reads)
    codes_np, stored, idx, entries = _build_codes(counts, profile, covering)
    pair_flags = np.array([len(c) == R.PAIR_SYMBOLS for c in codes_np], np.int32)
    width = R.PAIR_SYMBOLS if pair_flags.any() else 256
    with _stage(profile, "upload_tables"):
        _, parts = _upload_bundle(np.concatenate(idx), np.concatenate(entries), stored, pair_flags, dev)
        tab = _lookup_table(T, width, parts["idx"], parts["entries"], dev)
    lanes = _lane_sizes(flat, meta, host, parts["pairs"], tab, width, lane_args, profile, check=False)
    with _stage(profile, "read2"):
        totals = _to_host(lanes["sizes"][:T]).tolist()  # read 2
    out = _pack_and_outputs(flat, meta, host, parts["pairs"], tab, width, lanes, totals, parts["stored"], dtype,
                            lane_args, profile)
    code = BlockCode(_layout(xs, steps), tab, width, parts["pairs"], parts["stored"], codes_np, int(sum(totals)))
    return out, codes_np, code


def _encode_reusing(xs, steps: int, code: BlockCode, profile):
    """The block under ``code``: (streams, lengths, code) with one host read, or None when a symbol (or pair)
    that occurs has no code in it (nothing is written then; the caller encodes afresh)."""
    flat, meta, host, lane_args = _prepare(xs, steps, profile)
    dtype, T = xs[0].dtype, len(xs)
    lanes = _lane_sizes(flat, meta, host, code.pairs, code.table, code.width, lane_args, profile, check=True)
    with _stage(profile, "read2"):  # the only read: the stream sizes and the uncovered counts together
        read = _to_host(lanes["sizes"])
    totals, missing = read[:T].tolist(), read[T:]
    if missing.any():
        return None
    out = _pack_and_outputs(flat, meta, host, code.pairs, code.table, code.width, lanes, totals, code.stored, dtype,
                            lane_args, profile)
    stale = sum(totals) > (1 + REBUILD_GROWTH) * code.fresh_bits
    return out, code.lengths, dataclasses.replace(code, stale=stale) if stale else code


def _histograms(flat, meta, host, T: int, lane_args: dict, profile, pairs: bool = True) -> torch.Tensor:
    """int32[T, HIST_W]: each tensor's symbol and pair histogram (1-3 of the module docstring; no host read).
    pairs: False skips the pair histogram (its bins stay 0: a covering code has no pairs)."""
    dev = flat.device
    common = dict(TP=lane_args["TP"], META_W=META_W, BITS=lane_args["BITS"], SHIFT=lane_args["SHIFT"])
    with _stage(profile, "sym_hist"):
        hist = torch.zeros(T, HIST_W, dtype=torch.int32, device=dev)
        _sym_hist_kernel[(host["programs"][0],)](flat, meta, hist, T, HIST_W=HIST_W, BLOCK=HIST_BLOCK, **common)
    if not pairs:
        return hist
    with _stage(profile, "ranks"):
        order = torch.argsort(hist[:, :256], dim=1, descending=True, stable=True)[:, :WINDOW]
        rank = torch.full((T, 256), WINDOW, dtype=torch.int32, device=dev)
        rank.scatter_(1, order, torch.arange(WINDOW, dtype=torch.int32, device=dev).expand(T, WINDOW).contiguous())
        symof = order.to(torch.int32).contiguous()
    with _stage(profile, "pair_hist"):
        _pair_hist_kernel[(host["programs"][1],)](flat, meta, rank, symof, hist, T, HIST_W=HIST_W, WINDOW=WINDOW,
                                                  BLOCK=HIST_BLOCK, **common)
    return hist


def _build_codes(counts: np.ndarray, profile, covering: bool = False) -> tuple[list, list, list, list]:
    """Host code build from the read histograms: (code lengths, stored code streams, table positions, table
    entries) per tensor. covering: see :func:`_encode_fresh`."""
    codes_np, stored, idx, entries = [], [], [], []
    clock = time.perf_counter
    for i in range(counts.shape[0]):
        t0 = clock()
        single = counts[i, :256].astype(np.int64)
        lengths = _covering_lengths(single) if covering else R.code_lengths(single)
        t1 = clock()
        pair_lengths = None if covering else _choose_pair_code(counts[i, 256:], lengths, single)
        t2 = clock()
        if pair_lengths is not None:
            lengths = pair_lengths
        codes_np.append(lengths)
        present = np.flatnonzero(lengths)
        code = R.canonical_codes(lengths)[present].astype(np.int64)
        idx.append(present + i * 65536)
        entries.append((code << 4) | lengths[present].astype(np.int64))
        t3 = clock()
        stored.append(code_streams(lengths))
        if profile is not None:
            profile.add_host("code_lengths", (t1 - t0) * 1e3)
            profile.add_host("pair_code", (t2 - t1) * 1e3)
            profile.add_host("canonical", (t3 - t2) * 1e3)
            profile.add_host("code_streams", (clock() - t3) * 1e3)
    return codes_np, stored, idx, entries


def _covering_lengths(single: np.ndarray) -> np.ndarray:
    """Optimal length-limited single-symbol code lengths (uint8[256]) over the occurring symbols and every symbol
    from 0 to ``HEADROOM`` above the largest occurring one (those at count 1): see ``HEADROOM``."""
    present = np.flatnonzero(single)
    top = min(256, (int(present[-1]) if len(present) else 0) + HEADROOM + 1)
    counts = single.copy()
    counts[:top] = np.maximum(counts[:top], 1)
    return R.limited_lengths(counts)


def _lookup_table(T: int, width: int, idx: torch.Tensor, entries: torch.Tensor, dev) -> torch.Tensor:
    """int32[T * width] lookup entries (0 = no code) from the present positions (``t * 65536 + symbol``) and
    their entries."""
    if width != R.PAIR_SYMBOLS:
        idx = idx // R.PAIR_SYMBOLS * width + idx % R.PAIR_SYMBOLS
    return torch.zeros(T * width, dtype=torch.int32, device=dev).scatter_(0, idx, entries.to(torch.int32))


def _lane_sizes(flat, meta, host, pairs, tab, width: int, lane_args: dict, profile, check: bool) -> dict:
    """Each lane's padded bits (int32) and units (uint8), their block-wide inclusive prefix sum (int64), and
    ``sizes``: int64[2T], each tensor's stream bits then (check: a reused code) its uncovered symbols, all on the
    device (5 of the module docstring)."""
    dev, T = flat.device, pairs.numel()
    with _stage(profile, "lane_bits"):
        n = host["lanes_total"]
        padded = torch.empty(n, dtype=torch.int32, device=dev)
        units = torch.empty(n, dtype=torch.uint8, device=dev)
        sizes = torch.zeros(2 * T, dtype=torch.int64, device=dev)
        _lane_bits_kernel[(host["programs"][2],)](flat, meta, pairs, tab, padded, units, sizes, T, CHECK=check,
                                                  UNIT=R.lane_unit(lane_args["STEPS"]), TAB_W=width, **lane_args)
    with _stage(profile, "cumsum"):
        ends = torch.cumsum(padded, 0, dtype=torch.int64)
    return {"padded": padded, "units": units, "ends": ends, "sizes": sizes}


def _pack_and_outputs(flat, meta, host, pairs, tab, width: int, lanes: dict, totals, stored, dtype, lane_args,
                      profile):
    """6 of the module docstring: words, raw fields and group offsets of every tensor, then each tensor's stream
    views (no copies)."""
    dev, T = flat.device, len(totals)
    kept = R.DTYPES[dtype][2]
    with _stage(profile, "pack"):
        n_words = np.array([-(-t // 32) + R.WORD_PAD for t in totals], np.int64)
        wbase, w_total = _aligned_bases(n_words, R.ALIGN_BYTES // 4)
        words = torch.zeros(w_total, dtype=torch.int32, device=dev)
        raw = torch.zeros(host["raw_total"], dtype=torch.uint8, device=dev)  # zero padding, as the pack's
        goff = torch.zeros(host["goff_total"], dtype=torch.int64, device=dev)
        _pack_kernel[(host["programs"][2],)](flat, meta, pairs, tab, lanes["ends"], lanes["padded"],
                                             _to_device(wbase, dev), words, raw, goff, T, KEPT=kept,
                                             RAW_BYTES=R.field_layout(dtype, None)[1] // 8, TAB_W=width, **lane_args)
    with _stage(profile, "outputs"):
        out = []
        for i in range(T):
            a, nl, g = host["lane0"][i], host["lanes"][i], host["goff_base"][i]
            laid_out = {"words": words[int(wbase[i]): int(wbase[i] + n_words[i])],
                        "lane_units": lanes["units"][a: a + nl],
                        "group_offsets": goff[g: g + host["groups"][i]],
                        "raw": raw[host["raw_off"][i]: host["raw_off"][i] + host["raw_bytes"][i]]}
            for v in laid_out.values():  # BlockPack may take these buffers as its streams (zeros between parts)
                v._zero_padded = True
            out.append({**laid_out, **stored[i]})
    return out


def _choose_pair_code(pair_counts: np.ndarray, single_lengths: np.ndarray, single_counts: np.ndarray):
    """:func:`reference.choose_pair_code` of one tensor's 65536-bin pair row, on the pairs that occur only
    (~300): the same lengths (the package-merge orders leaves by (count, symbol), and the compacted row keeps
    the symbols' order) and the same choice (the same sums), without ~8 passes over 65536 bins."""
    present = np.flatnonzero(pair_counts)
    m = len(present)
    if m == 0 or m > R.MAX_PAIRS:
        return None
    c = pair_counts[present].astype(np.int64)
    compact = R.limited_lengths(c)
    pair_bits = int((c * compact).sum()) + 24 * m
    single_bits = int((np.asarray(single_counts, np.int64) * single_lengths.astype(np.int64)).sum()) + 8 * 256
    if pair_bits > R.PAIR_SIZE_SLACK * single_bits:
        return None
    lengths = np.zeros(R.PAIR_SYMBOLS, np.uint8)
    lengths[present] = compact
    return lengths


def _upload_bundle(idx, entries, stored, pairs, dev):
    """One non-blocking host-to-device copy of the table scatter (indices, entries), the per-tensor pair flags
    and every tensor's stored code streams; returns device views of each part."""
    chunks, spans = [], []

    def add(a: np.ndarray):
        b = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        at = sum(len(c) for c in chunks)
        chunks.append(b)
        pad = -len(b) % 16
        if pad:
            chunks.append(np.zeros(pad, np.uint8))
        spans.append((at, len(b), a.dtype))

    add(idx.astype(np.int64))
    add(entries.astype(np.int64))
    add(pairs.astype(np.int32))
    keys = []
    for s in stored:
        for k, v in s.items():
            keys.append(k)
            add(v.numpy())
    buf = _to_device(np.concatenate(chunks), dev)
    torch_of = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.int16): torch.int16,
                np.dtype(np.uint8): torch.uint8}
    views = [buf[at: at + nb].view(torch_of[np.dtype(dt)]) for at, nb, dt in spans]
    it = iter(zip(keys, views[3:]))
    stored_dev = [{k: next(it)[1] for k in s} for s in stored]
    return buf, {"idx": views[0], "entries": views[1], "pairs": views[2], "stored": stored_dev}
