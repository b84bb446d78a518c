"""The reference model's attention seam: :func:`sage_seam` gives ``model.set_attention`` a function of the seam
signature ``fn(q, k, v, *, causal, scale)`` that runs :func:`~thrifty.attention.sage.sage_attention` (or, on a
decode step over a ``thrifty.kv.QuantizedKVCache``, the family's split-K decode over the cache's codes)."""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch.nn.functional as F

from .._checks import check_impl
from ..kv.decode import decode_attention
from ..layers import KEY_MASK_ATTR
from .sage import EXTRA_IMPLS, SageConfig, check_config, sage_attention


def sage_seam(*, impl: str = "auto", config: Optional[SageConfig] = None) -> Callable:
    """An attention function with the reference model's seam signature ``fn(q, k, v, *, causal, scale)``:
    ``model.set_attention(sage_seam(config=SageConfig(qk_bits=4)))``. ``impl`` and ``config`` are
    :func:`sage_attention`'s, checked here rather than at the first forward."""
    options = sage_options(impl, config)
    fn = functools.partial(_seam_call, options=options)
    fn.options = options
    fn.reads_kv_codes = True  # a QuantizedKVCache hands it tagged keys for decode steps (see _seam_call)
    fn.reads_key_mask = True  # a StaticKVCache in graph mode hands it masked keys (see _seam_call)
    return fn


def sage_options(impl, config) -> dict:
    """{"impl", "config"}: :func:`sage_attention`'s keywords of a seam or a transformers layer, checked by name
    when the model is set up (the config is always a SageConfig, the defaults for None)."""
    check_impl(impl, EXTRA_IMPLS)
    return dict(impl=impl, config=check_config(config))


def _seam_call(q, k, v, *, causal, scale, options):
    cache = getattr(k, "_thrifty_kv", None)  # a decode step's keys from a QuantizedKVCache: read its codes
    if cache is not None:
        return decode_attention(q, cache, causal=causal, sm_scale=scale)
    key_mask = getattr(k, KEY_MASK_ATTR, None)  # a static buffer in graph mode: exact attention over its slots
    if key_mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    return sage_attention(q, k, v, causal=causal, sm_scale=scale, **options)


__all__ = ["sage_seam", "sage_options"]
