"""NeuZip inside a model: ``compress_model(model, mode, mantissa_bits)`` keeps every block's linear weights
compressed; ``decompress_model`` undoes it.

* The model's repeated blocks are found as its largest ``nn.ModuleList`` of modules holding ``nn.Linear``s
  (``model.model.layers`` in the reference model and in transformers' Llama family). Each block's linear
  weights become one :class:`~thrifty.neuzip.block_decode.BlockPack`; each ``nn.Linear`` is replaced by a
  :class:`~thrifty.neuzip.linear.CompressedLinear` that holds no weight, only (block, slot). Linears outside
  the blocks (``lm_head``) and the embedding stay as they are: see ``NOTES.md`` ("embedding and lm_head") for
  why, and ``NeuZipConfig(vocab=True)`` (:mod:`thrifty.neuzip.vocab`) to code them too, for serving.
* ``model.neuzip`` (:class:`~thrifty.neuzip.state.CompressedWeights`) holds the packs, the decode buffers,
  ``memory()`` and ``stats``; a forward pre-hook on each block decodes it (:mod:`thrifty.neuzip.state` says how).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..optim import LomoConfig, lomo
from . import reference as R
from .block_decode import pack_tensors
from .config import NeuZipConfig
from .linear import CompressedLinear
from .state import CompressedWeights


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
    from .vocab import CompressedVocab, find_vocab

    by_weight: dict = {}
    for name in find_vocab(model):
        if name is None:
            continue
        w = model.get_submodule(name).weight
        if id(w) not in by_weight:
            by_weight[id(w)] = CompressedVocab(w, state.buffers[0].numel() // w.shape[1], config.kept_bits,
                                               config.steps)
        set_vocab_module(model, state, name, by_weight[id(w)])


def set_vocab_module(model: nn.Module, state: "CompressedWeights", name: str, vocab) -> None:
    """Replaces the embedding or lm_head ``name`` by its module over the coded matrix ``vocab``."""
    from .vocab import CompressedEmbedding, CompressedHead

    module = model.get_submodule(name)
    state.vocab[name] = vocab
    if isinstance(module, nn.Embedding):
        new = CompressedEmbedding(vocab, state, module.padding_idx)
    else:
        new = CompressedHead(vocab, state)
    new.__dict__["frozen"] = not module.weight.requires_grad
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
