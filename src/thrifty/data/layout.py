"""The layout of a prepared corpus folder, shared by the builder (``prepare.py``) and the readers
(``dataset.py``, ``text.py``)::

    manifest.json            what was built from what: sources, versions, licences, bytes, tokens, sha256
    train.bin validation.bin flat uint16 token ids, every document followed by the EOS id
    text/<source>.jsonl      the cleaned documents ({"id", "split", "text"} per line), for a look or re-tokenizing
    licenses/<package>.copyright  the package's own copyright file, kept next to the text derived from it
"""

from __future__ import annotations

import hashlib
from pathlib import Path

FORMAT_VERSION = 1
SPLITS = ("train", "validation")


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
