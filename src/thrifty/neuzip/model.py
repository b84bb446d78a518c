"""NeuZip inside a model: ``compress_model(model, mode, mantissa_bits)`` keeps every block's linear weights compressed.

How it runs (NOTES.md has the arithmetic):

* The model's repeated blocks are found as its largest ``nn.ModuleList`` of modules holding ``nn.Linear``s
  (``model.model.layers`` in the reference model and in transformers' Llama family). Each block's linear
  weights become one :class:`~thrifty.neuzip.block_decode.BlockPack`; each ``nn.Linear`` is replaced by a
  :class:`CompressedLinear` that holds no weight, only (block, slot). Linears outside the blocks (``lm_head``)
  and the embedding stay as they are: see ``NOTES.md`` ("embedding and lm_head") for why.
* A forward pre-hook on each block decodes the whole block in one launch into one of two reused flat buffers
  (``buffers``), on the current stream (no decode ahead on a side stream: NOTES.md says why). On CPU the
  reference decoder runs.
* :class:`_CompressedLinearFn` keeps the input, not the weight: backward decodes the block again. It computes
  the input gradient and the weight gradient with the same matrix products as autograd's ``F.linear`` (so a
  plain model and a lossless compressed one give the same bits) and hands the weight gradient to the fused
  optimizer (:mod:`thrifty.optim.lomo`) at once. The updated block is re-encoded on its device
  (:func:`thrifty.neuzip.encode.encode_on_device`: the Triton encoder kernels with ``impl="triton"`` / on CUDA,
  torch ops on the CPU): at once on the CPU; on CUDA only when its buffer is needed again (one block later in
  backward), on a side stream that waits for the block's last update only. Why: the encoder reads its histogram
  and its stream size on the host (2 syncs per block since branch nze2; ~41 before, NOTES.md "Re-encode: how it
  works now"); on the main stream each one drained everything queued, i.e. the next block's backward, so
  the GPU idled through every host step of every encode. On the side stream a sync waits for the encode's own
  small kernels while the main stream keeps running the backward of the block after it.
* ``model.neuzip`` (:class:`CompressedWeights`) holds the packs, the buffers, ``memory()`` and ``stats``.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import check_bool, check_choice, check_impl
from ..optim import LomoConfig, lomo
from . import reference as R
from .block_decode import BlockPack, pack_tensors
from .tensor import CompressedTensor

MODES = ("lossless", "lossy")
N_BUFFERS = 2  # the block running now and the one before it (resident again in backward without recompute)


@dataclass
class NeuZipConfig:
    """Everything ``compress_model`` takes; validated here so a driver (``thrifty.optimize``) can pass it whole.

    mode: "lossless" (bit-exact, trainable) or "lossy" (bf16 weights rounded to ``mantissa_bits`` = 0, 1, 3;
    7 keeps every bf16 bit, the paper's "7-bit (lossless)"). steps: symbols per lane of the codec (64, 128,
    256). impl: decoder ("auto": the block kernel on CUDA, the NumPy reference on CPU). vocab: also code the
    input embedding and the lm_head (serving only: no weight gradient; see ``vocab.py``), so the whole model
    shrinks, not only its blocks.

    reuse_code: LOMO training with the Triton encoder (``impl`` "triton", or "auto" on CUDA) re-encodes each
    block with the code of its previous encode while that code still has a code for every exponent (or pair)
    that occurs; else, or once the coded bits grew 1% past the code's fresh build, it builds a new one. Why: a
    step barely moves the exponent histogram, and the host Huffman build plus the decode tables were ~13 of a
    re-encode's ~14 ms per 1B-class block. Still lossless (the weights decode bit for bit); the streams are
    slightly longer and not byte-identical to a fresh encode. False (the default): a fresh code every step. Off
    by default because in Table 1 (H200, 6ba285a) nearly every block fell back (62 reads per step for 22 blocks:
    new rare exponents appear each step beyond the spares), which made the step slower (0.194x vanilla against
    0.255x before); the re-encode alone, when the code covers the block, is 1.4 ms against 9.7 ms."""

    mode: str = "lossless"
    mantissa_bits: Optional[int] = None
    steps: int = R.STEPS
    impl: str = "auto"
    vocab: bool = False
    reuse_code: bool = False

    def __post_init__(self):
        check_choice("mode", self.mode, MODES)
        k = self.mantissa_bits
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
            raise TypeError(f"mantissa_bits: expected None or an int, got {type(k).__name__}")
        if self.mode == "lossless" and k not in (None, 7):
            raise ValueError(f"mantissa_bits: lossless mode keeps every mantissa bit, got {k} (use mode='lossy')")
        if self.mode == "lossy" and k not in R.LOSSY_MANTISSA_BITS:
            raise ValueError(f"mantissa_bits: lossy mode needs one of {list(R.LOSSY_MANTISSA_BITS)}, got {k!r}")
        R.check_steps(self.steps)
        check_impl(self.impl)
        check_bool("vocab", self.vocab)
        check_bool("reuse_code", self.reuse_code)

    @property
    def kept_bits(self) -> Optional[int]:
        """Mantissa bits the codec keeps: None = every bit (lossless, or lossy k=7)."""
        return None if self.mode == "lossless" or self.mantissa_bits == 7 else self.mantissa_bits


# ------------------------------------------------------------------------------------------------ the linear
class _CompressedLinearFn(torch.autograd.Function):
    """y = x Wᵀ + b with W decoded from the block pack; backward decodes W again (it is never saved)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, module):
        ctx.module = module
        ctx.save_for_backward(x)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        m = ctx.module
        state = m.state
        w = state.weight(m.block, m.slot)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            # the products autograd runs for F.linear (x flattened to 2-D): same bits as a plain nn.Linear
            grad_x = g2.mm(w if w.dtype == g2.dtype else w.to(g2.dtype))
            grad_x = grad_x.view(*grad.shape[:-1], w.shape[1])
        if state.optimizer is not None:
            # autograd's mm backward for the column-major W.t(): (gᵀx), no transposes of the result
            grad_w = g2.t().mm(x.reshape(-1, x.shape[-1]))
            state.apply_update(m.block, m.slot, grad_w)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, None, grad_b, None


class CompressedLinear(nn.Module):
    """An ``nn.Linear`` whose weight lives in its block's NeuZip pack (slot ``slot`` of block ``block``)."""

    def __init__(self, in_features: int, out_features: int, bias: Optional[nn.Parameter], state, block: int,
                 slot: int, name: str):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias
        self.block, self.slot, self.name = block, slot, name
        self.__dict__["state"] = state  # a plain attribute, not a submodule

    @property
    def weight(self) -> torch.Tensor:
        """The decoded weight (a view into the block buffer, valid until another block is decoded into it)."""
        return self.state.weight(self.block, self.slot)

    def forward(self, x):
        w = self.state.weight(self.block, self.slot)
        if torch.is_grad_enabled() and (x.requires_grad or self.state.optimizer is not None):
            return _CompressedLinearFn.apply(x, w, self.bias, self)
        return F.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, slot={self.slot}"


# ------------------------------------------------------------------------------------------ the model state
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


# ---------------------------------------------------------------------------------------------- conversion
def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(name, ModuleList) of the model's repeated blocks: the ModuleList holding the most nn.Linear weights."""
    best = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m):
            counts = [sum(isinstance(c, (nn.Linear, CompressedLinear)) for c in b.modules()) for b in m]
            if all(counts) and (best is None or sum(counts) > best[0]):
                best = (sum(counts), name, m)
    if best is None and any(type(m).__name__ == "BitLinear" for m in model.modules()):
        raise ValueError("model: its linear layers are BitNet BitLinears, which NeuZip does not code: a BitLinear "
                         "re-quantizes its latent weight to ternary on every forward, so a compressed copy would "
                         "drop the quantizer (thrifty.optimize refuses bitnet with neuzip for this reason)")
    if best is None:
        raise ValueError("model: no nn.ModuleList of blocks holding nn.Linear layers found (expected a "
                         "transformer like thrifty's LlamaForCausalLM or transformers' LlamaForCausalLM)")
    return best[1], best[2]


def _block_linears(block: nn.Module, prefix: str) -> list:
    return [(f"{prefix}.{n}" if prefix else n, m) for n, m in block.named_modules() if isinstance(m, nn.Linear)]


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def compress_model(model: nn.Module, mode: str = "lossless", mantissa_bits: Optional[int] = None, *,
                   steps: int = R.STEPS, config: Optional[NeuZipConfig] = None, train=None) -> nn.Module:
    """Keeps every linear weight of ``model``'s blocks NeuZip-compressed on its device; returns ``model``
    (changed in place; ``model.neuzip`` is its :class:`CompressedWeights`).

    mode / mantissa_bits / steps: see :class:`NeuZipConfig` (or pass ``config``). train: a
    :class:`~thrifty.optim.LomoConfig` to attach the fused optimizer (lossless only); or call
    :func:`thrifty.optim.lomo` later. Lossy modes need bfloat16 weights. Move the model to its device (and
    dtype) first: the packs and buffers are made on the weights' device and do not follow a later ``.to()``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, "neuzip", None) is not None:
        raise ValueError("model: already compressed (model.neuzip is set)")
    if config is None:
        config = NeuZipConfig(mode=mode, mantissa_bits=mantissa_bits, steps=steps)
    elif not isinstance(config, NeuZipConfig):
        raise TypeError(f"config: expected a NeuZipConfig, got {type(config).__name__}")
    if train is not None:
        if not isinstance(train, LomoConfig):  # checked here: lomo() runs after the model was changed
            raise TypeError(f"train: expected None or a LomoConfig, got {type(train).__name__}")
    if train is not None and config.vocab:
        raise ValueError("train: NeuZipConfig(vocab=True) codes the embedding and lm_head for serving only (they "
                         "get no weight gradient); train with vocab=False")
    if train is not None and config.kept_bits is not None:
        raise ValueError(f"train: lossy NeuZip (mantissa_bits={config.mantissa_bits}) cannot be trained; use "
                         "mode='lossless'")
    prefix, blocks = find_blocks(model)
    groups = []
    for i, block in enumerate(blocks):
        linears = _block_linears(block, f"{prefix}.{i}" if prefix else str(i))
        dtypes = {m.weight.dtype for _, m in linears}
        if len(dtypes) > 1:
            raise ValueError(f"model: block {i} mixes weight dtypes {sorted(map(str, dtypes))}; cast the model first")
        dtype = dtypes.pop()
        if dtype not in R.DTYPES:
            raise ValueError(f"model: weight dtype {dtype} cannot be NeuZip-coded (bf16, fp16, fp32)")
        if config.kept_bits is not None and dtype != torch.bfloat16:
            raise ValueError(f"mantissa_bits: lossy mode ({config.mantissa_bits} bits) needs bfloat16 weights, "
                             f"block {i} has {dtype}; cast with model.to(torch.bfloat16) first")
        groups.append(linears)
    packs = [pack_tensors([m.weight.detach() for _, m in linears], config.kept_bits, config.steps)
             for linears in groups]
    if config.vocab:  # checked before anything is changed: a refusal leaves the model as it was
        _check_vocab(model, config, max(p.total_numel for p in packs))
    _install(model, blocks, groups, packs, config)
    if config.vocab:
        _install_vocab(model, model.neuzip, config)
    if train is not None:
        lomo(model, train)
    return model


def _install(model: nn.Module, blocks: nn.ModuleList, groups: list, packs: list, config: NeuZipConfig) -> None:
    names = [[f"{n}.weight" for n, _ in linears] for linears in groups]
    state = CompressedWeights(model, config, packs, names)
    state.frozen = {f"{name}.weight" for linears in groups for name, m in linears if not m.weight.requires_grad}
    for i, linears in enumerate(groups):
        for j, (name, m) in enumerate(linears):
            _set_module(model, name, CompressedLinear(m.in_features, m.out_features, m.bias, state, i, j, name))
        state.hooks.append(blocks[i].register_forward_pre_hook(lambda _m, _args, i=i: state.before_block(i)))
    model.neuzip = state


def _check_vocab(model: nn.Module, config: NeuZipConfig, buffer_numel: int) -> None:
    from .vocab import find_vocab

    names = [n for n in find_vocab(model) if n is not None]
    if not names:
        raise ValueError("vocab: the model has no nn.Embedding input embedding or bias-free nn.Linear lm_head")
    for name in names:
        w = model.get_submodule(name).weight
        if config.kept_bits is not None and w.dtype != torch.bfloat16:
            raise ValueError(f"mantissa_bits: lossy mode needs bfloat16 weights, {name} has {w.dtype}; cast with "
                             "model.to(torch.bfloat16) first")
        if w.dtype not in R.DTYPES:
            raise ValueError(f"vocab: {name} has dtype {w.dtype}, which NeuZip cannot code (bf16, fp16, fp32)")
        if w.shape[1] > buffer_numel:
            raise ValueError(f"vocab: a row of {name} ({w.shape[1]} weights) does not fit the block decode buffer")


def _install_vocab(model: nn.Module, state: "CompressedWeights", config: NeuZipConfig) -> None:
    """The embedding and the bias-free lm_head as chunked compressed modules (one shared matrix when tied)."""
    from .vocab import CompressedEmbedding, CompressedHead, CompressedVocab, find_vocab

    by_weight: dict = {}
    for name in find_vocab(model):
        if name is None:
            continue
        module = model.get_submodule(name)
        w = module.weight
        if id(w) not in by_weight:
            by_weight[id(w)] = CompressedVocab(w, state.buffers[0].numel() // w.shape[1], config.kept_bits,
                                               config.steps)
        vocab = by_weight[id(w)]
        state.vocab[name] = vocab
        if isinstance(module, nn.Embedding):
            new = CompressedEmbedding(vocab, state, module.padding_idx)
        else:
            new = CompressedHead(vocab, state)
        new.__dict__["frozen"] = not w.requires_grad
        _set_module(model, name, new)


def _restore_vocab(model: nn.Module, state: "CompressedWeights") -> None:
    decoded: dict = {}
    for name, vocab in state.vocab.items():
        module = model.get_submodule(name)
        if id(vocab) not in decoded:
            decoded[id(vocab)] = nn.Parameter(vocab.decoded(), requires_grad=not module.__dict__.get("frozen"))
        weight = decoded[id(vocab)]
        if hasattr(module, "embedding_dim"):
            plain = nn.Embedding(*vocab.shape, padding_idx=module.padding_idx, device="meta")
        else:
            plain = nn.Linear(vocab.shape[1], vocab.shape[0], bias=False, device="meta")
        plain.weight = weight  # the same Parameter for tied modules: the tie survives the round trip
        _set_module(model, name, plain)


def decompress_model(model: nn.Module) -> nn.Module:
    """Undoes :func:`compress_model` in place: each CompressedLinear becomes an ``nn.Linear`` holding its
    decoded weight (bit for bit the weight it was built from, lossless mode), the block hooks and any fused
    optimizer are removed. Lossy mode raises: its dropped mantissa bits cannot be restored."""
    state = getattr(model, "neuzip", None)
    if not isinstance(state, CompressedWeights):
        raise ValueError("model: not NeuZip-compressed (model.neuzip is not set)")
    if state.config.kept_bits is not None:
        raise ValueError(f"model: lossy NeuZip (mantissa_bits={state.config.mantissa_bits}) dropped mantissa bits "
                         "that cannot be restored; reload the model instead")
    if state.optimizer is not None:
        state.optimizer.remove()
        state.optimizer = None
    for name, weight in state.decoded_weights().items():
        module_name = name[: -len(".weight")]
        compressed = model.get_submodule(module_name)
        linear = nn.Linear(compressed.in_features, compressed.out_features, bias=False, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=name not in state.frozen)
        linear.bias = compressed.bias
        _set_module(model, module_name, linear)
    _restore_vocab(model, state)
    for hook in state.hooks:
        hook.remove()
    del model.neuzip
    return model


# ---------------------------------------------------------------------------------------------- save / load
CHECKPOINT_FILE = "neuzip.safetensors"


def save_compressed(model: nn.Module, path) -> Path:
    """Writes ``path/neuzip.safetensors`` (the codec's checked format: compressed block weights + every other
    tensor plain) and ``path/config.json``; never overwrites an existing checkpoint."""
    from . import format as FMT

    state = getattr(model, "neuzip", None)
    if state is None:
        raise ValueError("model: not compressed (call compress_model first)")
    if state.vocab:
        raise ValueError("model: compressed with NeuZipConfig(vocab=True), whose chunked embedding/lm_head the "
                         "checkpoint format does not hold yet; save it compressed with vocab=False (the default)")
    path = Path(path)
    if (path / CHECKPOINT_FILE).exists():
        raise ValueError(f"path: {path / CHECKPOINT_FILE} exists; refusing to overwrite it")
    entries: dict = dict(state.compressed_tensors())
    seen = set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen and t.numel():  # tied weights: stored once, re-tied by the model on load
            continue
        seen.add(t.data_ptr())
        entries[name] = t.detach().cpu()
    config = _model_config(model)
    config["thrifty_neuzip"] = asdict(state.config)
    path.mkdir(parents=True, exist_ok=True)
    FMT.save(path / CHECKPOINT_FILE, entries)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def _model_config(model: nn.Module) -> dict:
    from ..models import LlamaForCausalLM

    if isinstance(model, LlamaForCausalLM):
        return dict(model.config.to_hf(), thrifty_model="reference")
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        raise ValueError(f"model: cannot save a {type(model).__name__} (neither thrifty's nor a transformers model)")
    return dict(cfg.to_dict(), thrifty_model="transformers")


def is_compressed_checkpoint(path) -> bool:
    return (Path(path) / CHECKPOINT_FILE).is_file()


def load_compressed(path, device="cpu") -> nn.Module:
    """Reads a checkpoint of :func:`save_compressed`; every tensor is checked (format.load), and config.json
    against the tensors' shapes, before the model is returned: a damaged or mismatched checkpoint raises a
    ValueError naming the file. Returns the model with ``model.neuzip`` set, on ``device``."""
    from . import format as FMT

    path = Path(path)
    cfg_path, ckpt_path = path / "config.json", path / CHECKPOINT_FILE
    if not cfg_path.is_file() or not ckpt_path.is_file():
        raise ValueError(f"path: expected a folder with config.json and {CHECKPOINT_FILE}, got {path}")
    entries = FMT.load(ckpt_path, device=device)
    try:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        config = json.loads(cfg_path.read_text())
        if not isinstance(config, dict):
            raise TypeError(f"expected a JSON object, got {type(config).__name__}")
        nz = config.pop("thrifty_neuzip")
        nz.pop("prefetch", None)  # an option of earlier checkpoints (the side-stream decode, removed)
        nz = NeuZipConfig(**nz)
        kind = config.pop("thrifty_model")
        if kind not in ("reference", "transformers"):
            raise ValueError(f"thrifty_model: expected 'reference' or 'transformers', got {kind!r}")
        model = _build_model(config, kind, device)
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as err:
        raise ValueError(f"{cfg_path}: corrupted or not a thrifty NeuZip config ({type(err).__name__}: {err})") from None
    prefix, blocks = find_blocks(model)
    groups, packs = [], []
    for i, block in enumerate(blocks):
        linears = _block_linears(block, f"{prefix}.{i}" if prefix else str(i))
        weights = [entries.get(f"{n}.weight") for n, _ in linears]
        bad = [n for (n, m), w in zip(linears, weights)
               if not isinstance(w, CompressedTensor) or tuple(w.shape) != tuple(m.weight.shape)]
        if bad:  # a config.json that does not describe these weights (they would fail only in forward)
            raise ValueError(f"{ckpt_path}: compressed weights missing or of another shape than {cfg_path.name} "
                             f"says for {bad[:3]}")
        try:
            pack = BlockPack(weights)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{ckpt_path}: block {i}: {err}") from None
        if (pack.mantissa_bits, pack.steps) != (nz.kept_bits, nz.steps) or pack.dtype not in R.DTYPES:
            raise ValueError(f"{ckpt_path}: block {i} is coded with mantissa_bits={pack.mantissa_bits}, "
                             f"steps={pack.steps}, dtype {pack.dtype}; {cfg_path.name} says {nz}")
        groups.append(linears)
        for n, _ in linears:
            entries.pop(f"{n}.weight")
        packs.append(pack)
    plain = {k: v for k, v in entries.items() if isinstance(v, torch.Tensor)}
    expected = model.state_dict()
    wrong = [k for k, v in plain.items() if k in expected and expected[k].shape != v.shape]
    if wrong:
        raise ValueError(f"{ckpt_path}: {wrong[:3]} have other shapes than {cfg_path.name} says")
    if len({p.dtype for p in packs}) != 1:
        raise ValueError(f"{ckpt_path}: blocks of different weight dtypes")
    dtype = packs[0].dtype
    model.to(dtype)
    _install(model, blocks, groups, packs, nz)
    missing, unexpected = model.load_state_dict(plain, strict=False)
    tied = bool(config.get("tie_word_embeddings"))
    missing = [m for m in missing if not (tied and m.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise ValueError(f"{path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model


def _build_model(config: dict, kind: str, device) -> nn.Module:
    if kind == "reference":
        from ..models import LlamaConfig, LlamaForCausalLM

        with torch.device(device):
            return LlamaForCausalLM(LlamaConfig.from_hf(config))
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**config)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config)
