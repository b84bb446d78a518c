"""``thrifty.optimize(model, config)``, ``thrifty.undo(model)`` and ``thrifty.describe(model)``: the one place
where the techniques meet. Each technique's package stays usable alone; this module only calls their public
functions, in the order of :data:`~thrifty.compose.config.APPLY_ORDER`, and records how to take each one off.

Like torchao's ``quantize_``: in place, after loading (and after ``.to(device, dtype)``) and before
``torch.compile``. What was applied lives on the model: ``model.thrifty_config`` (the validated config) and
``model._thrifty_undo`` (how to take it off); nothing is process-wide but the names registered with transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import torch
import torch.nn as nn

from .config import OptimizeConfig, LowBitKVConfig

CONFIG_ATTR = "thrifty_config"
UNDO_ATTR = "_thrifty_undo"  # [(technique, function that takes it off)], in the order applied
IMPL_ATTR = "_thrifty_impl"  # the implementation chosen when optimize ran (THRIFTY_IMPL may change later)
CACHE_ATTR = "_thrifty_last_cache"  # the cache the wrapped generate built last (describe reads it)
PACKED_FROM_ATTR = "_thrifty_packed_from"  # the BitLinears pack_bitnet replaced, kept for undo (describe reads them)


# ------------------------------------------------------------------------------------------------ public
def optimize(model: nn.Module, config) -> nn.Module:
    """Puts the techniques of ``config`` (an :class:`OptimizeConfig` or a preset name: "train-memory",
    "train-bitnet", "serve-long-context", "serve-small", "serve-bitnet") on ``model`` in place and returns it.

    ``model``: a transformers causal LM of the Llama family (``.model.layers``, ``.lm_head``) or thrifty's
    :class:`~thrifty.models.LlamaForCausalLM`. Refused with the reason (TypeError/ValueError naming the argument):
    a second call on the same model (``thrifty.undo`` it first), a compiled model, combinations that cannot work
    (see :mod:`thrifty.compose.config`), sizes the model does not have. If one technique fails, those applied
    before it are taken off again, so the model is left as it came.

    One second call is the way from training to serving: on a model an earlier call put BitNet on (e.g.
    "train-bitnet", then training), a config with ``pack_bitnet`` ("serve-bitnet") takes that call's techniques
    off but the BitLinear layers, which it packs; ``thrifty.undo`` afterwards gives back the BitLinear model."""
    config = as_config(config)
    kind = _model_kind(model)
    ending = _refuse_reapplying(model, config)
    layers = _decoder_layers(model)
    _check_against_model(config, model, kind, len(layers))
    impl = config.resolved_impl()
    ended = _end_bitnet_call(model) if ending else None
    model.__dict__[UNDO_ATTR] = []
    try:
        for name in config.techniques:
            undo_fn = _APPLY[name](model, config, kind, layers, impl)
            model.__dict__[UNDO_ATTR].append((name, undo_fn))
    except BaseException:
        _take_off(model)
        if ended is not None:
            _resume_bitnet_call(model, ended, kind, layers)
        raise
    model.__dict__[CONFIG_ATTR] = config
    model.__dict__[IMPL_ATTR] = impl
    return model


def undo(model: nn.Module) -> nn.Module:
    """Takes off everything :func:`optimize` put on ``model``, in reverse order, and returns it: the same modules,
    weights (bit for bit, unless trained since), forward, generate and attention implementation as before.
    Lossy NeuZip cannot be undone (its mantissa bits are gone): ValueError, and the model is left untouched."""
    config = model.__dict__.get(CONFIG_ATTR) if isinstance(model, nn.Module) else None
    if config is None:
        raise ValueError("model: thrifty.optimize was not applied to it (no model.thrifty_config)")
    if config.neuzip is not None and config.neuzip.kept_bits is not None:
        raise ValueError(f"model: lossy NeuZip (mantissa_bits={config.neuzip.mantissa_bits}) dropped weight bits "
                         "that cannot be restored; reload the model instead")
    _take_off(model)
    del model.__dict__[CONFIG_ATTR]
    model.__dict__.pop(IMPL_ATTR, None)
    return model


def describe(model: nn.Module) -> str:
    """What :func:`optimize` put on ``model``: per technique, where it is and what it does, measured on this
    model now (bytes of its weights, attention calls per path, the last generate's cache)."""
    config = model.__dict__.get(CONFIG_ATTR) if isinstance(model, nn.Module) else None
    if config is None:
        return "thrifty: nothing applied (thrifty.optimize was not called on this model)"
    lines = [f"thrifty.optimize: {', '.join(config.techniques)} (impl={model.__dict__[IMPL_ATTR]}, "
             f"training={config.training})"]
    for name in config.techniques:
        lines.append(f"  {name:9s} " + _DESCRIBE[name](model, config))
    return "\n".join(lines)


def as_config(config) -> OptimizeConfig:
    if isinstance(config, OptimizeConfig):
        return config
    if isinstance(config, str):
        return OptimizeConfig.preset(config)
    raise TypeError(f"config: expected an OptimizeConfig or a preset name, got {type(config).__name__}")


# ------------------------------------------------------------------------------------------------ checks
def _model_kind(model) -> str:
    from ..models import LlamaForCausalLM

    if type(model).__name__ == "OptimizedModule":  # it forwards attribute reads to the model it wraps
        raise TypeError("model: already torch.compile'd; call thrifty.optimize before torch.compile "
                        "(compiled graphs would keep the old layers)")
    if isinstance(model, LlamaForCausalLM):
        return "reference"
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    is_hf = hasattr(getattr(model, "config", None), "_attn_implementation")
    if is_hf and hasattr(model, "model") and hasattr(model, "lm_head"):
        return "transformers"
    raise TypeError(f"model: expected a transformers *ForCausalLM (.model, .lm_head) or "
                    f"thrifty.models.LlamaForCausalLM, got {type(model).__name__}")


def _refuse_reapplying(model, config: OptimizeConfig) -> bool:
    """True when this call ends an earlier call's BitNet (``pack_bitnet`` after BitNet: see :func:`optimize`)."""
    if getattr(model, "_compiled_call_impl", None) is not None:
        raise ValueError("model: already compiled with model.compile(); call thrifty.optimize before compiling "
                         "(compiled graphs would keep the old layers)")
    previous = model.__dict__.get(CONFIG_ATTR)
    if previous is None:
        return False
    if config.pack_bitnet and previous.bitnet is not None:
        return True
    raise ValueError("model: thrifty.optimize was already applied (model.thrifty_config is set); call "
                     "thrifty.undo(model) first, then optimize with the new config"
                     + (" (pack_bitnet follows only a call that put BitNet on)" if config.pack_bitnet else ""))


def _decoder_layers(model) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise TypeError(f"model: expected its decoder layers at model.model.layers, {type(model).__name__} has none")
    return layers


def _check_against_model(config: OptimizeConfig, model, kind: str, n_layers: int) -> None:
    plan = config.attention.plan if config.attention is not None else None
    for name, indices in (("skip_layers", config.skip_layers), ("attention.plan", sorted(plan or ()))):
        bad = [i for i in indices if i >= n_layers]
        if bad:
            raise ValueError(f"{name}: layers {bad} do not exist (the model has {n_layers})")
    if config.bitnet is not None and any(type(m).__name__ == "BitLinear" for m in model.modules()):
        raise ValueError("bitnet: the model already has BitLinear layers; change their recipe with "
                         "thrifty.bitnet.convert instead")
    if config.pack_bitnet:
        _check_packable(model)
    kv = config.kv_cache
    if kv is not None and not isinstance(kv, LowBitKVConfig):
        from ..kvcache.cache import model_shape

        _, kv_heads, head_dim = model_shape(model)
        kv.check_model(kv_heads, head_dim)


def _check_packable(model) -> None:
    """pack_bitnet's own rules (a model packed already, a model without BitLinear layers), then thrifty.bitnet's
    check of every layer (the one bitnet.pack runs), all before any technique is applied."""
    from .. import bitnet

    if any(isinstance(m, bitnet.PackedBitLinear) for m in model.modules()):
        raise ValueError("pack_bitnet: the model's BitNet layers are packed already (PackedBitLinear, e.g. from "
                         "thrifty.bitnet.load or LlamaForCausalLM.from_packed); leave pack_bitnet off")
    if not any(isinstance(m, bitnet.BitLinear) for m in model.modules()):
        raise ValueError("pack_bitnet: the model has no BitLinear layer to pack. Packing serves a trained BitNet "
                         "model: train one first (the \"train-bitnet\" preset, or thrifty.bitnet.convert and "
                         "training). A pretrained full-precision model made ternary without retraining loses what "
                         "it knew (see thrifty.bitnet.convert): that is not serving a BitNet model")
    bitnet.check_packable(model, name="pack_bitnet")


# ------------------------------------------------------------------------------------------------ apply
def _take_off(model) -> None:
    steps = model.__dict__.pop(UNDO_ATTR, [])
    for _, undo_fn in reversed(steps):
        undo_fn()


def _end_bitnet_call(model):
    """Takes off an earlier call's techniques but BitNet, whose BitLinears stay as the model's own layers; returns
    what :func:`_resume_bitnet_call` needs to put that call back."""
    steps = model.__dict__.pop(UNDO_ATTR)
    for name, undo_fn in reversed(steps):
        if name != "bitnet":
            undo_fn()
    kept = [step for step in steps if step[0] == "bitnet"]
    return model.__dict__.pop(CONFIG_ATTR), model.__dict__.pop(IMPL_ATTR), kept


def _resume_bitnet_call(model, ended, kind, layers) -> None:
    """Puts back the call :func:`_end_bitnet_call` ended (this call failed): its other techniques re-applied."""
    config, impl, steps = ended
    for name in config.techniques:
        if name != "bitnet":
            steps.append((name, _APPLY[name](model, config, kind, layers, impl)))
    model.__dict__.update({UNDO_ATTR: steps, CONFIG_ATTR: config, IMPL_ATTR: impl})


def _apply_bitnet(model, config, kind, layers, impl):
    from .. import bitnet

    cfg = config.bitnet
    if impl != "auto":
        cfg = dataclasses.replace(cfg, impl=impl)
    eps = getattr(model.config, "rms_norm_eps", None)
    if eps is not None:
        cfg = dataclasses.replace(cfg, norm_eps=eps)  # the sub-norms match the model's own RMSNorms
    for i, layer in enumerate(layers):
        if i not in config.skip_layers:
            bitnet.convert(layer, cfg)
    return functools.partial(bitnet.revert, model)


def _apply_pack_bitnet(model, config, kind, layers, impl):
    """``bitnet.pack``, then ``bitnet.stack_projections`` where q/k/v or gate/up all packed. The BitLinears it
    replaces are kept for undo, on the CPU: packing is there to free the device's memory."""
    from .. import bitnet
    from ..bitnet.stacked import SIBLINGS

    children = [(parent, dict(parent._modules)) for parent in model.modules()]  # what undo puts back
    originals = [m for m in model.modules() if isinstance(m, bitnet.BitLinear)]
    devices = [m.weight.device for m in originals]

    def take_off():
        model.__dict__.pop(PACKED_FROM_ATTR, None)
        for m, device in zip(originals, devices):
            m.to(device)
        for parent, kids in children:
            if any(parent._modules.get(k) is not v for k, v in kids.items()) or len(parent._modules) != len(kids):
                parent._modules.clear()
                parent._modules.update(kids)

    try:
        bitnet.pack(model, impl=impl)
        if any(all(isinstance(getattr(parent, n, None), bitnet.PackedBitLinear) for n in names)
               for parent in model.modules() for names in SIBLINGS.values()):
            bitnet.stack_projections(model)
        for m in originals:
            m.to("cpu")
    except BaseException:
        take_off()
        raise
    model.__dict__[PACKED_FROM_ATTR] = originals
    return take_off


def _apply_neuzip(model, config, kind, layers, impl):
    from .. import neuzip
    from ..optim import LomoConfig

    cfg = config.neuzip if impl == "auto" else dataclasses.replace(config.neuzip, impl=impl)
    # compressed weights have no .grad: training runs through the fused per-layer update (LOMO)
    train = (config.lomo or LomoConfig()) if config.training else None
    neuzip.compress_model(model, config=cfg, train=train)
    return functools.partial(neuzip.decompress_model, model)


def _apply_cce(model, config, kind, layers, impl):
    options = dict(config.cce.loss_options(), impl=impl)
    if kind == "reference":
        from ..loss import linear_cross_entropy

        previous = model.loss_fn
        model.set_loss(functools.partial(linear_cross_entropy, **options))
        return functools.partial(model.set_loss, previous)
    from ..loss.hf import patch_causal_lm

    had_forward = "forward" in model.__dict__
    previous = model.__dict__.get("forward")
    patch_causal_lm(model, **options)

    def unpatch():
        model.__dict__.pop("_thrifty_stock_forward", None)
        if had_forward:
            model.forward = previous
        else:
            del model.__dict__["forward"]
    return unpatch


def _apply_attention(model, config, kind, layers, impl):
    cfg = config.attention
    if kind == "reference":
        return _apply_reference_attention(model, cfg, layers, config.skip_layers, impl)
    from ..attention import SageConfig
    from ..attention.hf import OPTIONS_ATTR, disable_hf, enable_hf

    plan = {i: cfg.bits_of(i) for i in range(len(layers))}
    enable_hf(model, plan=plan, impl=impl, config=SageConfig(pv=cfg.pv))
    for m in model.modules():  # skipped layers keep exact attention: the dispatcher sends them to SDPA
        if m.__dict__.get(OPTIONS_ATTR) is not None and getattr(m, "layer_idx", None) in config.skip_layers:
            del m.__dict__[OPTIONS_ATTR]
    restore_dispatch = _install_dispatch(model)

    def take_off():
        restore_dispatch()
        disable_hf(model)
    return take_off


def _apply_reference_attention(model, cfg, layers, skip_layers, impl):
    from ..attention import SageConfig, sage_seam

    previous = [layer.self_attn.attention for layer in layers]
    for i, layer in enumerate(layers):
        if i not in skip_layers:
            layer.self_attn.attention = sage_seam(impl=impl, config=SageConfig(qk_bits=cfg.bits_of(i), pv=cfg.pv))

    def take_off():
        for layer, fn in zip(layers, previous):
            layer.self_attn.attention = fn
    return take_off


def _install_dispatch(model):
    """Switches the model to the dispatcher (see dispatch.py); returns what switches it back."""
    from ..kvcache.hf import ROUTES_SHADOWKV_ATTR
    from . import dispatch

    previous = model.config._attn_implementation
    dispatch.register()
    model.set_attn_implementation(dispatch.NAME)
    model.__dict__[ROUTES_SHADOWKV_ATTR] = True

    def restore():
        model.set_attn_implementation(previous)
        model.__dict__.pop(ROUTES_SHADOWKV_ATTR, None)
        for m in model.modules():
            m.__dict__.pop(dispatch.CALLS_ATTR, None)
    return restore


def _apply_kv_cache(model, config, kind, layers, impl):
    if kind == "reference":
        return _apply_reference_kv_cache(model, config, impl, layers)
    restore_dispatch = None
    if config.attention is None:  # the dispatcher is in place already when attention is on
        restore_dispatch = _install_dispatch(model)
    had_generate = "generate" in model.__dict__
    stock_generate = model.generate
    make_cache = functools.partial(_new_cache, config.kv_cache, impl)

    def generate(self, *args, past_key_values=None, **kwargs):
        """transformers' generate, with the cache thrifty.optimize configured unless one is passed."""
        if past_key_values is None:
            past_key_values = make_cache(self)
            self.__dict__[CACHE_ATTR] = past_key_values
        return stock_generate(*args, past_key_values=past_key_values, **kwargs)

    model.generate = types.MethodType(generate, model)

    def take_off():
        model.__dict__.pop(CACHE_ATTR, None)
        _forget_shadowkv_marks(model)
        if had_generate:
            model.generate = stock_generate
        else:
            del model.__dict__["generate"]
        if restore_dispatch is not None:
            restore_dispatch()
    return take_off


def _forget_shadowkv_marks(model) -> None:
    """The per-module notes a ShadowKVCache leaves on the attention modules (see kvcache/hf.py)."""
    from ..kvcache.hf import PENDING_ATTR, PREVIOUS_ATTR

    for m in model.modules():
        m.__dict__.pop(PENDING_ATTR, None)
        m.__dict__.pop(PREVIOUS_ATTR, None)


def _apply_reference_kv_cache(model, config, impl, layers):
    """thrifty.models.generate builds the model's ``thrifty_cache_factory`` when given no cache_factory."""
    from ..models.generate import CACHE_FACTORY_ATTR

    kv_config = config.kv_cache
    # the sage seams of quantized attention read the int8 codes in decode; a skipped layer's exact attention
    # could not (it needs the dequantized K/V of every position), so then every layer gets those
    reads_codes = config.attention is not None and not config.skip_layers

    # a ShadowKV cache wraps each layer's attention function in its dispatch when built: taken off with the rest
    previous = [layer.self_attn.attention for layer in layers]

    def factory():
        model.__dict__[CACHE_ATTR] = _new_cache(kv_config, impl, model, reference_reads_codes=reads_codes)
        return model.__dict__[CACHE_ATTR]

    model.__dict__[CACHE_FACTORY_ATTR] = factory

    def take_off():
        model.__dict__.pop(CACHE_FACTORY_ATTR, None)
        model.__dict__.pop(CACHE_ATTR, None)
        for layer, fn in zip(layers, previous):
            layer.self_attn.attention = fn
    return take_off


def _new_cache(kv_config, impl, model, reference_reads_codes=None):
    """``reference_reads_codes``: None for a transformers model, else whether the reference model's attention
    seams read the low-bit cache's codes."""
    if isinstance(kv_config, LowBitKVConfig):
        return _new_low_bit_cache(kv_config, model, reference_reads_codes)
    from ..kvcache import ShadowKVCache

    return ShadowKVCache(model, kv_config, impl=impl)


def _new_low_bit_cache(kv_config, model, reference_reads_codes):
    """The same quantized K/V per layer (:class:`~thrifty.kv.QuantizedKV`) behind each model's own cache seam: a
    transformers Cache for transformers' generate, the reference model's ``update(layer_idx, k, v, positions,
    rope)`` cache for thrifty.models.generate."""
    if reference_reads_codes is not None:
        from ..kv import QuantizedKVCache

        return QuantizedKVCache(bits=kv_config.bits, reads_codes=reference_reads_codes)
    from ..kv import thrifty_kv_cache

    return thrifty_kv_cache(model, bits=kv_config.bits)


_APPLY = {"bitnet": _apply_bitnet, "pack_bitnet": _apply_pack_bitnet, "neuzip": _apply_neuzip, "cce": _apply_cce,
          "attention": _apply_attention, "kv_cache": _apply_kv_cache}


# ------------------------------------------------------------------------------------------------ describe
def _mb(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.1f} MB"


def _describe_bitnet(model, config) -> str:
    from ..bitnet.pack import padded_k

    layers = [m for m in model.modules() if type(m).__name__ == "BitLinear"]
    params = sum(m.weight.numel() for m in layers)
    source = sum(m.weight.numel() * torch.empty((), dtype=m.source_dtype).element_size() for m in layers)
    alphas = sum(len(m.weight_splits) if m.weight_splits else 1 for m in layers)  # fp32, one per sub-matrix
    packed = sum(m.out_features * padded_k(m.in_features) // 4 for m in layers) + 4 * alphas
    return (f"recipe {config.bitnet.recipe}: {len(layers)} BitLinear layers, {params / 1e6:.1f} M weights "
            f"({_mb(source)} as loaded -> {_mb(packed)} packed 2-bit for serving: \"serve-bitnet\" once trained); "
            f"layers kept full precision: {list(config.skip_layers) or 'none'} and the LM head")


def _describe_pack_bitnet(model, config) -> str:
    from ..bitnet import PackedBitLinear
    from ..bitnet.packed import packed_weight_bytes
    from ..bitnet.stacked import SIBLINGS

    originals = model.__dict__[PACKED_FROM_ATTR]
    packed = [(n, m) for n, m in model.named_modules() if isinstance(m, PackedBitLinear)]
    stacked = sum(n.rpartition(".")[2] in SIBLINGS for n, _ in packed)
    before = sum(m.weight.numel() * m.weight.element_size() for m in originals)
    bf16 = sum(m.weight.numel() * 2 for m in originals)
    after = sum(packed_weight_bytes(m) for _, m in packed)
    dtypes = "/".join(sorted({str(m.weight.dtype).removeprefix("torch.") for m in originals}))
    return (f"{len(originals)} BitLinear layers packed 2-bit into {len(packed)} PackedBitLinear ({stacked} of them "
            f"stacked q/k/v or gate/up): linear weights {_mb(before)} ({dtypes} latent) -> {_mb(after)} "
            f"(x{after / before:.3f}; x{after / bf16:.3f} of {_mb(bf16)} in bf16); the BitLinears are kept on "
            "the CPU for thrifty.undo")


def _describe_neuzip(model, config) -> str:
    mem = model.neuzip.memory()
    trained = "trained with the fused optimizer" if model.neuzip.optimizer is not None else "inference"
    return (f"{config.neuzip.mode} (mantissa_bits={config.neuzip.mantissa_bits}): {len(mem['blocks'])} blocks, "
            f"{_mb(mem['original_bytes'])} -> {_mb(mem['compressed_bytes'])} "
            f"(x{mem['ratio_vs_original']:.3f}) + {_mb(mem['buffer_bytes'])} decode buffers; {trained}")


def _describe_cce(model, config) -> str:
    vocab = model.lm_head.weight.shape[0]
    return (f"loss without logits in training steps with labels: saves {vocab} x 4 bytes = "
            f"{_mb(vocab * 4 * 1024)} per 1024 tokens (fp32 logits, vocab {vocab})")


def _describe_attention(model, config) -> str:
    cfg = config.attention
    n = len(_decoder_layers(model))
    on = [i for i in range(n) if i not in config.skip_layers]
    bits = sorted({cfg.bits_of(i) for i in on})
    text = f"quantized on layers {on} (qk_bits {bits}, pv {cfg.pv})"
    if _model_kind(model) == "transformers":
        from .dispatch import attention_calls

        text += f"; calls so far {attention_calls(model) or 'none'}"
    return text


def _describe_kv_cache(model, config) -> str:
    kv = config.kv_cache
    cache = model.__dict__.get(CACHE_ATTR)
    if isinstance(kv, LowBitKVConfig):
        text = f"int{kv.bits} KV cache in generate (half the bytes of bf16 K/V)"
        return text + ("" if cache is None else f"; last generate cached {_cached_tokens(cache)} tokens")
    text = (f"ShadowKV in generate (rank {kv.rank}, budget {kv.sparse_budget} tokens, prompts >= "
            f"{kv.min_prompt_len} compressed)")
    if cache is not None:
        state = "dense (prompt too short)" if cache.dense else \
            f"compressed, {_mb(cache.host_bytes_per_sequence())} of values on the host per sequence"
        text += f"; last generate: {state}, steps {cache.engine.stats}"
    return text


def _cached_tokens(cache) -> int:
    # a transformers Cache counts with get_seq_length, the reference model's QuantizedKVCache with len
    get_seq_length = getattr(cache, "get_seq_length", None)
    return get_seq_length() if get_seq_length is not None else len(cache)


_DESCRIBE = {"bitnet": _describe_bitnet, "pack_bitnet": _describe_pack_bitnet, "neuzip": _describe_neuzip,
             "cce": _describe_cce, "attention": _describe_attention, "kv_cache": _describe_kv_cache}
