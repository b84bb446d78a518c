"""Safe file writes: a file is written next to its destination under a temporary name, checked, and only then
renamed into place, so a failed or interrupted write never leaves a half-written file where a good one (or
the caller's input) was."""

from __future__ import annotations

import contextlib
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
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes it 0600; give it the permissions of an ordinary new file
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
