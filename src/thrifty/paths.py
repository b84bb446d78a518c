"""Where thrifty keeps downloaded and derived data (corpus, converted model, checkpoints)."""

from __future__ import annotations

import os
from pathlib import Path


def repo_root() -> Path | None:
    """The source checkout this package runs from (src layout), or None for an installed wheel."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


def data_dir() -> Path:
    """``$THRIFTY_DATA``, else ``<checkout>/data``, else ``~/.cache/thrifty``; created on first use."""
    env = os.environ.get("THRIFTY_DATA")
    if env:
        path = Path(env)
    elif repo_root() is not None:
        path = repo_root() / "data"
    else:
        path = Path.home() / ".cache" / "thrifty"
    path.mkdir(parents=True, exist_ok=True)
    return path
