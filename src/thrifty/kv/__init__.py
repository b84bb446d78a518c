"""The KV-cache family: the caches thrifty decodes over and the one split-K decode kernel that reads them.
Infrastructure below the techniques: quantized attention (``thrifty.attention``), BitNet a4.8's 3/4-bit KV and
ShadowKV (``thrifty.kvcache``) build on it; it imports none of them.

    from thrifty.kv import decode_attention, quantize_kv_cache
    cache = quantize_kv_cache(k, v, bits=4)                 # (B, Hkv, S, D) post-RoPE keys and values
    out = decode_attention(q, cache)                        # q (B, H, 1..16, D); GQA when H > Hkv

``QuantizedKV`` is a preallocated static cache of packed 8/4/3-bit codes with per-token-per-head scales;
``QuantizedKVCache(bits)`` puts one per layer behind the reference model's cache seam,
``thrifty_kv_cache(model, bits)`` behind transformers' ``generate``. ``StaticKVCache(capacity)``: 16-bit K/V in
fixed buffers for the reference model's CUDA-graph decode (``generate(..., cuda_graph=True)``). ShadowKV's static buffer of bf16 rows with
a validity byte per row decodes with the same kernel (``decode_kernel.masked_decode_attention``).

Modules: ``quantized`` (the cache layout and its quantizer), ``decode`` (the decode API and its reference),
``decode_kernel`` (the split-K kernel, its merge, the append kernel), ``seam`` (the reference model's cache),
``hf`` (transformers: the cache-layer base every thrifty cache layer derives from, ``thrifty_kv_cache``),
``reference`` (exact attention, the ground truth of every attention path; public as
``thrifty.attention.exact_attention``). See NOTES.md.
"""

from .decode import decode_attention
from .hf import thrifty_kv_cache
from .quantized import QuantizedKV, quantize_kv_cache
from .seam import QuantizedKVCache
from .static import StaticKVCache

__all__ = ["decode_attention", "QuantizedKV", "QuantizedKVCache", "quantize_kv_cache", "thrifty_kv_cache", "StaticKVCache"]
