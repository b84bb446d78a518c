"""Whole-model export of a trained BitNet model with packed ternary weights, and its checked load.

One safetensors file. Every :class:`BitLinear` (or :class:`PackedBitLinear`, or sibling of a projection that
:func:`~thrifty.bitnet.stack_projections` stacked: written as its own layer) ``name`` becomes ``name.packed``
(uint8, the kernels' 2-bit layout) or ``name.base3`` (uint8, 5 weights per byte: 20 % smaller on disk),
``name.alpha`` (fp32 per sub-matrix) and, if the layer has them, ``name.bias`` and ``name.norm.weight``; every
other tensor of the model's state (embeddings, norms, LM head) is stored as it is, a tensor tied to another one
once. The header holds the format, each packed layer's settings and shape, the recipe, the reference model's
config when the model is a ``thrifty.models.LlamaForCausalLM`` (:func:`read_header` + :func:`packed_factory`
rebuild it without full-precision ternary layers), a CRC32 per tensor and one of the header itself.

:func:`load` reads and checks the whole file before it touches any module: unreadable, truncated or
non-safetensors files, a missing or wrong format, a checksum mismatch (corruption), layer settings or tensor
shapes that do not agree, base-3 bytes that are not codes, and a model whose modules or state do not match the
file are all refused with a ValueError naming the file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch
import torch.nn as nn

from .._checks import check_choice, check_impl
from .._io import CRC_KEY, atomic_path, check_output_path, check_state_matches, crc_metadata, read_safetensors
from .bitlinear import BitLinear, SharedInput
from .pack import pack_base3, padded_k, unpack_base3, pack_ternary
from .packed import PACKABLE, PackedBitLinear, check_layer_packable
from .recipes import SHARED_INPUT_GROUPS, recipe_of
from .stacked import ProjectionSlice

FORMAT = "thrifty.bitnet.packed/1"
STORAGES = ("2bit", "base3")
HEADER_CRC_KEY = "thrifty.header_crc32"  # CRC32 of the header's other entries (the tensor CRCs cover the tensors)
LAYER_FIELDS = {"in_features": int, "out_features": int, "activation": str, "beta_scale": float,
                "topk_ratio": float, "splits": list, "bias": bool, "sub_norm": bool, "norm_eps": float}


def _stacked_layers(model: nn.Module) -> dict:
    """{name: PackedBitLinear} of the stacked projections of ``model`` (``stack_projections``)."""
    ids = {id(m.stacked_layer) for m in model.modules() if isinstance(m, ProjectionSlice)}
    return {n: m for n, m in model.named_modules() if id(m) in ids}


def check_packable(model: nn.Module, *, name: str = "model") -> None:
    """Checks that every BitLinear of ``model`` packs to its own outputs (:func:`pack` and :func:`export` do, before
    they convert any layer): ValueError naming the first layer that does not (an activation without integer codes,
    FP4; a strength below 1), ``name`` leading the message. PackedBitLinear layers pass; a model without any
    BitLinear passes too (each caller words that refusal)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    for layer_name, module in model.named_modules():
        if isinstance(module, BitLinear):
            check_layer_packable(module, f"{name}: {layer_name}")


def _packed_layers(model: nn.Module) -> dict:
    """{name: PackedBitLinear} of every BitLinear / PackedBitLinear of ``model`` (BitLinears packed now, after
    every one was checked; siblings that shared a quantized input keep sharing it; a stacked projection's siblings
    as their own layers again, the stacked layer left out)."""
    check_packable(model)
    stacked = {id(m) for m in _stacked_layers(model).values()}
    layers, shared = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, ProjectionSlice):
            layers[name] = module.unstacked()
        elif isinstance(module, PackedBitLinear) and id(module) not in stacked:
            layers[name] = module
        elif isinstance(module, BitLinear):
            layers[name] = PackedBitLinear.from_bitlinear(module)
            group = module.shared_input
            if group is not None and module.norm is None:
                layers[name].shared_input = shared.setdefault(id(group), SharedInput(group.members))
    return layers


def pack(model: nn.Module, *, impl: str = "auto") -> nn.Module:
    """Replaces every BitLinear of ``model`` by its :class:`PackedBitLinear` in place (inference only); returns it.
    Every layer is checked (:func:`check_packable`) before any is converted: a refusal leaves the model as it was."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    check_impl(impl)
    layers = _packed_layers(model)
    if not layers:
        raise ValueError("model: it has no BitLinear layer to pack")
    for name, layer in layers.items():
        layer.impl = impl
        parent, leaf = _parent(model, name)
        setattr(parent, leaf, layer)
    return model


def _layer_record(layer: PackedBitLinear) -> dict:
    return dict(in_features=layer.in_features, out_features=layer.out_features, activation=layer.activation,
                beta_scale=layer.beta_scale, topk_ratio=layer.topk_ratio, splits=list(layer.splits),
                bias=layer.bias is not None, sub_norm=layer.norm is not None,
                norm_eps=layer.norm.eps if layer.norm is not None else 1e-5)


def _other_state(model: nn.Module, layer_names) -> tuple[dict, dict]:
    """({name: tensor} of the state outside the packed layers, each storage once; {dropped alias: kept name})."""
    prefixes = tuple(n + "." for n in layer_names)
    state, aliases, seen = {}, {}, {}
    for name, t in model.state_dict(keep_vars=False).items():
        if name.startswith(prefixes):
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        state[name] = t.detach().cpu().contiguous()
    return state, aliases


def export(model: nn.Module, path, *, storage: str = "2bit") -> Path:
    """Writes ``model`` (its BitLinears packed, the rest as is) to the safetensors file ``path``; returns the path."""
    from safetensors.torch import save_file

    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    check_choice("storage", storage, STORAGES)
    path = check_output_path("path", path)
    layers = _packed_layers(model)
    if not layers:
        raise ValueError("model: it has no BitLinear layer to pack (convert it with thrifty.bitnet.convert and train it)")
    tensors = {}
    for name, layer in layers.items():
        if storage == "base3":
            tensors[f"{name}.base3"] = pack_base3(layer.ternary().cpu())
        else:
            tensors[f"{name}.packed"] = layer.packed.detach().cpu().contiguous()
        tensors[f"{name}.alpha"] = layer.alpha.detach().cpu().contiguous()
        if layer.bias is not None:
            tensors[f"{name}.bias"] = layer.bias.detach().cpu().contiguous()
        if layer.norm is not None:
            tensors[f"{name}.norm.weight"] = layer.norm.weight.detach().cpu().contiguous()
    other, aliases = _other_state(model, [*layers, *_stacked_layers(model)])
    tensors.update(other)
    meta = {"format": FORMAT, "storage": storage, "recipe": recipe_of(layers),
            "layers": json.dumps({n: _layer_record(m) for n, m in layers.items()}), "aliases": json.dumps(aliases),
            **crc_metadata(tensors)}
    config = getattr(model, "config", None)
    # the reference model's dataclass config, recognised by name: thrifty.models imports bitnet, not the reverse
    if is_dataclass(config) and type(config).__name__ == "LlamaConfig":
        meta["model_config"] = json.dumps(asdict(config))
    meta[HEADER_CRC_KEY] = str(_header_crc(meta))
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return path


def _header_crc(meta: dict) -> int:
    import zlib

    body = json.dumps({k: v for k, v in meta.items() if k != HEADER_CRC_KEY}, sort_keys=True)
    return zlib.crc32(body.encode())


# ------------------------------------------------------------------------------------------------- load

def _header(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata() or {}


def _json_field(path: Path, meta: dict, key: str, default=None):
    if key not in meta:
        if default is not None:
            return default
        raise ValueError(f"{path}: the header has no {key!r} (not a thrifty BitNet export)")
    try:
        return json.loads(meta[key])
    except json.JSONDecodeError:
        raise ValueError(f"{path}: corrupted {key!r} in the header") from None


def _check_record(path: Path, name: str, rec) -> dict:
    if not isinstance(rec, dict) or set(rec) != set(LAYER_FIELDS):
        raise ValueError(f"{path}: layer {name!r}: expected the fields {sorted(LAYER_FIELDS)}, got {rec!r}")
    for field, kind in LAYER_FIELDS.items():
        value = rec[field]
        ok = isinstance(value, kind) or (kind is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok or (kind is int and (isinstance(value, bool) or value < 1)):
            raise ValueError(f"{path}: layer {name!r}: {field} = {value!r} is not a valid {kind.__name__}")
    if rec["activation"] not in PACKABLE:
        raise ValueError(f"{path}: layer {name!r}: activation {rec['activation']!r} is not one of {list(PACKABLE)}")
    splits = rec["splits"]
    if not splits or not all(isinstance(s, int) and s >= 1 for s in splits) or sum(splits) != rec["out_features"]:
        raise ValueError(f"{path}: layer {name!r}: splits {splits} do not add up to out_features")
    return rec


def _expected_layer_tensors(name: str, rec: dict, storage: str) -> dict:
    """{tensor name: (dtype, shape)} a layer record implies."""
    n, k = rec["out_features"], rec["in_features"]
    want = {f"{name}.alpha": (torch.float32, (len(rec["splits"]),))}
    if storage == "base3":
        want[f"{name}.base3"] = (torch.uint8, (-(-(n * k) // 5),))
    else:
        want[f"{name}.packed"] = (torch.uint8, (n, padded_k(k) // 4))
    if rec["bias"]:
        want[f"{name}.bias"] = (torch.float32, (n,))
    if rec["sub_norm"]:
        want[f"{name}.norm.weight"] = (None, (k,))  # the norm weight keeps the model's dtype
    return want


def _check_header(path: Path, meta: dict) -> None:
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r} (not a thrifty BitNet export)")
    if CRC_KEY not in meta or HEADER_CRC_KEY not in meta:
        raise ValueError(f"{path}: the header has no checksums; refusing unchecked weights")
    if meta[HEADER_CRC_KEY] != str(_header_crc(meta)):
        raise ValueError(f"{path}: header checksum mismatch (file corrupted)")
    if meta.get("storage") not in STORAGES:
        raise ValueError(f"{path}: unknown storage {meta.get('storage')!r}, expected one of {list(STORAGES)}")


def _read_checked(path) -> tuple[dict, dict, dict, dict]:
    """(tensors, layer records, aliases, header) of an export, every check done (module doc)."""
    path = Path(path)
    tensors = read_safetensors(path)  # missing / unreadable / truncated / not safetensors / CRC mismatch
    meta = _header(path)
    _check_header(path, meta)
    storage = meta["storage"]
    records = _json_field(path, meta, "layers")
    aliases = _json_field(path, meta, "aliases", default={})
    if not isinstance(records, dict) or not records or not isinstance(aliases, dict):
        raise ValueError(f"{path}: corrupted layer table in the header")
    layer_tensors = {}
    for name, rec in records.items():
        for tname, (dtype, shape) in _expected_layer_tensors(name, _check_record(path, name, rec), storage).items():
            t = tensors.get(tname)
            if t is None:
                raise ValueError(f"{path}: tensor {tname!r} of layer {name!r} is missing")
            if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
                raise ValueError(f"{path}: tensor {tname!r} is {t.dtype} {tuple(t.shape)}, layer {name!r} needs "
                                 f"{dtype} {shape}")
            layer_tensors[tname] = t
    if storage == "base3":  # decode now: a byte that is no base-3 code is corruption, found before any use
        for name, rec in records.items():
            codes = unpack_base3(tensors.pop(f"{name}.base3"), (rec["out_features"], rec["in_features"]))
            tensors[f"{name}.packed"] = pack_ternary(codes)
    return tensors, records, aliases, meta


def read_header(path) -> dict:
    """The checked header of an export: ``format``, ``storage``, ``recipe``, ``layers`` ({name: settings and
    shape}) and ``model_config`` (the reference model's LlamaConfig fields, or None). Reads no tensor."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: missing (expected a .safetensors file)")
    try:
        meta = _header(path)
    except Exception as err:  # noqa: BLE001 - any failure to parse means an unusable file
        raise ValueError(f"{path}: not a readable safetensors file ({type(err).__name__}: {err})") from None
    _check_header(path, meta)
    records = _json_field(path, meta, "layers")
    for name, rec in records.items():
        _check_record(path, name, rec)
    config = _json_field(path, meta, "model_config", default=None) if "model_config" in meta else None
    return {"format": meta["format"], "storage": meta["storage"], "recipe": meta.get("recipe"), "layers": records,
            "model_config": config}


def packed_factory(header: dict, *, impl: str = "auto"):
    """A Linear-seam factory (``LlamaForCausalLM(config, linear=...)``) building empty :class:`PackedBitLinear`
    shells for the layers of ``header`` (from :func:`read_header`) and ``nn.Linear`` for the others, so a model
    to :func:`load` into never allocates full-precision weights for its ternary layers."""
    if not isinstance(header, dict) or not isinstance(header.get("layers"), dict):
        raise TypeError("header: expected the dict read_header returns")
    check_impl(impl)
    layers = header["layers"]
    shared: dict = {}  # (parent, sibling group) -> their SharedInput
    by_suffix: dict = {}  # the seam names a layer inside its model ("layers.0.self_attn.q_proj" for "model.layers...")
    for full in layers:
        parts = full.split(".")
        for i in range(len(parts)):
            by_suffix.setdefault(".".join(parts[i:]), []).append(full)

    def record(name: str):
        found = by_suffix.get(name, [])
        if len(found) > 1:
            raise ValueError(f"header: layer name {name!r} matches {found}; build the model with full names")
        return (found[0], layers[found[0]]) if found else (None, None)

    def factory(in_features: int, out_features: int, *, name: str) -> nn.Module:
        full, rec = record(name)
        if rec is None:
            return nn.Linear(in_features, out_features, bias=False)
        layer = PackedBitLinear(in_features, out_features, activation=rec["activation"], beta_scale=rec["beta_scale"],
                                topk_ratio=rec["topk_ratio"], splits=rec["splits"], bias=rec["bias"],
                                sub_norm=rec["sub_norm"], norm_eps=rec["norm_eps"], impl=impl)
        parent, _, leaf = full.rpartition(".")
        group = next((g for g in SHARED_INPUT_GROUPS if leaf in g), None)
        members = [n for n in group or () if f"{parent}.{n}" in layers and not layers[f"{parent}.{n}"]["sub_norm"]]
        if leaf in members and len(members) > 1:
            layer.shared_input = shared.setdefault((parent, group), SharedInput(len(members)))
        return layer

    return factory


def _parent(model: nn.Module, name: str):
    parent_name, _, leaf = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), leaf


def _check_target(path: Path, model: nn.Module, name: str, rec: dict) -> None:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"{path}: layer {name!r} does not exist in the model (file and model do not match)") from None
    if not isinstance(module, (nn.Linear, BitLinear, PackedBitLinear)):
        raise ValueError(f"{path}: model module {name!r} is a {type(module).__name__}, expected a linear layer")
    if (module.in_features, module.out_features) != (rec["in_features"], rec["out_features"]):
        raise ValueError(f"{path}: layer {name!r} is {rec['in_features']}→{rec['out_features']} in the file, "
                         f"{module.in_features}→{module.out_features} in the model")


def _new_layer(rec: dict, tensors: dict, name: str, impl: str) -> PackedBitLinear:
    layer = PackedBitLinear(rec["in_features"], rec["out_features"], activation=rec["activation"],
                            beta_scale=rec["beta_scale"], topk_ratio=rec["topk_ratio"], splits=rec["splits"],
                            bias=rec["bias"], sub_norm=rec["sub_norm"], norm_eps=rec["norm_eps"], impl=impl)
    with torch.no_grad():
        layer.packed.copy_(tensors[f"{name}.packed"])
        layer.alpha.copy_(tensors[f"{name}.alpha"])
        if rec["bias"]:
            layer.bias.copy_(tensors[f"{name}.bias"])
        if rec["sub_norm"]:
            layer.norm.weight.data = tensors[f"{name}.norm.weight"].clone()
    return layer


def load(path, model: nn.Module, *, device=None) -> nn.Module:
    """Loads an :func:`export` file into ``model`` (same architecture) and returns it: its linear layers named in
    the file become (or, if already, are filled as) :class:`PackedBitLinear`, the rest of its state is loaded.
    Every check runs before the model is touched. For the reference model, build it without full-precision
    ternary layers::

        head = bitnet.read_header(path)
        model = LlamaForCausalLM(LlamaConfig(**head["model_config"]), linear=bitnet.packed_factory(head),
                                 activation=bitnet.relu_squared)
        bitnet.load(path, model)

    A transformers model after ``bitnet.convert`` works as well. ``device``: where the model goes afterwards."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    path = Path(path)
    tensors, records, aliases, meta = _read_checked(path)
    for name, rec in records.items():
        _check_target(path, model, name, rec)
    layer_keys = {k for name in records for k in _expected_layer_tensors(name, records[name], "2bit")}
    prefixes = tuple(n + "." for n in records)
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes)}
    other = {k: v for k, v in tensors.items() if k not in layer_keys}
    check_state_matches(path, other, expected, optional=tuple(aliases))
    # every check passed: only now is the model changed
    here = next((t.device for t in expected.values()), torch.device("cpu"))
    for name, rec in records.items():
        parent, leaf = _parent(model, name)
        old = getattr(parent, leaf)
        shell = isinstance(old, PackedBitLinear)
        layer = _new_layer(rec, tensors, name, old.impl if shell else "auto").to(here)
        layer.shared_input = old.shared_input if shell and layer.norm is None else None  # packed_factory's groups
        setattr(parent, leaf, layer)
    for alias, kept in aliases.items():  # a model that does not tie them gets the tensor twice
        if alias in expected and kept in other:
            other[alias] = other[kept]
    model.load_state_dict(other, strict=False)
    if device is not None:
        model.to(device)
    return model
