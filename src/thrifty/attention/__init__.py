"""Quantized attention after SageAttention2 (arXiv 2411.10958): INT8 (or INT4-range) Q·Kᵀ with K smoothing,
FP8 P̃·V with two-level accumulation, a Triton forward for CUDA and a readable PyTorch reference.

    from thrifty.attention import SageConfig, sage_attention
    out = sage_attention(q, k, v, causal=True)            # (B, H, S, D); GQA when k has fewer heads
    out = sage_attention(q, k, v, causal=True, config=SageConfig(qk_bits=4))  # SageAttention2-4b

Models: ``model.set_attention(sage_seam())`` (reference Llama), ``enable_hf(model)`` (transformers),
``apply_plan(model, calibrate(model, batches))`` (per-layer 4/8 bits). Decoding over a quantized KV cache
(``thrifty.kv``: ``QuantizedKV``, ``thrifty_kv_cache``, ``decode_attention``): the seam and ``enable_hf`` hand
decode steps of 1–16 rows over such a cache to the family's split-K decode kernel. See NOTES.md for the
kernel's numbers.

``SageConfig`` holds how it quantizes (qk_bits, pv, smooth_k/q/v), validated once when built; the seam,
``enable_hf``, ``calibrate`` and ``apply_plan`` take the same ``impl`` and ``config``.

Modules: ``sage`` (the attention function and its config), ``seam`` (the reference model's attention seam),
``plan`` (per-layer 4/8-bit calibration and plans), ``hf`` (transformers), ``reference`` (the readable PyTorch
spec), ``routing`` and the ``*_kernel`` Triton modules. ``exact_attention`` (the tests' ground truth) lives in
``thrifty.kv.reference``.
"""

from ..kv.reference import exact_attention
from .hf import disable_hf, enable_hf
from .plan import apply_plan, calibrate, check_plan, load_plan, plan_from_scores, save_plan
from .reference import accuracy_metrics, sage_attention_reference
from .sage import SageConfig, sage_attention
from .seam import sage_seam

__all__ = ["sage_attention", "SageConfig", "sage_seam", "calibrate", "plan_from_scores", "save_plan", "load_plan",
           "apply_plan", "check_plan", "enable_hf", "disable_hf", "sage_attention_reference", "exact_attention", "accuracy_metrics"]
