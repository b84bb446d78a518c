"""Sharded safetensors checkpoints: each rank writes its own shards, rank 0 an index; any number of ranks
(or one plain process) loads them. No pickle anywhere.

Layout of a checkpoint folder written by N ranks::

    sharded_index.json                       format, world size, per tensor: shape, dtype, placement, rows per rank
    model-rank00000-of0000N.safetensors     rank r's rows of every parameter (FSDP2 shards dim 0 as torch.chunk)
    optimizer-rank00000-of0000N.safetensors "param::state" entries (AdamW moments sharded like their parameter;
                                            the step counter replicated)

Loading never materialises a full tensor on a rank that holds only a shard: each target shard reads the row
range it needs from the source files that hold it (``safe_open(...).get_slice``). Every file is opened and its
header checked against the index (names, shapes, dtypes) before anything is copied into the model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._io import crc_metadata, read_json, read_safetensors

FORMAT = "thrifty-sharded-v1"
INDEX = "sharded_index.json"
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                               torch.int32, torch.uint8, torch.int8, torch.bool)}


def _file(kind: str, rank: int, world: int) -> str:
    return f"{kind}-rank{rank:05d}-of{world:05d}.safetensors"


def chunk_rows(n: int, world: int) -> list[tuple[int, int]]:
    """Row range of each rank when dim 0 of size n is split like ``torch.chunk`` (FSDP2's and DTensor's rule)."""
    size = -(-n // world) if n else 0
    return [(min(n, r * size), min(n, (r + 1) * size)) for r in range(world)]


def _layout(t: torch.Tensor) -> tuple[str, torch.Tensor, tuple]:
    """(placement name, this rank's local tensor, global shape)."""
    if not isinstance(t, DTensor):
        return "replicate", t, tuple(t.shape)
    if t.device_mesh.ndim != 1:
        raise ValueError(f"expected DTensors on a 1-D mesh (FSDP2), got a {t.device_mesh.ndim}-D mesh")
    p = t.placements[0]
    if isinstance(p, Replicate):
        return "replicate", t.to_local(), tuple(t.shape)
    if type(p) is Shard and p.dim == 0:
        return "shard0", t.to_local(), tuple(t.shape)
    raise ValueError(f"expected Shard(0) or Replicate placements, got {p}")


def _model_tensors(model: torch.nn.Module) -> dict:
    """Parameters (tied ones once, under their first name) and persistent buffers."""
    persistent = set(model.state_dict().keys())
    out = dict(model.named_parameters())
    out.update({n: b for n, b in model.named_buffers() if n in persistent})
    return out


def _optimizer_tensors(model, optimizer) -> dict:
    if optimizer is None:
        return {}
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value):
                out[f"{names[id(p)]}::{key}"] = value
    return out


def _describe(tensors: dict, world: int, rank: int) -> tuple[dict, dict]:
    """(index entries, local tensors to write) for one kind of file."""
    entries, local = {}, {}
    for name, t in tensors.items():
        placement, loc, shape = _layout(t.detach())
        entry = {"shape": list(shape), "dtype": str(t.dtype), "placement": placement}
        if placement == "shard0":
            rows = chunk_rows(shape[0], world)
            lo, hi = rows[rank]
            if loc.shape[0] != hi - lo:
                raise ValueError(f"{name}: local shard has {loc.shape[0]} rows, expected {hi - lo} (torch.chunk rule)")
            entry["rows"] = [list(r) for r in rows]
        local[name] = loc.contiguous().cpu()
        entries[name] = entry
    return entries, local


def save_sharded(path, model: torch.nn.Module, optimizer=None, *, rank: int = 0, world: int = 1,
                 extra_files: Optional[dict] = None) -> Path:
    """Every rank calls this with its rank and the world size (collective: ends with a barrier when a process
    group is up). ``extra_files`` ({name: text}) are written by rank 0 (trainer state, config)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    index = {"format": FORMAT, "world_size": world, "files": {}}
    for kind, tensors in (("model", _model_tensors(model)), ("optimizer", _optimizer_tensors(model, optimizer))):
        entries, local = _describe(tensors, world, rank)
        index[kind] = entries
        index["files"][kind] = [_file(kind, r, world) for r in range(world)]
        tmp = path / (_file(kind, rank, world) + ".tmp")
        # each tensor's CRC32 in the header: read_index finds flipped bytes (safetensors has no checksum)
        save_file(local, str(tmp), metadata={"format": "pt", "thrifty": FORMAT, **crc_metadata(local)})
        os.replace(tmp, path / _file(kind, rank, world))  # a crash mid-write leaves no valid-looking shard
    if rank == 0:
        for name, text in (extra_files or {}).items():
            (path / name).write_text(text)
        tmp = path / (INDEX + ".tmp")
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, path / INDEX)
    if dist.is_initialized():
        dist.barrier()
    return path


def is_sharded_checkpoint(path) -> bool:
    return (Path(path) / INDEX).is_file()


def read_index(path) -> dict:
    """The index, checked: format, world size, file list, entries; every file's header against it, and its
    tensors against their checksums. Any damage: ValueError naming the file."""
    path = Path(path)
    index = read_json(path / INDEX, "JSON index of a sharded checkpoint")
    try:
        _check_index(path, index)
    except (KeyError, TypeError, AttributeError, IndexError) as err:  # a damaged index of another structure
        raise ValueError(f"{path / INDEX}: malformed index ({type(err).__name__}: {err})") from None
    return index


def _check_index(path: Path, index: dict) -> None:
    from safetensors import safe_open

    if index.get("format") != FORMAT:
        raise ValueError(f"path: {path / INDEX} has format {index.get('format')!r}, expected {FORMAT!r}")
    world = index.get("world_size")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"path: {path / INDEX} has an invalid world_size {world!r}")
    for kind in ("model", "optimizer"):
        files = index["files"][kind]
        if files != [_file(kind, r, world) for r in range(world)]:
            raise ValueError(f"path: {path / INDEX} lists unexpected {kind} files {files[:3]}")
        for r, fname in enumerate(files):
            try:
                with safe_open(str(path / fname), framework="pt") as f:
                    keys = set(f.keys())
                    for name, entry in index[kind].items():
                        if name not in keys:
                            raise ValueError(f"path: {path / fname} lacks {name} ({INDEX} lists it)")
                        if entry["dtype"] not in _DTYPES:
                            raise ValueError(f"path: {path / INDEX}: {name} has unsupported dtype {entry['dtype']}")
                        want = list(entry["shape"])
                        if entry["placement"] == "shard0":
                            lo, hi = entry["rows"][r]
                            want[0] = hi - lo
                        got = list(f.get_slice(name).get_shape())
                        if got != want:
                            raise ValueError(f"path: {path / fname}: {name} has shape {got}, {INDEX} says {want}")
            except ValueError:
                raise
            except Exception as err:  # safetensors raises its own errors for truncated or corrupt files
                raise ValueError(f"path: {path / fname} is missing, truncated or corrupt ({err})") from None
            read_safetensors(path / fname)  # checks the CRC32 of every tensor (ValueError naming the file)


def _read_rows(path: Path, files: list, name: str, entry: dict, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of a tensor (all of it for a replicated one), read from whichever shards hold them."""
    from safetensors import safe_open

    if entry["placement"] == "replicate":
        with safe_open(str(path / files[0]), framework="pt") as f:
            t = f.get_tensor(name)
        return t if t.ndim == 0 else t[lo:hi]
    parts = []
    for r, (s, e) in enumerate(entry["rows"]):
        a, b = max(lo, s), min(hi, e)
        if a < b:
            with safe_open(str(path / files[r]), framework="pt") as f:
                parts.append(f.get_slice(name)[a - s:b - s])
    if not parts:
        shape = list(entry["shape"])
        shape[0] = 0
        return torch.empty(shape, dtype=_DTYPES[entry["dtype"]])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _target_rows(target: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(lo, hi, local tensor to fill) of a model/optimizer tensor on this rank."""
    placement, local, shape = _layout(target)
    if placement == "shard0":
        mesh = target.device_mesh
        lo, hi = chunk_rows(shape[0], mesh.size())[mesh.get_local_rank()]
        return lo, hi, local
    return 0, shape[0] if shape else 0, local


@torch.no_grad()
def load_sharded(path, model: torch.nn.Module, optimizer=None) -> dict:
    """Loads a checkpoint of :func:`save_sharded` into ``model`` (sharded on any number of ranks, or plain) and
    the optimizer's state; returns the index. Raises ValueError before touching the model when files are
    missing/corrupt or names and shapes disagree."""
    path = Path(path)
    index = read_index(path)
    targets = _model_tensors(model)
    if set(targets) != set(index["model"]):
        missing, unexpected = sorted(set(targets) - set(index["model"])), sorted(set(index["model"]) - set(targets))
        raise ValueError(f"checkpoint {path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, t in targets.items():
        if list(t.shape) != index["model"][name]["shape"]:
            raise ValueError(f"checkpoint {path}: {name} has shape {index['model'][name]['shape']}, "
                             f"the model {list(t.shape)}")
    params = dict(model.named_parameters())
    if optimizer is not None:  # checked before the model is touched: no half-restored state
        for key, entry in index["optimizer"].items():
            name, _, field = key.partition("::")
            if name not in params or not field:
                raise ValueError(f"checkpoint {path}: optimizer state for unknown parameter {name}")
            scalar = entry["placement"] == "replicate" and entry["shape"] == []
            if not scalar and entry["shape"] != list(params[name].shape):
                raise ValueError(f"checkpoint {path}: {key} has shape {entry['shape']}, parameter "
                                 f"{list(params[name].shape)}")
    files = index["files"]["model"]
    for name, t in targets.items():
        lo, hi, local = _target_rows(t.detach())
        local.copy_(_read_rows(path, files, name, index["model"][name], lo, hi))
    if optimizer is not None:
        files = index["files"]["optimizer"]
        for key, entry in index["optimizer"].items():
            name, field = key.split("::")
            p = params[name]
            state = optimizer.state[p]
            if entry["placement"] == "replicate" and entry["shape"] == []:  # AdamW's step counter
                value = _read_rows(path, files, key, entry, 0, 0)
                on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
                state[field] = value.to(p.device if on_device else "cpu")
                continue
            value = torch.zeros_like(p.detach(), dtype=_DTYPES[entry["dtype"]])
            lo, hi, local = _target_rows(value)
            local.copy_(_read_rows(path, files, key, entry, lo, hi))
            state[field] = value
    return index


def consolidate(path, out) -> Path:
    """Writes the full tensors of a sharded checkpoint's model to ``out/model.safetensors`` (one process, no
    process group), with the checkpoint's config.json when there is one: a folder ``from_pretrained`` reads."""
    from safetensors.torch import save_file

    path, out = Path(path), Path(out)
    if out.resolve() == path.resolve():
        raise ValueError("out: must differ from path (an output never overwrites its input)")
    index = read_index(path)
    full = {name: _read_rows(path, index["files"]["model"], name, entry, 0, entry["shape"][0] if entry["shape"] else 0)
            for name, entry in index["model"].items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in full.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    if (path / "config.json").is_file():
        (out / "config.json").write_text((path / "config.json").read_text())
    return out
