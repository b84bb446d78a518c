"""Real-text corpus: Debian documentation cleaned to English prose, tokenized into memory-mapped splits.

``prepare_corpus()`` builds it (idempotently) and ``TokenDataset`` reads it. Modules, by concern:
``debian`` (the source packages and fetching them), ``clean`` (files to prose paragraphs), ``prepare`` (building:
sources, split, tokenize, manifest), ``tokenizer`` (the tokenizer and its end-of-document token), ``layout`` (the
folder's files, shared by builder and readers), ``dataset`` (reading the token files), ``text`` (reading the
cleaned text back), ``locate`` (where the commands find a corpus).
"""

from .clean import clean_file, keep_paragraph
from .dataset import TokenDataset
from .debian import DEBIAN_PACKAGES
from .layout import SPLITS
from .prepare import prepare_corpus
from .text import load_corpus_text

__all__ = [
    "DEBIAN_PACKAGES",
    "SPLITS",
    "TokenDataset",
    "clean_file",
    "keep_paragraph",
    "load_corpus_text",
    "prepare_corpus",
]
