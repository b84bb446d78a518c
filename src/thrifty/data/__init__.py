"""Real-text corpus: Debian documentation cleaned to English prose, tokenized into memory-mapped splits.

``prepare_corpus()`` builds it (idempotently) and ``TokenDataset`` reads it; see ``corpus.py`` for the layout.
"""

from .corpus import (
    DEBIAN_PACKAGES,
    SPLITS,
    clean_file,
    keep_paragraph,
    load_corpus_text,
    prepare_corpus,
)
from .dataset import TokenDataset

__all__ = [
    "DEBIAN_PACKAGES",
    "SPLITS",
    "TokenDataset",
    "clean_file",
    "keep_paragraph",
    "load_corpus_text",
    "prepare_corpus",
]
