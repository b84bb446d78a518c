"""Quantized attention after SageAttention2 (arXiv 2411.10958): INT8 (or INT4-range) Q·Kᵀ with K smoothing,
FP8 P̃·V with two-level accumulation, a Triton forward for CUDA and a readable PyTorch reference.

    from thrifty.attention import sage_attention
    out = sage_attention(q, k, v, causal=True)            # (B, H, S, D); GQA when k has fewer heads

Models: ``model.set_attention(sage_seam())`` (reference Llama), ``enable_hf(model)`` (transformers),
``apply_plan(model, calibrate(model, batches))`` (per-layer 4/8 bits). Decoding:
``decode_attention(q, cache)`` over a ``QuantizedKV`` (packed 8/4/3-bit cache, split-K kernel);
``thrifty_kv_cache(model, bits)`` for transformers' ``generate``, ``QuantizedKVCache(bits)`` for the reference
model's. See NOTES.md for the kernel's numbers.

Modules: ``sage`` (the attention function), ``seam`` (the reference model's attention seam), ``plan`` (per-layer
4/8-bit calibration and plans), ``hf`` (transformers), ``kv_cache`` / ``decode`` (the quantized KV cache and its
decode), ``reference`` (the readable PyTorch spec), ``routing`` and the ``*_kernel`` Triton modules.
"""

from .decode import decode_attention
from .hf import disable_hf, enable_hf, thrifty_kv_cache
from .kv_cache import QuantizedKV, QuantizedKVCache, quantize_kv_cache
from .plan import apply_plan, calibrate, check_plan, load_plan, plan_from_scores, save_plan
from .reference import accuracy_metrics, exact_attention, sage_attention_reference
from .sage import sage_attention
from .seam import sage_seam

__all__ = ["sage_attention", "sage_seam", "calibrate", "plan_from_scores", "save_plan", "load_plan",
           "apply_plan", "check_plan", "enable_hf", "disable_hf", "sage_attention_reference", "exact_attention", "accuracy_metrics",
           "decode_attention", "QuantizedKV", "QuantizedKVCache", "quantize_kv_cache", "thrifty_kv_cache"]
