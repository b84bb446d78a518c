"""Memory-mapped token splits written by ``prepare_corpus``: random training windows and sequential
evaluation batches, without ever loading the whole file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from .._checks import check_choice, check_positive_int
from .layout import SPLITS, file_sha256


class TokenDataset:
    """One split (``"train"`` or ``"validation"``) of a prepared corpus, as a read-only ``uint16`` memmap.

    ``path_or_dir``: the corpus folder or its ``manifest.json``. The file size is always checked against the
    manifest; ``verify_checksum`` (default on, ~0.1 s per 50 MB) also checks its sha256, so a corrupted or
    half-written file is rejected before training on it.
    """

    def __init__(self, path_or_dir, split: str = "train", *, verify_checksum: bool = True):
        if not isinstance(path_or_dir, (str, Path)):
            raise TypeError(f"path_or_dir: expected a path, got {type(path_or_dir).__name__}")
        check_choice("split", split, SPLITS)
        path = Path(path_or_dir)
        manifest_path = path if path.name == "manifest.json" else path / "manifest.json"
        if not manifest_path.is_file():
            raise ValueError(
                f"path_or_dir: no manifest.json at {manifest_path}; run thrifty.data.prepare_corpus() first"
            )
        try:
            self.manifest = json.loads(manifest_path.read_text())
            info = self.manifest["splits"][split]
        except (ValueError, KeyError) as e:
            raise ValueError(f"{manifest_path}: not a valid corpus manifest ({e!r})") from None
        self.path = manifest_path.parent / info["file"]
        self.split = split
        if not self.path.is_file():
            raise ValueError(f"{self.path}: token file listed in the manifest is missing")
        expected = 2 * int(info["tokens"])
        actual = self.path.stat().st_size
        if actual != expected:
            raise ValueError(
                f"{self.path}: corrupt token file, {actual} bytes but the manifest says {expected} "
                f"({info['tokens']} uint16 tokens); rebuild with prepare_corpus()"
            )
        if verify_checksum and file_sha256(self.path) != info["sha256"]:
            raise ValueError(f"{self.path}: corrupt token file, sha256 differs from the manifest; rebuild with "
                             "prepare_corpus()")
        self.tokens = np.memmap(self.path, dtype=np.uint16, mode="r") if expected else np.zeros(0, np.uint16)
        tok = self.manifest.get("tokenizer", {})
        self.vocab_size: int = tok.get("vocab_size")
        self.eos_id: int = tok.get("eos_id")

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return f"TokenDataset({str(self.path)!r}, split={self.split!r}, num_tokens={self.num_tokens})"

    def _check_window(self, batch_size, seq_len) -> None:
        check_positive_int("batch_size", batch_size)
        check_positive_int("seq_len", seq_len)
        if seq_len + 1 > self.num_tokens:
            raise ValueError(
                f"seq_len: {seq_len} needs {seq_len + 1} tokens but the {self.split} split has {self.num_tokens}"
            )

    def _windows(self, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
        w = torch.from_numpy(self.tokens[idx].astype(np.int64))
        return w[:, :-1], w[:, 1:]

    def batch(
        self,
        batch_size: int,
        seq_len: int,
        *,
        generator: Optional[torch.Generator] = None,
        seed: Optional[int] = None,
        device=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, int64 ``[batch_size, seq_len]``, windows at uniformly random offsets;
        ``targets`` is ``inputs`` shifted left by one token. Pass ``generator`` or ``seed`` for reproducibility."""
        self._check_window(batch_size, seq_len)
        if generator is not None and seed is not None:
            raise ValueError("seed: pass either generator or seed, not both")
        if seed is not None:
            generator = torch.Generator().manual_seed(seed)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
        high = self.num_tokens - seq_len  # last start with seq_len + 1 tokens after it, exclusive bound
        starts = torch.randint(0, high, (batch_size,), generator=generator).numpy()
        x, y = self._windows(starts, seq_len)
        if device is not None:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        return x, y

    def num_eval_batches(self, batch_size: int, seq_len: int) -> int:
        self._check_window(batch_size, seq_len)
        windows = (self.num_tokens - 1) // seq_len
        return -(-windows // batch_size)

    def iter_eval_batches(
        self, batch_size: int, seq_len: int, max_batches: Optional[int] = None, *, device=None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Consecutive non-overlapping windows from the start of the split, so every token (but the first and a
        tail shorter than ``seq_len``) is predicted exactly once: the same batches every call, for perplexity.
        The last batch may hold fewer than ``batch_size`` rows."""
        self._check_window(batch_size, seq_len)
        if max_batches is not None:
            check_positive_int("max_batches", max_batches)
        windows = (self.num_tokens - 1) // seq_len
        n = 0
        for first in range(0, windows, batch_size):
            if max_batches is not None and n >= max_batches:
                return
            starts = np.arange(first, min(first + batch_size, windows), dtype=np.int64) * seq_len
            x, y = self._windows(starts, seq_len)
            if device is not None:
                x, y = x.to(device), y.to(device)
            n += 1
            yield x, y
