"""transformers (5.x) side of the family: one cache-layer base for every thrifty cache inside transformers'
``Cache``, and the quantized cache built on it (:func:`thrifty_kv_cache`).

A thrifty cache owns its storage (a preallocated static buffer, not transformers' growing ``keys``/``values``),
so its layer only records the dtype and device transformers asks about, answers the mask questions from the
cache's own length, and refuses beam search (reordering would have to move the cache's storage, which no
thrifty cache does). :func:`cache_layer_base` is that shared code; ShadowKV's layer (``thrifty.kvcache.hf``)
and :class:`QuantizedKVLayer` derive from it. transformers is imported on first use, not with ``thrifty.kv``.

The quantized layer hands decode steps to the attention function that reads packed codes: it tags the new
tokens' keys with the cache (``key_states._thrifty_kv``) when the model's attention implementation is in
:data:`PACKED_KV_READERS` (``thrifty.attention.enable_hf`` registers its name there, and so does a dispatcher
that forwards to it); under any other the cache hands out dequantized K/V.
"""

from __future__ import annotations

import functools
from typing import Optional

from .decode import DECODE_MAX_ROWS
from .quantized import QuantizedKV, check_bits, quantize_kv_cache

# attention implementations (transformers names) that read a thrifty_kv_cache's packed codes from the tagged keys
PACKED_KV_READERS: set = set()


@functools.lru_cache(maxsize=None)
def cache_layer_base():
    """The ``CacheLayerMixin`` subclass every thrifty cache layer derives from (built on first use). A subclass
    gives ``update``, ``get_seq_length`` and ``reset``, and names its cache in ``cache_name`` for errors."""
    from transformers.cache_utils import CacheLayerMixin

    class StaticCacheLayer(CacheLayerMixin):
        """One layer of a thrifty cache whose storage the cache object owns (see the module docstring)."""

        is_compileable = False
        is_sliding = False
        is_croppable = False
        cache_name = "this cache"

        def lazy_initialization(self, key_states, value_states) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.get_seq_length() + query_length, 0

        def get_max_length(self) -> int:
            return -1

        def reorder_cache(self, beam_idx):
            raise NotImplementedError(f"{self.cache_name}: beam search is not supported")

    return StaticCacheLayer


@functools.lru_cache(maxsize=None)
def _quantized_layer_class():
    class QuantizedKVLayer(cache_layer_base()):
        """One layer of :func:`thrifty_kv_cache`: a :class:`QuantizedKV` (packed codes, per-token scales).

        ``update`` returns the prompt's own K/V on the first call (the prefill kernel quantizes them its own
        way); for a decode step of ≤ 16 tokens while the model runs an attention in :data:`PACKED_KV_READERS`,
        the new tokens' K/V tagged with the cache (the decode kernel walks the packed cache); otherwise the
        whole dequantized cache, which any attention function can use."""

        cache_name = "thrifty_kv_cache"

        def __init__(self, config=None, bits: int = 8, **kwargs):
            super().__init__()
            self.config, self.bits = config, bits
            self.kv: Optional[QuantizedKV] = None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if self.kv is None:
                self.kv = quantize_kv_cache(key_states, value_states, bits=self.bits,
                                            capacity=key_states.shape[2] + 256)
                return key_states, value_states
            self.kv.append(key_states, value_states)
            if key_states.shape[2] <= DECODE_MAX_ROWS and self.config._attn_implementation in PACKED_KV_READERS:
                key_states._thrifty_kv = self.kv
                return key_states, value_states
            return tuple(x.to(self.dtype) for x in self.kv.dequantize())

        def get_seq_length(self) -> int:
            return 0 if self.kv is None else self.kv.length

        def reset(self) -> None:
            self.kv = None

    return QuantizedKVLayer


def thrifty_kv_cache(model, bits: int = 8):
    """A transformers ``Cache`` for ``model`` keeping post-RoPE K/V as packed unsigned ``bits``-bit codes with
    per-token-per-head absmax scales (``quantized.py``; bytes vs bf16 at head_dim 128: 0.52× at 8 bits, 0.27×
    at 4, 0.20× at 3): ``model.generate(ids, past_key_values=thrifty_kv_cache(model, bits=3))``. While the model
    runs thrifty attention (``thrifty.attention.enable_hf``), decode steps read the packed cache with the
    split-K decode kernel; otherwise the cache hands out dequantized K/V."""
    from transformers.cache_utils import Cache

    check_bits(bits)
    if not hasattr(model, "config"):
        raise TypeError(f"model: expected a transformers model, got {type(model).__name__}")
    return Cache(layer_class_to_replicate=functools.partial(_quantized_layer_class(), config=model.config, bits=bits))


__all__ = ["thrifty_kv_cache", "cache_layer_base", "PACKED_KV_READERS"]
