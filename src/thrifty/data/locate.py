"""Where the commands and the demo find their corpus and device."""

from __future__ import annotations

from pathlib import Path


def resolve_device(name: str):
    """"auto" (CUDA when present, else the CPU) or a device name, checked."""
    import torch

    from .._checks import check_device

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return check_device("--device", name)


def corpus_path(corpus_dir=None, max_mb=None, reuse: bool = False) -> Path:
    """The Debian corpus by default; with ``corpus_dir`` only that folder, built into its own data folder.
    ``reuse``: take a corpus already built by ``thrifty setup`` (whatever its size cap) as it is."""
    from ..paths import data_dir
    from .prepare import prepare_corpus

    if corpus_dir is None:
        built = data_dir() / "corpus"
        if reuse and (built / "manifest.json").is_file():
            return built
        return prepare_corpus(max_mb=max_mb)
    name = Path(corpus_dir).resolve().name or "root"
    return prepare_corpus(out_dir=data_dir() / f"corpus-{name}", sources=(), corpus_dir=corpus_dir, max_mb=max_mb)
