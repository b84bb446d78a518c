"""The embedding and the lm_head NeuZip-coded in row chunks, for serving (``NeuZipConfig(vocab=True)``).

Why: in a small or mid-sized model the (V, D) vocabulary matrix is a large share of the weights (SmolLM2-135M:
21%, the 30m model trained here: 67%), so coding only the blocks leaves the whole model far above half its bf16
bytes. The matrix cannot be decoded whole at use: a V x D bf16 buffer would make the peak larger than keeping it
bf16. So it is cut into chunks of rows, each its own one-launch :class:`BlockPack`, and every use walks the chunks
through one small buffer: the lookup copies the rows its ids fall on, the head writes its logits one column
range at a time. The buffer is one of the block decode buffers, borrowed (no buffer of its own): the lookup runs
before the first block, the head after the last, so neither needs a block resident at that moment.

Cost: every forward decodes the matrix once for the lookup and once for the head (tied or not), i.e. about what a
copy of 2 x V x D bf16 bytes costs, plus one host path (~20 µs) per chunk. Inference only: the lookup and the head
have no weight gradient (training keeps the vocabulary plain; ``compress_model`` refuses ``vocab`` with
``train``).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .block_decode import BlockPack, pack_tensors


class CompressedVocab:
    """A (V, D) matrix as row chunks of at most ``chunk_rows`` rows, each a one-launch pack."""

    def __init__(self, weight: torch.Tensor, chunk_rows: int, kept_bits: Optional[int], steps: int):
        if weight.dim() != 2:
            raise ValueError(f"weight: expected a (vocab, hidden) matrix, got shape {tuple(weight.shape)}")
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows: expected >= 1, got {chunk_rows}")
        self.shape = tuple(weight.shape)
        self.dtype, self.device = weight.dtype, weight.device
        self.chunk_rows = chunk_rows
        w = weight.detach()
        self.starts = list(range(0, self.shape[0], chunk_rows))
        self.packs: list[BlockPack] = [pack_tensors([w[s: s + chunk_rows].contiguous()], kept_bits, steps)
                                       for s in self.starts]

    @classmethod
    def from_packs(cls, packs: list, shape: tuple, chunk_rows: int) -> "CompressedVocab":
        """The matrix from its coded chunks (a checkpoint's): one single-tensor pack per ``chunk_rows`` rows, the
        last one shorter; ValueError when the chunks do not tile ``shape``."""
        V, D = (int(x) for x in shape)
        if V < 1 or D < 1 or chunk_rows < 1:
            raise ValueError(f"shape {shape} / chunk_rows {chunk_rows}: expected positive sizes")
        starts = list(range(0, V, chunk_rows))
        if len(packs) != len(starts):
            raise ValueError(f"{len(packs)} chunks for {V} rows in chunks of {chunk_rows}: expected {len(starts)}")
        for start, pack in zip(starts, packs):
            want = (min(chunk_rows, V - start), D)
            if len(pack.shapes) != 1 or tuple(pack.shapes[0]) != want:
                raise ValueError(f"the chunk at row {start} has shape {list(pack.shapes)}, expected {want}")
        if len({p.dtype for p in packs}) != 1:
            raise ValueError("chunks of different dtypes")
        self = cls.__new__(cls)
        self.shape, self.chunk_rows, self.starts, self.packs = (V, D), chunk_rows, starts, list(packs)
        self.dtype, self.device = packs[0].dtype, packs[0].device
        return self

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.packs)

    def chunks(self, buffer: torch.Tensor, impl: str) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, the decoded rows (n, D) as a view of ``buffer``) per chunk; each view is valid until the
        next chunk is decoded (same stream, so the consumer's kernels run before the next decode overwrites)."""
        D = self.shape[1]
        for start, pack in zip(self.starts, self.packs):
            n = min(self.chunk_rows, self.shape[0] - start)
            pack.decode_into(buffer, impl)
            yield start, buffer[: n * D].view(n, D)

    def decoded(self) -> torch.Tensor:
        """The whole matrix, freshly decoded by the reference decoder (for ``decompress_model`` and tests)."""
        parts = [p.tensor(0).decompress(impl="reference") for p in self.packs]
        return torch.cat([t.reshape(-1, self.shape[1]) for t in parts]).to(self.device)


class _VocabUser(nn.Module):
    """Shared plumbing: the compressed matrix and the model's NeuZip state (whose buffer it borrows)."""

    def __init__(self, vocab: CompressedVocab, state):
        super().__init__()
        self.__dict__["vocab"] = vocab  # plain attributes, not submodules or parameters
        self.__dict__["state"] = state

    def _chunks(self):
        return self.vocab.chunks(self.state.borrow_buffer(), self.state._impl())

    @property
    def weight(self) -> torch.Tensor:
        """The whole decoded matrix as a new tensor (for callers that need it at once, e.g. a fused loss seam;
        costs a V x D buffer while it lives)."""
        out = torch.empty(self.vocab.shape, dtype=self.vocab.dtype, device=self.vocab.device)
        for start, rows in self._chunks():
            out[start: start + rows.shape[0]] = rows
        return out


class CompressedEmbedding(_VocabUser):
    """``nn.Embedding`` over a :class:`CompressedVocab`: each chunk fills the positions whose ids fall in it
    (a masked select per chunk: no host sync, no index compaction)."""

    def __init__(self, vocab: CompressedVocab, state, padding_idx: Optional[int] = None):
        super().__init__(vocab, state)
        self.num_embeddings, self.embedding_dim = vocab.shape
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*ids.shape, self.embedding_dim, dtype=self.vocab.dtype, device=ids.device)
        for start, rows in self._chunks():
            local = ids - start
            hit = (local >= 0) & (local < rows.shape[0])
            out = torch.where(hit.unsqueeze(-1), rows[local.clamp(0, rows.shape[0] - 1)], out)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, chunks={len(self.vocab.packs)}"


class CompressedHead(_VocabUser):
    """``nn.Linear(D, V, bias=False)`` over a :class:`CompressedVocab`: the logits one column range per chunk."""

    def __init__(self, vocab: CompressedVocab, state):
        super().__init__(vocab, state)
        self.out_features, self.in_features = vocab.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype, device=x.device)
        for start, rows in self._chunks():
            w = rows if rows.dtype == x.dtype else rows.to(x.dtype)
            out[..., start: start + rows.shape[0]] = F.linear(x, w)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, chunks={len(self.vocab.packs)}"


def find_vocab(model: nn.Module) -> tuple[Optional[str], Optional[str]]:
    """(name of the input embedding, name of the output head) or None where the model has none of that kind.
    Uses the transformers accessors when present, else thrifty's names."""
    names = {id(m): n for n, m in model.named_modules()}
    emb = head = None
    if hasattr(model, "get_input_embeddings"):
        emb = model.get_input_embeddings()
    if hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
    if emb is None:
        emb = next((m for n, m in model.named_modules() if n.endswith("embed_tokens")), None)
    if head is None:
        head = getattr(model, "lm_head", None)
    emb = emb if isinstance(emb, nn.Embedding) else None
    head = head if isinstance(head, nn.Linear) and head.bias is None else None
    return (names.get(id(emb)) if emb is not None else None), (names.get(id(head)) if head is not None else None)
