"""``model.neuzip``: :class:`CompressedWeights` holds a compressed model's block packs, its two reused decode
buffers, the fused optimizer hook-up, ``memory()`` and ``stats``, and ``observe()`` (instrumentation: a profiler's
context manager around each block decode and re-encode).

How it runs (NOTES.md has the arithmetic):

* A forward pre-hook on each block (installed by :func:`~thrifty.neuzip.convert.compress_model`) decodes the
  whole block in one launch into one of two reused flat buffers (``buffers``), on the current stream (no decode
  ahead on a side stream: NOTES.md says why). On CPU the reference decoder runs.
* Backward decodes the block again (:mod:`thrifty.neuzip.linear`) and the fused optimizer updates each weight in
  the block buffer (``apply_update``). The updated block is re-encoded on its device
  (:func:`thrifty.neuzip.encode.encode_on_device`: the Triton encoder kernels with ``impl="triton"`` / on CUDA,
  torch ops on the CPU): at once on the CPU; on CUDA only when its buffer is needed again (one block later in
  backward), on a side stream that waits for the block's last update only. Why: the encoder reads its histogram
  and its stream size on the host (2 syncs per block since branch nze2; ~41 before, NOTES.md "Re-encode: how it
  works now"); on the main stream each one drained everything queued, i.e. the next block's backward, so
  the GPU idled through every host step of every encode. On the side stream a sync waits for the encode's own
  small kernels while the main stream keeps running the backward of the block after it.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Optional

import torch
import torch.nn as nn

from . import reference as R
from .block_decode import BlockPack
from .config import NeuZipConfig

N_BUFFERS = 2  # the block running now and the one before it (resident again in backward without recompute)


class CompressedWeights:
    """``model.neuzip``: the block packs, the decode buffers, the fused optimizer hook-up and the accounting."""

    def __init__(self, model: nn.Module, config: NeuZipConfig, packs: list, names: list):
        self.config = config
        self.packs: list[BlockPack] = packs
        self.names: list[list[str]] = names  # parameter name of each slot, per block
        self.optimizer = None
        self.hooks: list = []  # the blocks' forward pre-hooks (removed by decompress_model)
        self.frozen: set = set()  # weights that had requires_grad=False
        # code_reuses / code_builds: Triton re-encodes that kept the block's last code / built a fresh one
        self.stats = {"block_runs": 0, "decodes": 0, "reencodes": 0, "code_reuses": 0, "code_builds": 0}
        self._codes: dict = {}  # block -> its last encode's BlockCode (config.reuse_code)
        self._model = weakref.ref(model)
        self.vocab: dict = {}  # module name -> CompressedVocab (NeuZipConfig.vocab; tied modules share one)
        self.device = packs[0].device
        self.dtype = packs[0].dtype
        size = max(p.total_numel for p in packs)
        self.buffers = [torch.empty(size, dtype=self.dtype, device=self.device) for _ in range(N_BUFFERS)]
        self.owner = [-1] * N_BUFFERS  # block decoded in each buffer
        self.dirty = [False] * N_BUFFERS  # holds updates not re-encoded yet
        self.current = 0  # buffer of the block running now
        self.updated: dict[int, set] = {}  # block -> slots updated in this backward
        self._view_cache: dict = {}  # (buffer, block) -> the block's weight views into that buffer
        self.cuda = self.device.type == "cuda"
        # re-encode an updated block when its buffer is taken (or at flush), not when its last weight is updated
        self.defer = self.cuda
        self.updated_at: list = [None] * N_BUFFERS  # CUDA event after the last update of the buffer's block
        self._side = torch.cuda.Stream(self.device) if self.cuda else None  # the deferred encodes run here
        if self.cuda:
            for buf in self.buffers:  # read by the side stream: freeing them must wait for it too
                buf.record_stream(self._side)

    # ---------------------------------------------------------------------------------------- decoding
    def _impl(self) -> str:
        return self.config.impl if self.config.impl != "auto" else ("triton" if self.cuda else "reference")

    def _find(self, block: int) -> Optional[int]:
        for b, owner in enumerate(self.owner):
            if owner == block:
                return b
        return None

    def _take(self, exclude: Optional[int]) -> int:
        """A buffer to decode into: one not in use (the current block's is kept); re-encodes its updates first."""
        choices = [b for b in range(N_BUFFERS) if b != exclude]
        b = next((c for c in choices if self.owner[c] == -1), choices[0])
        if self.dirty[b]:
            self._reencode(self.owner[b], b)
        self.owner[b] = -1
        return b

    def _decode(self, block: int, b: int) -> None:
        self.packs[block].decode_into(self.buffers[b], self._impl())
        self.owner[b] = block
        self.stats["decodes"] += 1

    def acquire(self, block: int) -> torch.Tensor:
        """The flat buffer holding block ``block`` decoded (decoding it now if it is not resident)."""
        b = self._find(block)
        if b is None:
            b = self._take(exclude=self.current if self.owner[self.current] != -1 else None)
            self._decode(block, b)
        self.current = b
        return self.buffers[b]

    def borrow_buffer(self) -> torch.Tensor:
        """A decode buffer for a use outside the blocks (the vocabulary chunks): not the current block's, and
        emptied, so the next block decode into it starts over."""
        b = next((c for c in range(N_BUFFERS) if c != self.current), self.current)
        if self.dirty[b]:
            self._reencode(self.owner[b], b)
        self.owner[b] = -1
        return self.buffers[b]

    def before_block(self, block: int) -> None:
        """Forward pre-hook: the block decoded now (also in an activation-checkpoint recompute)."""
        self.stats["block_runs"] += 1
        self.acquire(block)

    def weight(self, block: int, slot: int) -> torch.Tensor:
        """Weight ``slot`` of ``block``: a view into the buffer holding the block (views cached per buffer)."""
        self.acquire(block)
        return self._views(self.current, block)[slot]

    def _views(self, b: int, block: int) -> list:
        views = self._view_cache.get((b, block))
        if views is None:
            pack, buf = self.packs[block], self.buffers[b]
            views = [buf[o: o + n].view(shape) for o, n, shape in zip(pack.offsets, pack.numels, pack.shapes)]
            self._view_cache[(b, block)] = views
        return views

    # ---------------------------------------------------------------------------------------- training
    def attach_optimizer(self, optimizer) -> None:
        if self.config.kept_bits is not None:
            raise ValueError(f"train: lossy NeuZip weights (mantissa_bits={self.config.mantissa_bits}) cannot be "
                             "trained (each update would be rounded away); compress with mode='lossless'")
        self.optimizer = optimizer

    def apply_update(self, block: int, slot: int, grad_w: torch.Tensor) -> None:
        """The fused optimizer step for one weight, in the block buffer; the block is re-encoded once all its
        weights are updated."""
        self.acquire(block)
        b = self.current
        w = self._views(b, block)[slot]
        self.optimizer.update(self.names[block][slot], w, grad_w)
        self.dirty[b] = True
        done = self.updated.setdefault(block, set())
        done.add(slot)
        if len(done) == len(self.packs[block].numels):
            if not self.defer:
                self._reencode(block, b)
            elif self.cuda:  # what the deferred encode waits for (not the work queued after it)
                self.updated_at[b] = torch.cuda.Event()
                self.updated_at[b].record()

    def _reencode(self, block: int, b: int) -> None:
        """Re-encodes buffer ``b`` (block ``block``) into its pack. CUDA: on the side stream (module docstring),
        after the block's last update; the main stream waits for it before it reads the pack or reuses ``b``."""
        if not self.cuda:
            self._encode(block, b)
        else:
            main = torch.cuda.current_stream(self.device)
            ready = self.updated_at[b]
            if ready is not None:
                self._side.wait_event(ready)
            else:  # a block with frozen weights never saw its last update: wait for everything queued
                self._side.wait_stream(main)
            with torch.cuda.stream(self._side):
                self._encode(block, b)
                self._used_by(self.packs[block], main, tables=self._impl() == "triton")
            main.wait_stream(self._side)
        self.updated_at[b] = None
        self.dirty[b] = False
        self.updated.pop(block, None)
        self.stats["reencodes"] += 1

    def _encode(self, block: int, b: int) -> None:
        from .encode import encode_on_device

        pack = self.packs[block]
        buf = self.buffers[b]
        views = [buf[o: o + n].view(shape) for o, n, shape in zip(pack.offsets, pack.numels, pack.shapes)]
        if self._impl() == "triton":  # the whole block at once: one or two device-to-host reads, and the codes
            from .encode_kernel import reencode_block_triton  # the decode tables need stay on the host

            previous = self._codes.get(block) if self.config.reuse_code else None
            streams, lengths, code, reused = reencode_block_triton(views, previous, pack.steps)
            if self.config.reuse_code:
                self._codes[block] = code
            pack.replace(streams, lengths, keep_tables=reused)
            self.stats["code_reuses" if reused else "code_builds"] += 1
        else:
            pack.replace([encode_on_device(v, pack.steps, "reference") for v in views])
        if self._impl() == "triton":  # the launch tables now, on this stream, not inside the next decode
            pack.kernel_tables(pack.device)
            pack.launch_table(pack.device)

    @staticmethod
    def _used_by(pack: BlockPack, stream, tables: bool) -> None:
        """The pack's tensors were made on the side stream and are read by the main stream's decodes: without
        this the allocator could hand their memory to the side stream's next encode while a decode still reads
        them."""
        for t in pack.streams.values():
            t.record_stream(stream)
        if tables:
            for t in pack.kernel_tables(pack.device):  # (single-symbol tables, pair tables)
                t.record_stream(stream)
            pack.launch_table(pack.device).meta.record_stream(stream)

    def flush(self) -> None:
        """Re-encodes every block holding updates not yet written back (a backward that skipped a weight; with
        ``defer``, the blocks updated last)."""
        for b in range(N_BUFFERS):
            if self.dirty[b]:
                self._reencode(self.owner[b], b)

    # ---------------------------------------------------------------------------------------- inspection
    @contextlib.contextmanager
    def observe(self, around: Callable[[str, int], contextlib.AbstractContextManager]):
        """Instrumentation (profilers; ``benchmarks/neuzip_models.py``'s ``phase_*`` columns): inside the block,
        ``around(phase, block)`` returns a context manager entered around each block decode (``phase="decode"``)
        and each re-encode (``"reencode"``) of this model's weights, with the block's index; what it times or
        counts is its business. Outside the block nothing is added to those paths (the wrappers are attributes
        of this object, removed on exit). Blocks may nest; not thread-safe."""
        if not callable(around):
            raise TypeError(f"observe: around must be callable, got {type(around).__name__}")
        saved = {name: self.__dict__[name] for name in ("_decode", "_reencode") if name in self.__dict__}

        def wrapped(phase: str, fn):
            def call(block: int, b: int) -> None:
                with around(phase, block):
                    fn(block, b)
            return call

        self._decode = wrapped("decode", self._decode)  # an instance attribute shadows the method
        self._reencode = wrapped("reencode", self._reencode)
        try:
            yield self
        finally:
            for name in ("_decode", "_reencode"):
                if name in saved:
                    self.__dict__[name] = saved[name]
                else:
                    self.__dict__.pop(name, None)

    def compressed_tensors(self) -> dict:
        """{parameter name: CompressedTensor} (views into the packs)."""
        self.flush()
        return {name: pack.tensor(j) for pack, names in zip(self.packs, self.names) for j, name in enumerate(names)}

    def decoded_weights(self) -> dict:
        """{parameter name: decoded weight}: fresh tensors on the compressed weights' device, from the reference
        decoder (independent of the GPU kernels, so tests can compare the two)."""
        return {name: ct.decompress(impl="reference") for name, ct in self.compressed_tensors().items()}

    def memory(self) -> dict:
        """Bytes of the compressed block weights against the same weights in bf16, per block and in total, plus
        the decode buffers, the launch tables and the parameters kept uncompressed (embedding, norms, lm_head)."""
        blocks = []
        for i, p in enumerate(self.packs):
            blocks.append({"block": i, "tensors": len(p.numels), "params": p.total_numel,
                           "compressed_bytes": p.nbytes, "bf16_bytes": 2 * p.total_numel,
                           "ratio_vs_bf16": p.nbytes / (2 * p.total_numel)})
        comp = sum(b["compressed_bytes"] for b in blocks)
        bf16 = sum(b["bf16_bytes"] for b in blocks)
        original = sum(p.total_numel for p in self.packs) * R.DTYPES[self.dtype][0] // 8  # in the weights' dtype
        model = self._model()
        seen, other = set(), 0
        for prm in (model.parameters() if model is not None else ()):
            if prm.data_ptr() not in seen:
                seen.add(prm.data_ptr())
                other += prm.numel() * prm.element_size()
        vocab_packs = [p for v in {id(v): v for v in self.vocab.values()}.values() for p in v.packs]
        vocab = sum(p.nbytes for p in vocab_packs)
        tables = (sum(p.launch_table(p.device)[0].numel() * 8 for p in self.packs + vocab_packs)
                  if self._impl() == "triton" else 0)
        buffers = sum(b.numel() * b.element_size() for b in self.buffers)
        return {"blocks": blocks, "compressed_bytes": comp, "bf16_bytes": bf16, "ratio_vs_bf16": comp / max(bf16, 1),
                "original_bytes": original, "ratio_vs_original": comp / max(original, 1),
                "buffer_bytes": buffers, "launch_table_bytes": tables, "uncompressed_param_bytes": other,
                "vocab_compressed_bytes": vocab, "total_weight_bytes": comp + vocab + buffers + tables + other}
