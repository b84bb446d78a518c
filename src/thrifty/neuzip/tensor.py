"""``compress(tensor)`` -> :class:`CompressedTensor`, and its ``decompress``."""

from __future__ import annotations

import math
import zlib
from typing import Optional

import numpy as np
import torch

from .._checks import check_impl, check_tensor
from . import reference as R

# The block kernel's pack class, registered by block_decode at import: block_decode builds on CompressedTensor,
# so this module must not import it (the package's import graph stays one-way).
_BLOCK_PACK = None



def _check_mantissa_bits(mantissa_bits, dtype: torch.dtype):
    if mantissa_bits is None:
        return None
    if isinstance(mantissa_bits, bool) or not isinstance(mantissa_bits, int):
        raise TypeError(f"mantissa_bits: expected None (lossless) or an int, got {type(mantissa_bits).__name__}")
    if dtype != torch.bfloat16:
        raise ValueError(f"mantissa_bits: lossy mode is implemented for torch.bfloat16 only, got {dtype}")
    if mantissa_bits not in R.LOSSY_MANTISSA_BITS:
        raise ValueError(f"mantissa_bits: expected None or one of {list(R.LOSSY_MANTISSA_BITS)}, got {mantissa_bits}")
    return None if mantissa_bits == 7 else mantissa_bits


class CompressedTensor:
    """A NeuZip-compressed float tensor: streams (torch tensors on one device) + metadata.

    Streams: ``words`` int32 (uint32 bit stream), ``lane_units`` uint8 (each lane's padded length in units of
    ``steps // 16`` bits), ``group_offsets`` int64, ``raw`` uint8, ``lengths`` uint8[256] (the code). Pair-coded
    tensors (:attr:`pairs`) hold ``pair_syms`` int16 (the uint16 pair symbols that occur, ascending) and
    ``lengths`` uint8, one code length per entry of ``pair_syms``. ``steps``: elements per lane (the layout).
    ``decompress`` rebuilds the exact original bits (lossless) or the rounded tensor (``mantissa_bits`` = k).
    """

    def __init__(self, streams: dict, dtype: torch.dtype, shape, mantissa_bits: Optional[int] = None,
                 symbol_entropy: Optional[float] = None, steps: int = R.STEPS):
        self.streams = streams
        self.dtype = dtype
        self.shape = torch.Size(shape)
        self.mantissa_bits = mantissa_bits
        self.steps = R.check_steps(steps)
        self.symbol_entropy = symbol_entropy  # Shannon entropy of the symbols (bits), when known
        self._tables: dict = {}
        self._coded_bits: Optional[int] = None  # sum of the code lengths, when known (set by compress)

    # ---- sizes
    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def pairs(self) -> bool:
        """Coded in pair symbols (two elements per code)."""
        return "pair_syms" in self.streams

    def code_lengths(self) -> np.ndarray:
        """The code as the reference reads it: uint8[256], or uint8[65536] (one per pair symbol) for pairs."""
        lengths = self.streams["lengths"].cpu().numpy()
        if not self.pairs:
            return lengths
        full = np.zeros(R.PAIR_SYMBOLS, dtype=np.uint8)
        full[self.streams["pair_syms"].cpu().numpy().view(np.uint16)] = lengths
        return full

    @property
    def unit(self) -> int:
        """Bits per stored lane-length unit: ``steps // 16``."""
        return R.lane_unit(self.steps)

    def _lane_bits(self) -> np.ndarray:
        """Each lane's (padded) bit length, int64."""
        return R.lane_bit_lengths(self.streams["lane_units"].cpu().numpy(), self.steps)

    @property
    def device(self) -> torch.device:
        return self.streams["words"].device

    @property
    def nbytes(self) -> int:
        """Compressed bytes: every stream, the code table included."""
        return sum(t.numel() * t.element_size() for t in self.streams.values())

    @property
    def original_nbytes(self) -> int:
        return self.numel * R.DTYPES[self.dtype][0] // 8

    @property
    def ratio(self) -> float:
        """Compressed / original size (smaller is better)."""
        return self.nbytes / max(self.original_nbytes, 1)

    @property
    def symbol_bits(self) -> float:
        """Achieved bits per coded symbol (exponent), lane metadata excluded: exact for a tensor made by
        :func:`compress`; for one read from a file, lanes padded to whole units count their padding (at most
        unit - 1 bits per lane: < 0.05 bits per symbol)."""
        total = self._coded_bits if self._coded_bits is not None else int(self._lane_bits().sum())
        return total / max(self.numel, 1)

    def crc32(self) -> int:
        """Checksum of every stream (in a fixed order) and the metadata that interprets them."""
        meta = (str(self.dtype), tuple(self.shape), self.mantissa_bits)
        if self.steps != 256:  # (written files leave 256 out: their checksums must stay valid)
            meta += (self.steps,)
        meta += ("units", self.unit)
        if self.pairs:
            meta += ("pairs",)
        crc = zlib.crc32(repr(meta).encode())
        for key in sorted(self.streams):
            if self.streams[key].numel():  # (an empty stream adds no bytes; its stride may not allow the view)
                crc = zlib.crc32(self.streams[key].cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
        return crc

    def to(self, device) -> "CompressedTensor":
        out = CompressedTensor({k: v.to(device) for k, v in self.streams.items()}, self.dtype, self.shape,
                               self.mantissa_bits, self.symbol_entropy, self.steps)
        out._coded_bits = self._coded_bits
        return out

    def __repr__(self) -> str:
        lossy = "lossless" if self.mantissa_bits is None else f"mantissa_bits={self.mantissa_bits}"
        return (f"CompressedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, {lossy}, "
                f"steps={self.steps}, ratio={self.ratio:.4f}, device={self.device})")

    # ---- decode
    def _kept(self) -> int:
        return R.field_layout(self.dtype, self.mantissa_bits)[0]

    def _numpy_streams(self) -> R.Streams:
        s = {k: v.cpu().numpy() for k, v in self.streams.items()}
        return R.Streams(s["words"].view(np.uint32), s["lane_units"], s["group_offsets"], s["raw"],
                         self.code_lengths(), np.zeros(256, np.int64), self.steps, self.pairs)

    def decompress(self, out: Optional[torch.Tensor] = None, impl: str = "auto", **launch) -> torch.Tensor:
        """The decoded tensor, on ``self.device`` (or written into ``out``, any device, same dtype/numel).

        impl: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "reference" (NumPy on the CPU), "auto"
        (Triton on CUDA, else the reference). ``launch``: ``kernel`` ("v3", "v2", "v1") / ``groups_per_prog`` /
        ``num_warps`` / ``table16`` (int16 entries; default for 16-bit dtypes) / ``small`` (8-bit first-level
        table) / ``asm`` (v3), ``small_table`` (v1/v2: ``self._table(device, "small")``)
        for Triton; the defaults were the fastest on the H200 (NOTES.md).
        """
        check_impl(impl)
        if out is not None:
            check_tensor("out", out, dtypes=(self.dtype,))
            if out.numel() != self.numel or not out.is_contiguous():
                raise ValueError(f"out: expected a contiguous tensor of {self.numel} elements, got shape "
                                 f"{tuple(out.shape)} (contiguous={out.is_contiguous()})")
        target = out.device if out is not None else self.device
        if impl == "auto":
            impl = "triton" if target.type == "cuda" else "reference"
        if impl == "reference":
            result = R.decode(self._numpy_streams(), self.dtype, self.shape, self.mantissa_bits)
            if out is None:
                return result.to(target)
            out.view(-1).copy_(result.view(-1))
            return out
        from ..triton_utils import kernels_available
        from .decode_kernel import decode_into

        if not kernels_available(target):
            raise ValueError(f"impl: 'triton' needs a CUDA tensor (or TRITON_INTERPRET=1 on CPU), got {target}")
        src = self if self.device == target else self.to(target)
        if out is None:
            out = torch.empty(self.shape, dtype=self.dtype, device=target)
        if self.pairs:  # pair symbols have one kernel: the block decoder's, with a pack of this one tensor
            if launch:
                raise ValueError(f"launch options {sorted(launch)} apply to single-symbol tensors only")
            src._pack().decode_into(out.view(-1), impl="triton")
            return out
        s = src.streams
        table16 = launch.pop("table16", self.dtype != torch.float32)
        small = launch.pop("small", False)
        if launch.get("kernel", "v3") == "v3" and launch.get("pipelined") is None:
            launch.setdefault("v3_table", src._table(target, "v3_16" if table16 else "v3"))
            if small:
                launch.setdefault("v3_small", src._table(target, "v3_small16" if table16 else "v3_small"))
        decode_into(s["words"], s["lane_units"], s["group_offsets"], s["raw"], src._table(target), out,
                    self._kept(), steps=self.steps, **launch)
        return out

    def _pack(self):
        """This tensor alone as a block pack (cached): the kernel path of pair-coded tensors."""
        if "pack" not in self._tables:
            if _BLOCK_PACK is None:  # block_decode registers itself when the package is imported
                raise RuntimeError("thrifty.neuzip.block_decode is not imported: import thrifty.neuzip")
            self._tables["pack"] = _BLOCK_PACK([self])
        return self._tables["pack"]

    def _table(self, device, kind: str = "ref") -> torch.Tensor:
        """A decode table on ``device``, cached: "ref" the int32[4096] of :func:`reference.decode_table`,
        "small" its int16[256] first level (v1/v2), "v3" / "v3_16" the v3 kernel's (int32 / int16) and
        "v3_small" / "v3_small16" their 256-entry first levels."""
        from .decode_kernel import kernel_table, small_table

        key = (str(device), kind)
        if key not in self._tables:
            if kind == "ref":
                t = torch.from_numpy(R.decode_table(self.code_lengths())).to(device)
            elif kind == "small":
                t = small_table(self._table(device))
            elif kind in ("v3", "v3_16", "v3_small", "v3_small16"):
                t = kernel_table(self._table(device), self.dtype, table16=kind.endswith("16"), small="small" in kind)
            else:
                raise ValueError(f"kind: expected 'ref', 'small', 'v3', 'v3_16', 'v3_small' or 'v3_small16', "
                                 f"got {kind!r}")
            self._tables[key] = t
        return self._tables[key]


def compress(tensor: torch.Tensor, mantissa_bits: Optional[int] = None, steps: int = R.STEPS,
             pairs: Optional[bool] = None) -> CompressedTensor:
    """Compresses a bf16/fp16/fp32 tensor; lossless unless ``mantissa_bits`` (bf16: 0, 1, 3; 7 = lossless).

    steps: elements per lane, one of ``reference.LANE_STEPS`` (shorter lanes: faster GPU decode, 8 bits of
    metadata per lane + padding to ``steps // 16`` bits). pairs: None = pair symbols where
    :func:`reference.choose_pair_code` picks them (the faster decode), False = single symbols (the v1/v2/v3
    kernels and their launch options), True = pair symbols (ValueError where more than 4096 pairs occur).
    Encoding runs on the CPU; the result's streams live on ``tensor``'s
    device.
    """
    if pairs is not None and not isinstance(pairs, bool):
        raise TypeError(f"pairs: expected None (chosen per tensor) or a bool, got {type(pairs).__name__}")
    check_tensor("tensor", tensor, dtypes=tuple(R.DTYPES))
    if tensor.device.type == "meta":
        raise ValueError("tensor: a meta tensor has no values to compress")
    mantissa_bits = _check_mantissa_bits(mantissa_bits, tensor.dtype)
    steps = R.check_steps(steps)
    return _from_streams(R.encode(tensor, mantissa_bits, steps, pairs=pairs), tensor, mantissa_bits)


def code_streams(lengths: np.ndarray) -> dict:
    """The stored code: {"lengths": uint8[256]}, or for pair symbols (65536 lengths) the pairs that occur
    and their lengths: {"pair_syms": int16 (uint16 bits, ascending), "lengths": uint8}."""
    lengths = np.asarray(lengths, dtype=np.uint8)
    if len(lengths) != R.PAIR_SYMBOLS:
        return {"lengths": torch.from_numpy(lengths.copy())}
    present = np.flatnonzero(lengths)
    return {"pair_syms": torch.from_numpy(present.astype(np.uint16).view(np.int16)),
            "lengths": torch.from_numpy(lengths[present].copy())}


def _from_streams(s: "R.Streams", tensor: torch.Tensor, mantissa_bits) -> CompressedTensor:
    """A CompressedTensor of ``tensor``'s encoded streams."""
    streams = {
        "words": torch.from_numpy(s.words.view(np.int32).copy()),
        "lane_units": torch.from_numpy(s.lane_len.astype(np.uint8)),
        "group_offsets": torch.from_numpy(s.group_offsets.astype(np.int64)),
        "raw": torch.from_numpy(s.raw.copy()),
        **code_streams(s.lengths),
    }
    ct = CompressedTensor(streams, tensor.dtype, tensor.shape, mantissa_bits, R.entropy_bits(s.counts), s.steps)
    ct._coded_bits = s.coded_bits
    return ct if tensor.device.type == "cpu" else ct.to(tensor.device)


def pair_symbols(symbol: torch.Tensor) -> torch.Tensor:
    """As :func:`reference.pair_symbols`: (s[2p] << 8) | s[2p + 1] (int64), 0 past an odd end."""
    if symbol.numel() % 2:
        symbol = torch.cat([symbol, symbol.new_zeros(1)])
    pair = symbol.view(-1, 2).to(torch.int64)
    return (pair[:, 0] << 8) | pair[:, 1]
