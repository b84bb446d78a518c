"""Real-text corpus: Debian documentation cleaned to English prose, tokenized into memory-mapped splits.

``prepare_corpus()`` builds it (idempotently) and ``TokenDataset`` reads it. Modules, by concern:
``debian`` (the source packages and fetching them), ``clean`` (files to prose paragraphs), ``corpus`` (building:
split, tokenize, manifest), ``layout`` (the folder's files, shared by builder and reader), ``dataset`` (reading
the token files), ``locate`` (where the commands find a corpus).
"""

from .clean import clean_file, keep_paragraph
from .corpus import load_corpus_text, prepare_corpus
from .dataset import TokenDataset
from .debian import DEBIAN_PACKAGES
from .layout import SPLITS

__all__ = [
    "DEBIAN_PACKAGES",
    "SPLITS",
    "TokenDataset",
    "clean_file",
    "keep_paragraph",
    "load_corpus_text",
    "prepare_corpus",
]
