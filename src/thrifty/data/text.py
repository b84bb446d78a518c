"""The cleaned text of a prepared corpus read back: :func:`load_corpus_text` returns its documents (from
``text/<source>.jsonl``, see ``layout.py``), for a look at what a model is trained on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from .._checks import check_positive_int
from .layout import SPLITS


def load_corpus_text(path=None, split: Optional[str] = None, source: Optional[str] = None,
                     max_documents: Optional[int] = None) -> list[str]:
    """The cleaned documents of a prepared corpus (all sources unless ``source``; both splits unless ``split``),
    for a look at what the model is trained on."""
    from ..paths import data_dir

    out = Path(path) if path is not None else data_dir() / "corpus"
    if out.name == "manifest.json":
        out = out.parent
    manifest_path = out / "manifest.json"
    if not manifest_path.is_file():
        raise ValueError(f"path: no manifest.json in {out}; run thrifty.data.prepare_corpus() first")
    if split is not None and split not in SPLITS:
        raise ValueError(f"split: expected one of {list(SPLITS)}, got {split!r}")
    if max_documents is not None:
        check_positive_int("max_documents", max_documents)
    manifest = json.loads(manifest_path.read_text())
    names = [r["name"] for r in manifest["sources"]]
    if source is not None and source not in names:
        raise ValueError(f"source: expected one of {names}, got {source!r}")
    docs: list[str] = []
    for name in names if source is None else [source]:
        with open(out / "text" / f"{name}.jsonl", encoding="utf-8") as f:
            for line in f:
                doc = json.loads(line)
                if split is None or doc["split"] == split:
                    docs.append(doc["text"])
                    if max_documents is not None and len(docs) >= max_documents:
                        return docs
    return docs
