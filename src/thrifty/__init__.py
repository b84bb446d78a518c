"""thrifty: cheaper LLM training and serving (Cut Cross-Entropy, quantized attention, BitNet a4.8, NeuZip, ShadowKV).

    model = thrifty.optimize(model, "train-memory")   # or an OptimizeConfig; thrifty.undo / thrifty.describe

Submodules are imported on first use so that ``import thrifty`` stays cheap and never compiles kernels.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "optimize": ("thrifty.compose", "optimize"),
    "undo": ("thrifty.compose", "undo"),
    "describe": ("thrifty.compose", "describe"),
    "OptimizeConfig": ("thrifty.compose", "OptimizeConfig"),
    "AttentionConfig": ("thrifty.compose", "AttentionConfig"),
    "CCEConfig": ("thrifty.compose", "CCEConfig"),
    "LowBitKVConfig": ("thrifty.compose", "LowBitKVConfig"),
    "linear_cross_entropy": ("thrifty.loss", "linear_cross_entropy"),
    "CCEKernelConfig": ("thrifty.loss", "CCEKernelConfig"),
    "sage_attention": ("thrifty.attention", "sage_attention"),
    "SageConfig": ("thrifty.attention", "SageConfig"),
    "compress": ("thrifty.neuzip", "compress"),
    "LlamaForCausalLM": ("thrifty.models", "LlamaForCausalLM"),
    "LlamaConfig": ("thrifty.models", "LlamaConfig"),
    "Trainer": ("thrifty.train", "Trainer"),
    "ShadowKVCache": ("thrifty.kvcache", "ShadowKVCache"),
    "ShadowKVConfig": ("thrifty.kvcache", "ShadowKVConfig"),
    "TrainConfig": ("thrifty.train", "TrainConfig"),
}


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'thrifty' has no attribute {name!r}")


__all__ = list(_LAZY) + ["__version__"]
