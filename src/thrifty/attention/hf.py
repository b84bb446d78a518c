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

Routing per call (see ``routing.py``): 1–16 query rows go to transformers' own SDPA (the prefill kernel is
slower there), unless the keys come from a :func:`thrifty_kv_cache`, whose packed 8/4/3-bit cache the split-K
decode kernel reads directly; longer queries go to the quantized prefill kernel.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .plan import check_plan
from .sage import sage_attention
from .seam import check_sage_options
from .kv_cache import QuantizedKV
from .routing import DECODE_MAX_ROWS

NAME = "thrifty_sage"
# attention implementations that read a thrifty_kv_cache's packed codes through hf_sage_attention (a dispatcher
# that forwards to it registers its name here); under any other the cache hands out dequantized K/V
INT8_KV_READERS = {NAME}
OPTIONS_ATTR = "_thrifty_sage_options"  # per attention module: sage_attention keywords for that layer
_sdpa_forward = None  # transformers' SDPA attention, imported on first use


def _sdpa(module, query, key, value, attention_mask, **kw):
    global _sdpa_forward
    if _sdpa_forward is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        _sdpa_forward = sdpa_attention_forward
    return _sdpa_forward(module, query, key, value, attention_mask, **kw)


def hf_sage_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    """transformers attention signature: (B, H, S, D) inputs, returns ((B, S, H, D) output, None)."""
    cache = getattr(key, "_thrifty_kv", None)  # keys handed out by thrifty_kv_cache for a decode step
    if cache is not None:
        if attention_mask is None and not (dropout > 0.0 and module.training):
            from .decode import decode_attention
            out = decode_attention(query, cache, causal=True, sm_scale=scaling)
            return out.transpose(1, 2).contiguous(), None
        key, value = (x.to(query.dtype) for x in cache.dequantize())  # a real mask: exact SDPA on the cache
    if (attention_mask is not None or (dropout > 0.0 and module.training)
            or query.shape[2] <= min(DECODE_MAX_ROWS, key.shape[2])):
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    options = module.__dict__.get(OPTIONS_ATTR) or {}
    out = sage_attention(query, key, value, causal=bool(causal), sm_scale=scaling, **options)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Registers :data:`NAME` in transformers' AttentionInterface and AttentionMaskInterface."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, hf_sage_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def _attention_modules(model):
    """The modules transformers passes to the attention function: those with a ``layer_idx``."""
    return [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
            and not hasattr(m, "self_attn")]


def enable_hf(model, *, plan: Optional[dict] = None, **options) -> None:
    """Switches a transformers model to sage attention. ``plan``: {layer index: 4 or 8} (from
    :func:`~thrifty.attention.calibrate` on the same architecture); ``options``: sage_attention keywords.
    The options are kept on this model's attention modules (calling it again replaces them)."""
    if not hasattr(getattr(model, "config", None), "_attn_implementation"):
        raise TypeError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__} "
                        "(thrifty's own model takes model.set_attention(sage_seam(...)))")
    if plan is not None:
        check_plan(plan)
    check_sage_options(options)
    modules = _attention_modules(model)
    if not modules:
        raise TypeError("model: no attention modules with a layer_idx found (not a transformers decoder?)")
    for m in modules:
        layer_options = dict(options)
        if plan is not None and m.layer_idx in plan:
            layer_options["qk_bits"] = plan[m.layer_idx]
        m.__dict__[OPTIONS_ATTR] = layer_options
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
    del model._thrifty_previous_attn


def _set_implementation(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older transformers: the layers read the config at call time
        model.config._attn_implementation = name


# ---------------------------------------------------------------------------------------- quantized cache
@functools.lru_cache(maxsize=None)
def _layer_class():
    from transformers.cache_utils import CacheLayerMixin

    class QuantizedKVLayer(CacheLayerMixin):
        """One layer of :func:`thrifty_kv_cache`: a :class:`QuantizedKV` (packed codes, per-token scales).

        ``update`` returns the prompt's own K/V on the first call (the prefill kernel quantizes them its own
        way); for a decode step of ≤ 16 tokens while the model runs thrifty attention, the new tokens' K/V
        tagged with the cache (read by :func:`hf_sage_attention` only: the decode kernel walks the packed
        cache); otherwise the whole dequantized cache, which any attention function can use."""

        is_sliding = False
        is_compileable = False
        is_croppable = False

        def __init__(self, config=None, bits: int = 8, **kwargs):
            super().__init__()
            self.config, self.bits = config, bits
            self.kv: Optional[QuantizedKV] = None

        def lazy_initialization(self, key_states, value_states):
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if self.kv is None:
                from .kv_cache import quantize_kv_cache
                self.kv = quantize_kv_cache(key_states, value_states, bits=self.bits,
                                            capacity=key_states.shape[2] + 256)
                return key_states, value_states
            self.kv.append(key_states, value_states)
            if key_states.shape[2] <= DECODE_MAX_ROWS and self.config._attn_implementation in INT8_KV_READERS:
                key_states._thrifty_kv = self.kv
                return key_states, value_states
            return tuple(x.to(self.dtype) for x in self.kv.dequantize())

        def get_seq_length(self) -> int:
            return 0 if self.kv is None else self.kv.length

        def get_mask_sizes(self, query_length: int):
            return self.get_seq_length() + query_length, 0

        def get_max_length(self) -> int:
            return -1

        def reset(self) -> None:
            self.kv = None

        def reorder_cache(self, beam_idx):
            raise NotImplementedError("thrifty_kv_cache: beam search is not supported")

    return QuantizedKVLayer


def thrifty_kv_cache(model, bits: int = 8):
    """A transformers ``Cache`` for ``model`` keeping post-RoPE K/V as packed unsigned ``bits``-bit codes with
    per-token-per-head absmax scales (``kv_cache.py``; bytes vs bf16 at head_dim 128: 0.52× at 8 bits, 0.27× at
    4, 0.20× at 3): ``model.generate(ids, past_key_values=thrifty_kv_cache(model, bits=3))``. While the model
    runs thrifty attention (:func:`enable_hf`), decode steps read the packed cache with the split-K decode
    kernel; otherwise the cache hands out dequantized K/V."""
    from transformers.cache_utils import Cache

    from .kv_cache import check_bits
    check_bits(bits)
    if not hasattr(model, "config"):
        raise TypeError(f"model: expected a transformers model, got {type(model).__name__}")
    return Cache(layer_class_to_replicate=functools.partial(_layer_class(), config=model.config, bits=bits))
