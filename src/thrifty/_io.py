"""Safe file writes: a file is written next to its destination under a temporary name, checked, and only then
renamed into place, so a failed or interrupted write never leaves a half-written file where a good one (or
the caller's input) was."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path


def check_output_path(name: str, out, *inputs) -> Path:
    """Refuses an output path whose folder is missing, that is a folder, or that is one of ``inputs`` (also
    through a symlink or a hard link). Raises ValueError naming ``name``; returns ``Path(out)``."""
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{name}: the folder {parent} does not exist")
    if out.is_dir():
        raise ValueError(f"{name}: {out} is a folder, expected a file path")
    for src in inputs:
        src = Path(src)
        same = out.resolve() == src.resolve()
        if not same and out.exists() and src.exists():
            same = os.path.samefile(out, src)
        if same:
            raise ValueError(f"{name}: {out} is the input file {src}; write to another path")
    return out


@contextlib.contextmanager
def atomic_path(path):
    """Yields a temporary path in ``path``'s folder; when the block ends without an exception the file is
    renamed onto ``path`` (atomic on POSIX), otherwise it is removed and ``path`` is left untouched."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp (and safetensors, which writes its own temporary file) make it 0600: give it the
        # permissions of an ordinary new file
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ---------------------------------------------------------------------------------------------- checked reads
def read_json(path, what: str = "JSON file"):
    """Parsed JSON of ``path``; ValueError naming the file when it is missing, unreadable or not JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: missing {what}") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot read ({err.strerror or err})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: corrupted {what} ({err})") from None


def read_safetensors(path, device="cpu") -> dict:
    """{name: tensor} of a safetensors file; ValueError naming the file when it is missing, unreadable,
    truncated or not safetensors (safetensors' own errors do not say which file)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: missing (expected a .safetensors file)")
    from safetensors import safe_open

    try:
        tensors = load_file(str(path), device="cpu")
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except Exception as err:  # SafetensorError, OSError, RuntimeError: all mean "this file is unusable"
        raise ValueError(f"{path}: not a readable safetensors file ({type(err).__name__}: {err})") from None
    if CRC_KEY in meta:  # written by thrifty: every tensor's bytes are checked (safetensors has no checksum)
        try:
            want = json.loads(meta[CRC_KEY])
        except json.JSONDecodeError:
            raise ValueError(f"{path}: corrupted checksum table in the header") from None
        if not isinstance(want, dict) or set(want) != set(tensors):
            raise ValueError(f"{path}: the checksum table does not list the file's tensors (file corrupted)")
        for name, t in tensors.items():
            if tensor_crc32(t) != want[name]:
                raise ValueError(f"{path}: tensor {name!r}: checksum mismatch (file corrupted)")
    return {k: v.to(device) for k, v in tensors.items()} if str(device) != "cpu" else tensors


CRC_KEY = "thrifty.crc32"


def tensor_crc32(t) -> int:
    import zlib

    import torch

    t = t.detach().cpu().contiguous().reshape(-1)
    return zlib.crc32(t.view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def crc_metadata(state: dict) -> dict:
    """safetensors metadata holding each tensor's CRC32, checked by :func:`read_safetensors`."""
    return {CRC_KEY: json.dumps({k: tensor_crc32(v) for k, v in state.items()})}


def check_state_matches(source, state: dict, expected: dict, *, optional=()) -> None:
    """Every tensor of ``expected`` ({name: tensor}) is in ``state`` with the same shape and dtype (names in
    ``optional`` may be absent), and ``state`` holds nothing else. ValueError naming ``source`` otherwise."""
    missing = [n for n in expected if n not in state and n not in optional]
    unexpected = [n for n in state if n not in expected]
    if missing or unexpected:
        raise ValueError(f"{source}: tensors do not match the model: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    for name, t in state.items():
        want = expected[name]
        if t.shape != want.shape or t.dtype != want.dtype:
            raise ValueError(f"{source}: tensor {name!r} is {t.dtype} {tuple(t.shape)}, the model expects "
                             f"{want.dtype} {tuple(want.shape)}")
