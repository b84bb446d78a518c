"""Whole compressed models on disk: ``save_compressed`` writes ``neuzip.safetensors`` (the codec's checked format,
:mod:`thrifty.neuzip.format`) and ``config.json``; ``load_compressed`` reads them back, checked, into a model
with ``model.neuzip`` set."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn as nn

from . import reference as R
from .block_decode import BlockPack
from .config import NeuZipConfig
from .convert import _block_linears, _install, find_blocks, set_vocab_module
from .tensor import CompressedTensor

CHECKPOINT_FILE = "neuzip.safetensors"


def save_compressed(model: nn.Module, path) -> Path:
    """Writes ``path/neuzip.safetensors`` (the codec's checked format: compressed block weights + every other
    tensor plain) and ``path/config.json``; never overwrites an existing checkpoint."""
    from . import format as FMT

    state = getattr(model, "neuzip", None)
    if state is None:
        raise ValueError("model: not compressed (call compress_model first)")
    path = Path(path)
    if (path / CHECKPOINT_FILE).exists():
        raise ValueError(f"path: {path / CHECKPOINT_FILE} exists; refusing to overwrite it")
    entries: dict = dict(state.compressed_tensors())
    vocab_layout = _vocab_entries(state, entries)
    seen = set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen and t.numel():  # tied weights: stored once, re-tied by the model on load
            continue
        seen.add(t.data_ptr())
        entries[name] = t.detach().cpu()
    config = _model_config(model)
    config["thrifty_neuzip"] = asdict(state.config)
    if vocab_layout:
        config["thrifty_neuzip_vocab"] = vocab_layout
    path.mkdir(parents=True, exist_ok=True)
    FMT.save(path / CHECKPOINT_FILE, entries)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def _vocab_entries(state, entries: dict) -> dict:
    """Adds the coded vocabulary's chunks to ``entries`` as ``<module>.weight.chunk<i>`` (a tied matrix once,
    under its first module's name) and returns their layout for config.json ({} without a coded vocabulary)."""
    matrices, modules, keys = {}, {}, {}
    for name, vocab in state.vocab.items():
        if id(vocab) not in keys:
            key = keys[id(vocab)] = f"{name}.weight"
            matrices[key] = {"shape": list(vocab.shape), "chunk_rows": vocab.chunk_rows, "chunks": len(vocab.packs)}
            for i, pack in enumerate(vocab.packs):
                entries[f"{key}.chunk{i}"] = pack.tensor(0)
        modules[name] = keys[id(vocab)]
    return {"modules": modules, "matrices": matrices} if modules else {}


def _load_vocab(model: nn.Module, nz: NeuZipConfig, layout: dict, entries: dict, ckpt_path: Path) -> None:
    """Installs the coded vocabulary of a checkpoint (layout from config.json, chunks from ``entries``), each
    chunk checked against the layout, the codec settings and the model's decode buffer before anything runs."""
    from .vocab import CompressedVocab, find_vocab

    state = model.neuzip
    made = {}
    try:
        for key, meta in layout["matrices"].items():
            V, D = meta["shape"]
            rows, n = int(meta["chunk_rows"]), int(meta["chunks"])
            if rows * D > state.buffers[0].numel():
                raise ValueError(f"{key}: chunks of {rows} rows do not fit the block decode buffer")
            chunks = [entries.pop(f"{key}.chunk{i}", None) for i in range(n)]
            if not all(isinstance(c, CompressedTensor) for c in chunks):
                raise ValueError(f"{key}: coded chunks missing")
            packs = [BlockPack([c]) for c in chunks]
            if any((p.mantissa_bits, p.steps) != (nz.kept_bits, nz.steps) for p in packs):
                raise ValueError(f"{key}: coded with other mantissa bits or steps than {nz}")
            made[key] = CompressedVocab.from_packs(packs, (V, D), rows)
        modules = dict(layout["modules"])
        expected = {n for n in find_vocab(model) if n is not None}
        if set(modules) != expected or not set(modules.values()) <= set(made):
            raise ValueError(f"coded modules {sorted(modules)}, the model has {sorted(expected)}")
        for name, key in modules.items():
            if tuple(model.get_submodule(name).weight.shape) != made[key].shape:
                raise ValueError(f"{name}: shape {tuple(model.get_submodule(name).weight.shape)}, coded "
                                 f"{made[key].shape}")
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(f"{ckpt_path}: coded vocabulary does not match config.json ({type(err).__name__}: "
                         f"{err})") from None
    for name, key in modules.items():
        set_vocab_module(model, state, name, made[key])


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
        vocab_layout = config.pop("thrifty_neuzip_vocab", None)
        if bool(vocab_layout) != nz.vocab:
            raise ValueError(f"thrifty_neuzip_vocab: {'missing' if nz.vocab else 'present'}, but vocab={nz.vocab}")
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
    if nz.vocab:
        _load_vocab(model, nz, vocab_layout, entries, ckpt_path)
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
