"""All weights of one transformer block in ONE decode launch: a :class:`BlockPack` and its multi-tensor kernel.

A pack holds the streams of T compressed tensors (one dtype, one lossy setting, one lane length) concatenated:
``words``, ``lane_units``, ``group_offsets``, ``raw`` and the T code tables (each part padded to 16 bytes, so
every tensor's raw fields start aligned). The decoded tensors lie one after the other in one flat output
buffer. The kernel's grid covers the programs of every tensor (a program decodes ``GROUPS_PER_PROG`` groups of
64 lanes of one tensor); a per-program row of the ``meta`` table (int64, built once per pack on the host) gives
the program its tensor's stream bases, element count, whether it may run unmasked and whether the tensor is
coded in pair symbols. Pair tensors run :func:`decode_kernel._pair_lanes` (one lookup per two elements), the
others v3's lane loop: same helpers, same bits as the reference.

Why one launch: decoding the 7 matrices of a Llama block one ``decompress()`` at a time costs 7 host paths
(~40 µs each, measured on the H100) and 7 under-filled grids; one launch pays one host path and fills the GPU
with the programs of all 7.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from . import reference as R
from .decode_kernel import _lanes_v3, _pair_lanes, kernel_table, pair_kernel_table
from . import tensor as _tensor_module
from .tensor import CompressedTensor
from ..triton_utils import FastLauncher, sm_count

META = 13  # int64 fields per program row
# Launch shapes, (groups of 64 lanes per program, warps). WIDE: 1 lane per thread, 4 warps; the fastest of ten
# shapes swept on the H200 for the pair kernel (a 1B block 75 us against 89 for 2 lanes per thread at 4 warps:
# the L1 gathers of the code table are latency-bound, and one lane per thread keeps the registers at full
# occupancy). NARROW: 1 lane per thread, 2 warps, twice the programs, for a block whose WIDE grid has fewer
# programs than SMs.
WIDE = (2, 4)
NARROW = (1, 2)
MIN_PROGRAMS_PER_SM = 1  # below this many WIDE programs per SM a block launches NARROW
PACK_STREAMS = ("words", "lane_units", "group_offsets", "raw", "lengths", "pair_syms")
ALIGN_BYTES = R.ALIGN_BYTES  # each tensor's part of a pack stream starts at a multiple of this


@triton.jit
def _block_decode_kernel(meta_ptr, words_ptr, lanes_ptr, goff_ptr, raw_ptr, tables_ptr, pair_tables_ptr, out_ptr,
                         STEPS: tl.constexpr, GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                         FIELD_BITS: tl.constexpr, KEPT: tl.constexpr, SYM_SHIFT: tl.constexpr,
                         SIGN_SHIFT: tl.constexpr, ASM: tl.constexpr, TSIZE: tl.constexpr,
                         LANE_SHIFT: tl.constexpr, META_W: tl.constexpr):
    """One program = GROUPS_PER_PROG groups of one tensor of the pack; its meta row says which."""
    LANES: tl.constexpr = GROUP * GROUPS_PER_PROG
    row = meta_ptr + tl.program_id(0) * META_W
    local = tl.load(row)  # program index within its tensor
    words = words_ptr + tl.load(row + 1)
    lanes_base = tl.load(row + 2)
    goff = goff_ptr + tl.load(row + 3)
    raw = raw_ptr + tl.load(row + 4)
    table_at = tl.load(row + 5)
    out = out_ptr + tl.load(row + 6)
    n = tl.load(row + 7)
    n_lanes = tl.load(row + 8)
    n_words = tl.load(row + 9)
    full = tl.load(row + 10)
    raw_bytes = tl.load(row + 11)
    pairs = tl.load(row + 12)
    idx = tl.arange(0, LANES)
    lane = local.to(tl.int32) * LANES + idx
    lane_ok = lane < n_lanes
    # Warm-up loads, issued before the lane lengths arrive and waited on once with the first words (`junk` is
    # 0, the compiler cannot know): every 32-byte sector of this program's raw fields into L2 (the loop reads
    # them .cg one iteration ahead; from DRAM that was one round trip per 4 symbols) and of its code table
    # into L1 (a warp's lookups touch most of its lines).
    junk = tl.zeros([LANES], dtype=tl.int32)
    RAW_SECTORS: tl.constexpr = GROUPS_PER_PROG * GROUP * STEPS * FIELD_BITS // 256
    raw_start = local * (RAW_SECTORS * 32)
    for k in tl.static_range((RAW_SECTORS + LANES - 1) // LANES):
        rs = raw_start + (k * LANES + idx) * 32
        ok = (k * LANES + idx < RAW_SECTORS) & (rs < raw_bytes)
        junk |= tl.load(raw + rs, mask=ok, other=0, cache_modifier=".cg").to(tl.int32) & (lane < 0)
    if pairs != 0:
        junk = _touch_table(pair_tables_ptr + table_at, junk, idx, lane, 4, LANES)
    else:
        junk = _touch_table(tables_ptr + table_at, junk, idx, lane, TSIZE, LANES)
    bits = (tl.load(lanes_ptr + lanes_base + lane, mask=lane_ok, other=0).to(tl.int32) & 0xFF) << LANE_SHIFT
    start = tl.load(goff + local * GROUPS_PER_PROG) + (tl.cumsum(bits, axis=0) - bits).to(tl.int64)
    word = (start >> 5).to(tl.int32)
    off = (start & 31).to(tl.int32)
    last_word = word + ((off + bits) >> 5) + 2
    # touch every 32-byte sector of each lane's stream now (one wait)
    for k in tl.static_range(1, (STEPS * 12 + 255) // 256 + 1):
        pw = word + 8 * k
        junk |= tl.load(words + pw, mask=lane_ok & (pw <= last_word) & (pw < n_words), other=0) & (lane < 0)
    hi = tl.load(words + word, mask=lane_ok, other=0)
    lo = tl.load(words + word + 1, mask=lane_ok, other=0)
    w = tl.load(words + word + 2, mask=lane_ok, other=0)  # WORD_PAD >= 3 keeps these in bounds
    off = off + junk
    nw = word + 2
    PAIRS: tl.constexpr = STEPS // 2
    FAST: tl.constexpr = SIGN_SHIFT == 15 and KEPT == 7  # lossless 16-bit: 32-bit stores of pairs
    # (the branches name their values apart: the compiler merges a name bound in both, and the tables differ)
    if pairs != 0:
        q = (lane // GROUP) * (GROUP * PAIRS) + lane % GROUP  # each lane's first pair
        pair_table = pair_tables_ptr + table_at
        if full != 0:
            _pair_lanes(hi, lo, w, off, nw, q, n, words, raw, pair_table, out, PAIRS, GROUP, FIELD_BITS, KEPT,
                        SYM_SHIFT, SIGN_SHIFT, FAST, False, ASM)
        else:
            _pair_lanes(hi, lo, w, off, nw, q, n, words, raw, pair_table, out, PAIRS, GROUP, FIELD_BITS, KEPT,
                        SYM_SHIFT, SIGN_SHIFT, False, True, ASM)
    else:
        elem = (lane // GROUP) * (GROUP * STEPS) + lane % GROUP
        table = tables_ptr + table_at
        if full != 0:
            _lanes_v3(hi, lo, w, off, nw, elem, n, words, raw, table, table, out, STEPS, GROUP,
                      FIELD_BITS, KEPT, SYM_SHIFT, SIGN_SHIFT, False, ASM, TSIZE, False)
        else:
            _lanes_v3(hi, lo, w, off, nw, elem, n, words, raw, table, table, out, STEPS, GROUP,
                      FIELD_BITS, KEPT, SYM_SHIFT, SIGN_SHIFT, True, ASM, TSIZE, False)


@triton.jit
def _touch_table(table, junk, idx, lane, TSIZE: tl.constexpr, LANES: tl.constexpr):
    """Loads every 32-byte sector of a 4096-entry table (into L1); returns ``junk`` (still 0) depending on them."""
    TABLE_SECTORS: tl.constexpr = 4096 * TSIZE // 32
    for k in tl.static_range((TABLE_SECTORS + LANES - 1) // LANES):
        ts = (k * LANES + idx) * (32 // TSIZE)
        junk |= tl.load(table + ts, mask=ts < 4096, other=0).to(tl.int32) & (lane < 0)
    return junk


_LAUNCH = FastLauncher(_block_decode_kernel)


class BlockPack:
    """The compressed tensors of one block, streams concatenated on one device (see the module docstring).

    ``shapes[i]``, ``numels[i]``: tensor i; it decodes to ``out[offsets[i]: offsets[i] + numels[i]]`` of a flat
    buffer of ``total_numel`` elements. ``launches`` counts Triton launches (the one-launch-per-block test).
    """

    def __init__(self, tensors: Sequence[CompressedTensor]):
        if not tensors:
            raise ValueError("tensors: a block pack needs at least one tensor")
        first = tensors[0]
        for t in tensors:
            if not isinstance(t, CompressedTensor):
                raise TypeError(f"tensors: expected CompressedTensor entries, got {type(t).__name__}")
            if (t.dtype, t.mantissa_bits, t.steps) != (first.dtype, first.mantissa_bits, first.steps):  # pairs may mix
                raise ValueError("tensors: a pack needs one dtype, one mantissa_bits and one lane length; "
                                 f"got {t!r} beside {first!r}")
            if t.device != first.device:
                raise ValueError(f"tensors: all on one device, got {t.device} and {first.device}")
        self.dtype, self.mantissa_bits, self.steps = first.dtype, first.mantissa_bits, first.steps
        self.shapes = [t.shape for t in tensors]
        self.numels = [t.numel for t in tensors]
        self.offsets = [0] + list(np.cumsum(self.numels)[:-1].tolist())
        self.total_numel = int(sum(self.numels))
        self.launches = 0
        self._set_streams([t.streams for t in tensors])

    # ------------------------------------------------------------------------------------------ streams
    def _set_streams(self, streams: Sequence[dict], code_lengths: Optional[Sequence[np.ndarray]] = None,
                     keep_tables: bool = False) -> None:
        """Concatenates per-tensor streams, each part padded to ALIGN_BYTES (the pair kernel loads two raw
        bytes at a time); remembers each tensor's base in every stream and whether it is pair-coded.
        code_lengths: each tensor's code as :meth:`CompressedTensor.code_lengths` reads it, when the caller has
        it on the host (the encoder), so the decode tables need no device-to-host read. keep_tables: the codes
        are those of the current decode tables (a re-encode that reused its code): keep them."""
        self.pairs = ["pair_syms" in s for s in streams]
        self._host_lengths = None if code_lengths is None else list(code_lengths)
        empty = torch.zeros(0, dtype=torch.int16, device=streams[0]["words"].device)
        parts = {k: [s.get(k, empty).reshape(-1) for s in streams] for k in PACK_STREAMS}
        self.sizes = {k: [p.numel() for p in v] for k, v in parts.items()}
        self.bases, self.streams = {}, {}
        for k, v in parts.items():
            align = ALIGN_BYTES // v[0].element_size()
            bases, at = [], 0
            for p in v:
                bases.append(at)
                at += p.numel() + (-p.numel() % align)
            self.bases[k] = bases
            zero_padded = all(getattr(st.get(k), "_zero_padded", False) for st in streams)
            self.streams[k] = _laid_out(v, bases, at, zero_padded)
        if not keep_tables:
            self._tables: dict = {}
        self._meta: dict = {}  # the launch rows hold the stream bases: rebuilt either way
        self._launches: dict = {}  # (buffer address, size, dtype) -> the checked launch arguments

    def replace(self, streams: Sequence[dict], code_lengths: Optional[Sequence[np.ndarray]] = None,
                keep_tables: bool = False) -> None:
        """New streams for every tensor (after a LOMO update re-encoded them); shapes and dtype unchanged.
        code_lengths: see :meth:`_set_streams` (must be the codes of ``streams``). keep_tables: the streams are
        coded with the pack's current codes (the encoder reused them), so the decode tables stay (their rebuild
        was ~2.6 ms of host time per 1B-class block); needs ``code_lengths``, the same pair flags."""
        if len(streams) != len(self.shapes):
            raise ValueError(f"streams: expected {len(self.shapes)} tensors, got {len(streams)}")
        if code_lengths is not None and len(code_lengths) != len(streams):
            raise ValueError(f"code_lengths: expected {len(streams)} codes, got {len(code_lengths)}")
        if keep_tables and (code_lengths is None or ["pair_syms" in s for s in streams] != self.pairs):
            raise ValueError("keep_tables: only for streams coded with the pack's current codes (pass their "
                             "code_lengths; pair flags unchanged)")
        self._set_streams(streams, code_lengths, keep_tables)

    def tensor(self, i: int) -> CompressedTensor:
        """Tensor i as a CompressedTensor whose streams are views into the pack (no copy)."""
        s = {k: self.streams[k][self.bases[k][i]: self.bases[k][i] + self.sizes[k][i]] for k in PACK_STREAMS
             if k != "pair_syms" or self.pairs[i]}
        return CompressedTensor(s, self.dtype, self.shapes[i], self.mantissa_bits, steps=self.steps)

    @property
    def device(self) -> torch.device:
        return self.streams["words"].device

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor's streams (code tables included, alignment padding not); the per-program
        launch table is counted apart."""
        return sum(sum(self.sizes[k]) * t.element_size() for k, t in self.streams.items())

    def to(self, device) -> "BlockPack":
        out = BlockPack.__new__(BlockPack)
        out.__dict__.update(self.__dict__)
        out.streams = {k: v.to(device) for k, v in self.streams.items()}
        out._tables, out._meta, out._launches, out.launches = {}, {}, {}, 0
        return out

    # ------------------------------------------------------------------------------------------ decode
    def decode_into(self, out: torch.Tensor, impl: str = "auto") -> torch.Tensor:
        """Decodes every tensor into the flat buffer ``out`` (>= total_numel elements of the pack's dtype).
        impl: "triton" (one launch; CUDA, or the interpreter on CPU), "reference" (NumPy, per tensor), "auto".

        The checks and the launch arguments are kept per output buffer, so a repeated decode into the same
        buffer (every block, every step) costs one dict lookup on the host before the cached launcher."""
        if impl == "triton":
            cached = self._launches.get((out.data_ptr(), out.numel(), out.dtype))
            if cached is not None:
                _LAUNCH(*cached[0], **cached[1])
                self.launches += 1
                return out
        if out.dtype != self.dtype or out.dim() != 1 or out.numel() < self.total_numel or not out.is_contiguous():
            raise ValueError(f"out: expected a flat contiguous {self.dtype} buffer of >= {self.total_numel} elements, "
                             f"got {out.dtype} shape {tuple(out.shape)}")
        if impl == "auto":
            impl = "triton" if out.is_cuda else "reference"
        if impl == "reference":
            for i, (o, n) in enumerate(zip(self.offsets, self.numels)):
                self.tensor(i).decompress(out=out[o: o + n], impl="reference")
            return out
        if impl != "triton":
            raise ValueError(f"impl: expected 'auto', 'triton' or 'reference', got {impl!r}")
        from ..triton_utils import kernels_available

        if not kernels_available(out.device):
            raise ValueError(f"impl: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {out.device}")
        if self.device != out.device:
            raise ValueError(f"out: expected a buffer on the pack's device {self.device}, got {out.device}")
        # pair stores are 32-bit for 16-bit dtypes: a buffer not 4-byte aligned decodes element by element
        meta, grid, groups_per_prog, num_warps = self.launch_table(out.device, aligned=out.data_ptr() % 4 == 0)
        bits, shift, _ = R.DTYPES[self.dtype]
        kept = R.field_layout(self.dtype, self.mantissa_bits)[0]
        tables, pair_tables = self.kernel_tables(out.device)
        asm = out.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
        args = ((grid,), meta, self.streams["words"], self.streams["lane_units"], self.streams["group_offsets"],
                self.streams["raw"], tables, pair_tables, out.view(torch.int16 if bits == 16 else torch.int32))
        kwargs = dict(STEPS=self.steps, GROUP=R.GROUP, GROUPS_PER_PROG=groups_per_prog, FIELD_BITS=kept + 1,
                      KEPT=kept, SYM_SHIFT=shift, SIGN_SHIFT=bits - 1, ASM=asm, TSIZE=tables.element_size(),
                      LANE_SHIFT=R.lane_unit(self.steps).bit_length() - 1, META_W=META, num_warps=num_warps,
                      num_stages=3)
        self._launches[(out.data_ptr(), out.numel(), out.dtype)] = (args, kwargs)  # holds `out`: no address reuse
        _LAUNCH(*args, **kwargs)
        self.launches += 1
        return out

    def kernel_tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(v3 tables of the single-symbol tensors, int16 for 16-bit dtypes; pair tables of the pair-coded
        ones, int32), each 4096 entries per tensor in pack order; a kind no tensor uses is one zero entry."""
        key = str(device)
        if key not in self._tables:
            table16 = R.DTYPES[self.dtype][0] == 16
            single, pair = [], []
            for i in range(len(self.numels)):
                table = torch.from_numpy(R.decode_table(self._code_lengths(i)))
                if self.pairs[i]:
                    pair.append(pair_kernel_table(table))
                else:
                    single.append(kernel_table(table, self.dtype, table16=table16))
            single = single or [torch.zeros(1, dtype=torch.int16 if table16 else torch.int32)]
            self._tables[key] = (_h2d(torch.cat(single), device),
                                 _h2d(torch.cat(pair or [torch.zeros(1, dtype=torch.int32)]), device))
        return self._tables[key]

    def _code_lengths(self, i: int) -> np.ndarray:
        """Tensor i's code (the host copy the encoder handed over, else read from the streams)."""
        if self._host_lengths is not None:
            return self._host_lengths[i]
        return self.tensor(i).code_lengths()

    def launch_table(self, device, aligned: bool = True) -> "Launch":
        """The launch: one meta row (int64[META]) per program of every tensor (module docstring), and its shape.
        aligned: the output buffer is 4-byte aligned (pair tensors at even offsets may then store pairs)."""
        key = (str(device), aligned)
        if key not in self._meta:
            device = torch.device(device)
            sms = sm_count(device)
            groups = [R.n_groups(n, self.steps) for n in self.numels]
            wide = sum(math.ceil(g / WIDE[0]) for g in groups)
            gpp, warps = WIDE if wide >= MIN_PROGRAMS_PER_SM * sms else NARROW
            meta = self._meta_rows(groups, gpp, aligned)
            self._meta[key] = Launch(_h2d(meta, device), meta.shape[0], gpp, warps)
        return self._meta[key]

    def _meta_rows(self, groups: list, gpp: int, aligned: bool) -> torch.Tensor:
        """The int64[programs, META] rows, built with NumPy over all programs at once (a Python loop over the
        ~2700 rows of a 1B-class block cost ~5 ms of host time per re-encode)."""
        t = len(self.numels)
        progs = np.array([math.ceil(g / gpp) for g in groups], np.int64)
        n = np.array(self.numels, np.int64)
        pairs = np.array(self.pairs, bool)
        n_full = np.minimum(n // (gpp * R.GROUP * self.steps), progs - 1)
        # a pair tensor's unmasked loop stores two elements at once: its offset must be even
        unmasked = ~pairs | (aligned & (np.array(self.offsets, np.int64) % 2 == 0))
        same_kind_before = [sum(p == self.pairs[i] for p in self.pairs[:i]) for i in range(t)]
        per_tensor = np.stack([np.zeros(t, np.int64), self.bases["words"], self.bases["lane_units"],
                               self.bases["group_offsets"], self.bases["raw"],
                               np.array(same_kind_before, np.int64) << R.MAX_CODE_BITS, self.offsets, n,
                               np.array(groups, np.int64) * R.GROUP, self.sizes["words"], np.zeros(t, np.int64),
                               self.sizes["raw"], pairs], axis=1).astype(np.int64)
        which = np.repeat(np.arange(t), progs)
        rows = per_tensor[which]
        local = np.arange(len(which)) - np.repeat(np.cumsum(progs) - progs, progs)  # program index in its tensor
        rows[:, 0] = local
        rows[:, 10] = (local < n_full[which]) & unmasked[which]
        return torch.from_numpy(rows.reshape(-1, META))


def _laid_out(parts: list, bases: list, total: int, zero_padded: bool) -> torch.Tensor:
    """One stream of ``total`` elements with part i at ``bases[i]`` and zeros between the parts. The buffer the
    parts already sit in when they are laid out so and its padding is known to be zeros (``zero_padded``: the
    Triton encoder writes a block that way, so a re-encode costs no copy of its streams), else one
    concatenation."""
    first = parts[0]
    storage = first.untyped_storage()
    start = first.storage_offset()
    if (all(p.is_contiguous() and p.untyped_storage().data_ptr() == storage.data_ptr()
            and p.storage_offset() == start + b for p, b in zip(parts, bases))
            and (start + total) * first.element_size() <= storage.nbytes() and zero_padded):
        return torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, start, (total,))
    pieces = []
    for p, b, end in zip(parts, bases, bases[1:] + [total]):
        pieces.append(p)
        if end - b > p.numel():
            pieces.append(p.new_zeros(end - b - p.numel()))
    return torch.cat(pieces)


_tensor_module._BLOCK_PACK = BlockPack  # a pair-coded CompressedTensor decodes through a one-tensor pack


def _h2d(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device``; to CUDA through pinned memory without waiting (a plain ``.to`` from pageable
    memory synchronizes the stream: two per re-encoded block, for the decode and launch tables)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class Launch(NamedTuple):
    meta: torch.Tensor  # int64[programs, META]
    programs: int
    groups_per_prog: int
    num_warps: int


def pack_tensors(tensors: Sequence[torch.Tensor], mantissa_bits: Optional[int] = None,
                 steps: int = R.STEPS) -> BlockPack:
    """Compresses ``tensors`` (lossless: the encoder of their device, :func:`encode.encode_on_device`; lossy:
    the NumPy reference) into a pack."""
    from .encode import encode_on_device
    from .tensor import compress

    cts = []
    for t in tensors:
        if mantissa_bits is None:
            cts.append(CompressedTensor(encode_on_device(t, steps), t.dtype, t.shape, None, steps=steps))
        else:
            cts.append(compress(t, mantissa_bits, steps=steps).to(t.device))
    return BlockPack(cts)
