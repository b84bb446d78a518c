"""ShadowKV's transformers side: the attention function registered under :data:`ATTN_NAME` and the per-layer
view of the cache that transformers' ``Cache`` machinery holds.

Why an attention function as well as a cache: the decode step needs the query to select chunks, and a cache's
``update`` never sees it. So the cache marks the attention module of the layer it just updated, and the
attention function registered under :data:`ATTN_NAME` (transformers ``AttentionInterface``, with SDPA's mask
builder under the same name in ``AttentionMaskInterface``) finds the mark and hands the query to the cache.
Calls without a mark (another cache, no cache, a dense ShadowKV cache) run the attention the model had before the
switch when it takes SDPA's masks (quantized attention, say), else plain SDPA, so the switch is safe to leave on a
model. The mark lives on the model's own modules: nothing process-wide but the name.

transformers gives caches post-RoPE keys; the prefill un-rotates them with the model's own rotary embedding
(:func:`find_rotary`; exact up to rounding, RoPE being a rotation) before the SVD.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..kv.hf import cache_layer_base

ATTN_NAME = "thrifty_shadowkv"
PENDING_ATTR = "_thrifty_shadowkv_pending"
PREVIOUS_ATTR = "_thrifty_shadowkv_previous"  # per attention module: the implementation before the switch
# set True on a model whose attention implementation routes ShadowKV's marked calls itself (see
# cache.ShadowKVCache._setup_model)
ROUTES_SHADOWKV_ATTR = "_thrifty_routes_shadowkv"


def shadowkv_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                       scaling: Optional[float] = None, is_causal: Optional[bool] = None, *,
                       prefill_attention: Optional[Callable] = None, **kwargs):
    """transformers attention signature. With a ShadowKV mark on ``module``: the cache's prefill or sparse decode;
    otherwise transformers' SDPA. ``prefill_attention`` (an attention function of the same signature, default
    SDPA) computes the prefill's output while the cache compresses the prompt's keys and values: a caller that
    routes ShadowKV's calls itself (``thrifty.optimize``'s dispatcher) passes quantized attention there."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cache = module.__dict__.pop(PENDING_ATTR, None)
    if cache is None:
        attention = _previous_attention(module) or sdpa_attention_forward
        return attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = module.layer_idx
    if cache.engine.compressed(layer):
        out = cache.engine.decode(layer, query, key, value, scale)
        return out.transpose(1, 2).contiguous(), None
    out = (prefill_attention or sdpa_attention_forward)(module, query, key, value, attention_mask, dropout=dropout,
                                                        scaling=scaling, is_causal=is_causal, **kwargs)
    cache._compress_hf(layer, key, value, attention_mask, kwargs.get("position_ids"), query=query)
    return out


def _previous_attention(module):
    """The attention function the model ran before a ShadowKVCache switched it (e.g. quantized attention), for
    the calls ShadowKV does not take; None when it was SDPA or eager, or when it needs a mask of another shape
    than SDPA's (the mask builder registered for ShadowKV), e.g. flash attention: those calls run SDPA."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = module.__dict__.get(PREVIOUS_ATTR)
    if name in (None, "sdpa", ATTN_NAME) or name not in ALL_ATTENTION_FUNCTIONS:
        return None
    if ALL_MASK_ATTENTION_FUNCTIONS.get(name) is not sdpa_mask:
        return None
    return ALL_ATTENTION_FUNCTIONS[name]


def register_attention() -> None:
    """Registers :data:`ATTN_NAME` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, shadowkv_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def _cache_base():
    try:
        from transformers.cache_utils import Cache
        return Cache
    except ImportError:  # pragma: no cover - transformers is a dependency; keep the reference model usable
        return object


class ShadowKVLayer(cache_layer_base()):
    """One layer's view for transformers' ``Cache`` machinery; the work is done by the owning cache."""

    cache_name = "ShadowKVCache"

    def __init__(self, owner: "ShadowKVCache", layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner._update_hf(self, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.owner.logical_length(self.layer_idx)


def find_rotary(model):
    for name, m in model.named_modules():
        if name.endswith("rotary_emb"):
            return m
    raise ValueError("model: no rotary embedding module (…rotary_emb) found; ShadowKV needs RoPE to un-rotate keys")


def valid_keys(mask, B: int, T: int, device) -> torch.Tensor:
    """(B, T) bool: which prompt keys are real. The mask is SDPA's (B, 1, Q, T) (True = attend; its last query
    row sees every real key) or None (no padding)."""
    if mask is None:
        return torch.ones(B, T, dtype=torch.bool, device=device)
    last = mask[:, 0, -1, -T:]
    return last if last.dtype == torch.bool else last == 0
