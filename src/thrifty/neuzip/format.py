"""On-disk format: a safetensors file of uint8 streams + header metadata; checked before anything is used.

Layout: for tensor NAME, the safetensors entries ``NAME::words``, ``::lane_units``, ``::group_offsets``,
``::raw``, ``::lengths`` (NeuZip codec; pair-coded tensors add ``::pair_syms``, meta ``"pairs": true``,
reference.py) or ``NAME::data`` (codec "plain": dtypes NeuZip does not code, e.g. int64), each stored as flat
uint8 (little-endian bytes). The header's ``__metadata__`` holds ``thrifty.neuzip.format`` = FORMAT_VERSION
and ``thrifty.neuzip.tensors`` = JSON {NAME: {codec, dtype, shape, mantissa_bits, steps, lane_unit, crc32,
...}}: ``steps`` is the lane length (64, 128 or 256), ``lane_unit`` = steps // 16, the bits per unit of
``lane_units`` (uint8, each lane zero-padded to a whole unit).

FORMAT_VERSION is the only version thrifty writes and reads (4: the numbering of the codec's development
before the first release; no released thrifty wrote another); a file of any other version is refused by name.
``load`` parses the header, checks the version, every tensor's streams, sizes and CRC32, and only then returns
tensors: a corrupted, truncated or foreign file raises ValueError naming the file (and the tensor). No pickle
anywhere.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path
from typing import Union

import numpy as np
import torch

from .._checks import check_device
from . import reference as R
from .tensor import CompressedTensor

FORMAT_VERSION = 4
VERSION_KEY = "thrifty.neuzip.format"
TENSORS_KEY = "thrifty.neuzip.tensors"
STREAMS = {"words": torch.int32, "lane_units": torch.uint8, "group_offsets": torch.int64, "raw": torch.uint8,
           "lengths": torch.uint8}
PAIR_STREAMS = dict(STREAMS, pair_syms=torch.int16)


def _streams_of(pairs: bool) -> dict:
    return PAIR_STREAMS if pairs else STREAMS


def _plain_dtypes() -> tuple:
    """Every dtype safetensors can hold (stored raw by the "plain" codec, bit for bit)."""
    names = ("bfloat16", "float16", "float32", "float64", "int64", "int32", "int16", "int8", "uint64", "uint32",
             "uint16", "uint8", "bool", "complex64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
             "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")
    return tuple(getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype))


_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in _plain_dtypes()}
MAX_NDIM = 64  # more dimensions than torch allows: a forged header
MAX_NUMEL = 1 << 62  # element counts above this are forged (and would overflow int64 byte counts)


Entry = Union[CompressedTensor, torch.Tensor]  # a plain tensor is stored uncompressed ("plain" codec)


def _bytes(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.numel() == 0:  # an empty tensor's stride may not allow a view to bytes
        return np.zeros(0, np.uint8)
    return t.view(torch.uint8).numpy()


def _from_bytes(data: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    if data.size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(data.copy()).view(dtype).reshape(shape)


def save(path, entries: dict) -> None:
    """Writes {name: CompressedTensor or plain tensor} to ``path`` (safetensors).

    Any dtype safetensors holds is stored ("plain" codec, raw bytes), empty and 0-d tensors included. The file
    is written under a temporary name in the same folder, read back with :func:`load` and compared with
    ``entries`` (streams and bytes), and only then renamed onto ``path``: a failed write never leaves a
    partial file, and a file that would not restore exactly is never written.
    """
    from safetensors.numpy import save_file

    from .._io import atomic_path, check_output_path

    if not isinstance(entries, dict):
        raise TypeError(f"entries: expected a dict {{name: tensor}}, got {type(entries).__name__}")
    path = check_output_path("path", path)
    arrays, meta = {}, {}
    for name, e in entries.items():
        if not isinstance(name, str):
            raise TypeError(f"entries: tensor names must be str, got {type(name).__name__} {name!r}")
        if "::" in name:
            raise ValueError(f"entries: tensor name {name!r} must not contain '::'")
        if isinstance(e, CompressedTensor):
            for key in _streams_of(e.pairs):
                arrays[f"{name}::{key}"] = _bytes(e.streams[key])
            meta[name] = {"codec": "neuzip", "dtype": str(e.dtype).removeprefix("torch."), "shape": list(e.shape),
                          "mantissa_bits": e.mantissa_bits, "steps": e.steps, "lane_unit": e.unit, "group": R.GROUP,
                          "max_code_bits": R.MAX_CODE_BITS, "crc32": e.crc32(), "pairs": e.pairs}
        elif isinstance(e, torch.Tensor):
            dtype = str(e.dtype).removeprefix("torch.")
            if dtype not in _DTYPE_NAMES:
                raise TypeError(f"entries[{name!r}]: dtype {e.dtype} cannot be stored (safetensors holds "
                                f"{sorted(_DTYPE_NAMES)})")
            data = _bytes(e)
            arrays[f"{name}::data"] = data
            meta[name] = {"codec": "plain", "dtype": dtype, "shape": list(e.shape),
                          "crc32": zlib.crc32(data.tobytes())}
        else:
            raise TypeError(f"entries[{name!r}]: expected a CompressedTensor or a torch.Tensor, got {type(e).__name__}")
    with atomic_path(path) as tmp:
        save_file(arrays, str(tmp), metadata={VERSION_KEY: str(FORMAT_VERSION), TENSORS_KEY: json.dumps(meta)})
        _verify_written(tmp, path, entries)


def _verify_written(tmp: Path, path: Path, entries: dict) -> None:
    """Reads the just-written file back; raises if any entry differs from what was meant to be written."""
    try:
        back = load(tmp, device=None)
    except ValueError as err:  # e.g. streams that are not a valid encoding (built by hand)
        raise ValueError(f"{path}: not written, the file would not read back: "
                         f"{str(err).replace(str(tmp), str(path))}") from None
    if set(back) != set(entries):
        raise RuntimeError(f"{path}: the written file holds {sorted(back)[:4]}..., not the tensors given; "
                           "nothing was written")
    for name, e in entries.items():
        b = back[name]
        if isinstance(e, CompressedTensor):
            same = isinstance(b, CompressedTensor) and b.crc32() == e.crc32()
        else:
            same = isinstance(b, torch.Tensor) and b.dtype == e.dtype and b.shape == e.shape and \
                np.array_equal(_bytes(b), _bytes(e))
        if not same:
            raise RuntimeError(f"{path}: tensor {name!r} does not read back as written; nothing was written")


def _header(path: Path, data: bytes) -> dict:
    if len(data) < 8:
        raise ValueError(f"{path}: not a neuzip file (only {len(data)} bytes)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise ValueError(f"{path}: truncated or not a safetensors file (header of {size} bytes, file {len(data)})")
    try:
        header = json.loads(data[8: 8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: corrupted header ({err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupted header (not a JSON object)")
    return header


def load(path, device="cpu") -> dict:
    """Reads and checks a file written by :func:`save`; returns {name: CompressedTensor or tensor}."""
    from safetensors.numpy import load as st_load

    path = Path(path)
    if device is not None:
        device = check_device("device", device)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"{path}: cannot read ({err.strerror or err})") from None
    header = _header(path, data)
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: corrupted header (__metadata__ is not an object)")
    version = meta.get(VERSION_KEY)
    if version is None:
        raise ValueError(f"{path}: not a thrifty neuzip file (no {VERSION_KEY!r} in the header)")
    if version != str(FORMAT_VERSION):
        raise ValueError(f"{path}: neuzip format version {version!r}; this thrifty reads version "
                         f"{str(FORMAT_VERSION)!r} only (the one it writes)")
    try:
        tensors_meta = json.loads(meta.get(TENSORS_KEY) or "")
        arrays = st_load(data)
    except Exception as err:  # safetensors raises its own error type for bad offsets / sizes
        raise ValueError(f"{path}: corrupted or truncated file ({type(err).__name__}: {err})") from None
    if not isinstance(tensors_meta, dict):
        raise ValueError(f"{path}: corrupted tensor table in the header")
    out = {}
    for name, m in tensors_meta.items():  # check everything first, build tensors only when all are good
        out[name] = _check_entry(path, name, m, arrays)
    expected = {f"{n}::{k}" for n, e in out.items()
                for k in (_streams_of(e.pairs) if isinstance(e, CompressedTensor) else ("data",))}
    if set(arrays) != expected:
        raise ValueError(f"{path}: streams {sorted(set(arrays) ^ expected)[:4]} do not match the tensor table")
    return {k: (v.to(device) if device is not None else v) for k, v in out.items()}


def _check_entry(path: Path, name: str, m, arrays: dict) -> Entry:
    where = f"{path}: tensor {name!r}"
    try:
        codec, dtype, shape = m["codec"], _DTYPE_NAMES[m["dtype"]], list(m["shape"])
        crc = m["crc32"]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{where}: corrupted metadata {str(m)[:200]}") from None
    if type(crc) is not int or not 0 <= crc < 1 << 32:
        raise ValueError(f"{where}: bad checksum field {crc!r}")
    # Python ints: a forged shape cannot overflow the products below (NumPy's int64 would wrap silently)
    if len(shape) > MAX_NDIM or any(type(d) is not int or d < 0 for d in shape):
        raise ValueError(f"{where}: bad shape {str(shape)[:200]}")
    numel = math.prod(shape)
    if numel > MAX_NUMEL:
        raise ValueError(f"{where}: shape {shape} has {numel} elements, more than any file can hold")
    if codec == "plain":
        data = arrays.get(f"{name}::data")
        if data is None or data.ndim != 1 or data.size != numel * torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"{where}: missing or truncated data")
        if zlib.crc32(data.tobytes()) != crc:
            raise ValueError(f"{where}: checksum mismatch (file corrupted)")
        return _from_bytes(data, dtype, shape)
    if codec != "neuzip":
        raise ValueError(f"{where}: unknown codec {codec!r}")
    if dtype not in R.DTYPES:
        raise ValueError(f"{where}: dtype {dtype} cannot be NeuZip-coded")
    steps = m.get("steps")
    if type(steps) is not int or steps not in R.LANE_STEPS:
        raise ValueError(f"{where}: lane length steps={steps!r}, expected one of {list(R.LANE_STEPS)}")
    unit = m.get("lane_unit")
    if type(unit) is not int or unit != R.lane_unit(steps):
        raise ValueError(f"{where}: lane_unit={unit!r}, steps={steps} needs lane_unit={R.lane_unit(steps)}")
    params = (m.get("group"), m.get("max_code_bits"))
    if params != (R.GROUP, R.MAX_CODE_BITS):
        raise ValueError(f"{where}: codec parameters (group, max_code_bits) = {params} differ from this "
                         f"version's {(R.GROUP, R.MAX_CODE_BITS)}")
    pairs = m.get("pairs", False)
    if type(pairs) is not bool:
        raise ValueError(f"{where}: pairs={pairs!r}, expected true or false")
    k = m.get("mantissa_bits")
    if k is not None and (dtype != torch.bfloat16 or type(k) is not int or k not in (0, 1, 3)):
        raise ValueError(f"{where}: bad mantissa_bits {k!r}")
    streams = {}
    for key, sdtype in _streams_of(pairs).items():
        a = arrays.get(f"{name}::{key}")
        size = torch.empty((), dtype=sdtype).element_size()
        if a is None or a.ndim != 1 or a.size % size:
            raise ValueError(f"{where}: stream {key!r} missing or truncated")
        streams[key] = _from_bytes(a, sdtype, (a.size // size,))
    # sizes implied by the element count: a mismatch means truncation or a forged header
    groups = R.n_groups(numel, steps)
    kept, field_bits = R.field_layout(dtype, k)
    want = {"lane_units": groups * R.GROUP, "group_offsets": groups, "raw": -(-numel * field_bits // 8),
            "lengths": streams["pair_syms"].numel() if pairs else 256}
    for key, n in want.items():
        if streams[key].numel() != n:
            raise ValueError(f"{where}: stream {key!r} has {streams[key].numel()} entries, expected {n}")
    lengths = streams["lengths"].numpy().astype(np.int64)
    present = lengths[lengths > 0]
    if (lengths > R.MAX_CODE_BITS).any() or \
            (len(present) > 1 and sum(1 << (R.MAX_CODE_BITS - int(n)) for n in present) > 1 << R.MAX_CODE_BITS):
        raise ValueError(f"{where}: the code lengths do not form a prefix code")
    if pairs:
        syms = streams["pair_syms"].numpy().view(np.uint16).astype(np.int64)
        if not 0 < len(syms) <= R.MAX_PAIRS or (np.diff(syms) <= 0).any() or (lengths == 0).any():
            raise ValueError(f"{where}: the pair code is not 1..{R.MAX_PAIRS} ascending pairs of nonzero length")
    ct = CompressedTensor(streams, dtype, shape, k, steps=steps)
    if ct.crc32() != crc:
        raise ValueError(f"{where}: checksum mismatch (file corrupted)")
    # a forged header or streams (with a matching checksum) must be rejected here, never reach a decoder:
    # each lane's length within what its symbols can take, group offsets = the prefix sums, word count
    lane_bits = ct._lane_bits()
    per_lane = steps // 2 if pairs else steps
    symbols = np.clip(-(-(-(-numel // (steps // per_lane)) - _lane_first(groups, per_lane)) // R.GROUP), 0, per_lane)
    total = int(lane_bits.sum())
    starts = np.cumsum(lane_bits) - lane_bits
    if (streams["words"].numel() != -(-total // 32) + R.WORD_PAD
            or int(streams["lengths"].max()) > R.MAX_CODE_BITS
            or (lane_bits > -(-symbols * R.MAX_CODE_BITS // ct.unit) * ct.unit).any()
            or not np.array_equal(streams["group_offsets"].numpy(), starts[::R.GROUP])):
        raise ValueError(f"{where}: inconsistent streams")
    return ct


def _lane_first(groups: int, steps: int) -> np.ndarray:
    """Symbol index of each lane's first symbol, lanes of ``steps`` symbols; the lane holds
    min(steps, ceil((n - first) / 64)) of n symbols."""
    lane = np.arange(groups * R.GROUP, dtype=np.int64)
    return (lane // R.GROUP) * R.GROUP * steps + lane % R.GROUP
