"""transformers (5.x) integration: ``enable_hf(model)`` makes every attention layer of a HF model call
:func:`thrifty.attention.sage_attention`; ``disable_hf(model)`` restores the previous implementation.

transformers looks attention functions up by name in ``AttentionInterface``; the causal mask is built by the
function registered under the *same* name in ``AttentionMaskInterface`` and is silently skipped for names
missing there. We register SDPA's mask builder, which returns ``None`` when the mask is plain causal (no
padding): then the kernel runs causal. When a real mask comes (padding, packed sequences), or dropout is
asked for, the call falls back to transformers' exact SDPA attention: the kernel supports no arbitrary masks.

Options live on the model: ``enable_hf`` stores each attention module's options (its plan's bits included)
on the module itself, so two models in one process keep their own settings (the function registered in
transformers is one for the whole process and reads them from the module it is called with).

Routing per call (see ``routing.py``): a one-row query on CUDA without a mask (a decode step) goes straight
to torch's FlashAttention-2 op (``sage.one_row_flash``: SDPA's cuDNN choice builds a graph per new key
length); calls that need gradients (training) and other queries of 1–16 rows go to transformers' own SDPA (the
quantized forward made a training step slower; the prefill kernel is slower on a few rows), unless the keys
come from a :func:`thrifty.kv.thrifty_kv_cache`, whose packed 8/4/3-bit cache the family's split-K decode
kernel reads directly; on CUDA a prefill call with too little attention work to hide the quantized path's host
time (``routing.HF_MIN_PREFILL_WORK``: a small model's short prompts) goes to transformers' SDPA too; longer
queries go to the quantized prefill kernel.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import torch

from ..kv.decode import DECODE_MAX_ROWS, decode_attention
from ..kv.hf import PACKED_KV_READERS
from .plan import check_plan
from .routing import small_prefill_goes_to_sdpa, training_goes_to_sdpa
from .sage import SageConfig, one_row_flash, one_row_flash_fits, sage_attention
from .seam import sage_options

NAME = "thrifty_sage"
OPTIONS_ATTR = "_thrifty_sage_options"  # per attention module: sage_attention's impl and config for that layer
_sdpa_forward = None  # transformers' SDPA attention, imported on first use


def _sdpa(module, query, key, value, attention_mask, **kw):
    global _sdpa_forward
    if _sdpa_forward is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        _sdpa_forward = sdpa_attention_forward
    return _sdpa_forward(module, query, key, value, attention_mask, **kw)


ROUTES_ATTR = "_thrifty_sage_routes"  # per attention module: Counter of the paths hf_sage_attention took


def _took(module, route: str) -> None:
    counter = module.__dict__.get(ROUTES_ATTR)
    if counter is None:
        counter = module.__dict__[ROUTES_ATTR] = collections.Counter()
    counter[route] += 1


def routes(model) -> dict:
    """{path: calls} that :func:`hf_sage_attention` took on ``model``'s attention modules since they were enabled:
    "sage" (:func:`sage_attention`: the quantized kernels, or the reference off CUDA), "sdpa" (transformers'
    SDPA: masks, dropout, training, 2–16-row queries, small prefill calls), "one_row_flash" (decode steps),
    "packed_kv" (decode over a ``thrifty_kv_cache``). Shows whether the quantized path ran at all."""
    total = collections.Counter()
    for m in model.modules():
        total.update(m.__dict__.get(ROUTES_ATTR, {}))
    return dict(total)


def hf_sage_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    """transformers attention signature: (B, H, S, D) inputs, returns ((B, S, H, D) output, None)."""
    cache = getattr(key, "_thrifty_kv", None)  # keys handed out by thrifty_kv_cache for a decode step
    if cache is not None:
        if attention_mask is None and not (dropout > 0.0 and module.training):
            _took(module, "packed_kv")
            out = decode_attention(query, cache, causal=True, sm_scale=scaling)
            return out.transpose(1, 2).contiguous(), None
        key, value = (x.to(query.dtype) for x in cache.dequantize())  # a real mask: exact SDPA on the cache
    if (attention_mask is None and not (dropout > 0.0 and module.training)
            and one_row_flash_fits(query, key, value)):  # a decode step: not SDPA's cuDNN (see one_row_flash)
        _took(module, "one_row_flash")
        return one_row_flash(query, key, value, scaling).transpose(1, 2).contiguous(), None
    options = module.__dict__.get(OPTIONS_ATTR) or {}
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    impl = options.get("impl", "auto")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if (attention_mask is not None or (dropout > 0.0 and module.training)
            or query.shape[2] <= min(DECODE_MAX_ROWS, key.shape[2])
            or training_goes_to_sdpa(impl, needs_grad)
            or (query.is_cuda and small_prefill_goes_to_sdpa(impl, query.shape[0], query.shape[1], query.shape[2],
                                                             key.shape[2], query.shape[3], bool(causal)))):
        _took(module, "sdpa")
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     is_causal=is_causal, **kwargs)
    _took(module, "sage")
    out = sage_attention(query, key, value, causal=bool(causal), sm_scale=scaling, **options)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Registers :data:`NAME` in transformers' AttentionInterface and AttentionMaskInterface, and as a reader of
    ``thrifty_kv_cache``'s packed codes (:func:`hf_sage_attention` decodes over them)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, hf_sage_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    PACKED_KV_READERS.add(NAME)


def _attention_modules(model):
    """The modules transformers passes to the attention function: those with a ``layer_idx``."""
    return [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
            and not hasattr(m, "self_attn")]


def enable_hf(model, *, plan: Optional[dict] = None, impl: str = "auto", config: Optional[SageConfig] = None) -> None:
    """Switches a transformers model to sage attention. ``impl`` and ``config`` (a :class:`SageConfig`) are
    :func:`sage_attention`'s; ``plan``: {layer index: 4 or 8} (from :func:`~thrifty.attention.calibrate` on the
    same architecture) replaces ``config.qk_bits`` on the layers it names. The options are kept on this model's
    attention modules (calling it again replaces them)."""
    if not hasattr(getattr(model, "config", None), "_attn_implementation"):
        raise TypeError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__} "
                        "(thrifty's own model takes model.set_attention(sage_seam(...)))")
    if plan is not None:
        check_plan(plan)
    options = sage_options(impl, config)
    modules = _attention_modules(model)
    if not modules:
        raise TypeError("model: no attention modules with a layer_idx found (not a transformers decoder?)")
    for m in modules:
        layer_options = dict(options)
        if plan is not None and m.layer_idx in plan:
            layer_options["config"] = dataclasses.replace(options["config"], qk_bits=plan[m.layer_idx])
        m.__dict__[OPTIONS_ATTR] = layer_options
        m.__dict__.pop(ROUTES_ATTR, None)  # routes() counts from here
    register()
    if not hasattr(model, "_thrifty_previous_attn"):
        model._thrifty_previous_attn = model.config._attn_implementation
    _set_implementation(model, NAME)


def disable_hf(model) -> None:
    """Restores the attention implementation the model had before :func:`enable_hf`."""
    previous = getattr(model, "_thrifty_previous_attn", None)
    if previous is None:
        return
    _set_implementation(model, previous)
    for m in _attention_modules(model):
        m.__dict__.pop(OPTIONS_ATTR, None)
        m.__dict__.pop(ROUTES_ATTR, None)
    del model._thrifty_previous_attn


def _set_implementation(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older transformers: the layers read the config at call time
        model.config._attn_implementation = name
