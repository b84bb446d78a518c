"""The reference model: one readable Llama-style decoder with swappable attention, Linear, loss and KV cache."""

from .generate import GraphedDecoder, generate
from .llama import (KVCache, LlamaConfig, LlamaForCausalLM, default_linear, logits_cross_entropy,
                    sdpa_attention)
from .presets import PRESETS, preset

__all__ = ["LlamaConfig", "LlamaForCausalLM", "KVCache", "generate", "GraphedDecoder", "sdpa_attention", "default_linear",
           "logits_cross_entropy", "PRESETS", "preset"]
