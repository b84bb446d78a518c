"""One transformers attention function for a model that :func:`thrifty.optimize` changed: it runs ShadowKV,
quantized attention and the int8 KV cache together, where each technique's own registration would replace the
others (a ShadowKV ``generate`` used to leave a model on plain SDPA for good).

Per call, by what the module carries (all of it on the model's own modules, nothing process-wide but the name):
a ShadowKV mark (the cache just updated this layer) -> ShadowKV, whose prefill output comes from quantized
attention on a quantized layer (ShadowKV only compresses the prompt); quantized-attention options (layers not in
``skip_layers``) -> :func:`thrifty.attention.hf.hf_sage_attention`, which also reads the int8 cache; otherwise
transformers' SDPA, over the dequantized int8 cache when the keys come from one (a layer without quantized
attention cannot read its packed codes). ``module._thrifty_attention_calls`` counts the calls per path.
"""

from __future__ import annotations

import collections

NAME = "thrifty"
CALLS_ATTR = "_thrifty_attention_calls"


def thrifty_attention(module, query, key, value, attention_mask, **kwargs):
    from ..attention.hf import OPTIONS_ATTR, hf_sage_attention
    from ..kvcache.hf import PENDING_ATTR, shadowkv_attention

    calls = module.__dict__.setdefault(CALLS_ATTR, collections.Counter())
    quantized = OPTIONS_ATTR in module.__dict__
    cache = module.__dict__.get(PENDING_ATTR)
    if cache is not None:
        calls["shadowkv"] += 1
        prefill = None
        if quantized and not cache.engine.compressed(module.layer_idx):  # the prompt: quantized prefill
            calls["quantized"] += 1
            prefill = hf_sage_attention
        return shadowkv_attention(module, query, key, value, attention_mask, prefill_attention=prefill, **kwargs)
    if quantized:
        calls["quantized"] += 1
        return hf_sage_attention(module, query, key, value, attention_mask, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kv = getattr(key, "_thrifty_kv", None)  # a decode step's new keys, tagged by the int8 cache for its readers
    if kv is not None:
        dtype = key.dtype
        key, value = (x.to(dtype) for x in kv.dequantize())  # what the cache hands any other attention
    calls["sdpa"] += 1
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    """Registers :data:`NAME` with transformers (idempotent), with SDPA's mask builder: the mask is built exactly
    as for SDPA, so padding and causal masks reach every path."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from ..kv.hf import PACKED_KV_READERS

    AttentionInterface.register(NAME, thrifty_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    PACKED_KV_READERS.add(NAME)  # quantized layers read the packed cache through hf_sage_attention


def attention_calls(model) -> dict:
    """{path: calls} summed over the model's attention modules."""
    total = collections.Counter()
    for m in model.modules():
        total.update(m.__dict__.get(CALLS_ATTR, {}))
    return dict(total)
