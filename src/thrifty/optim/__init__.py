"""Optimizers: LOMO, the fused per-layer update (each weight updated in its backward hook, no gradient kept).

``lomo(model, LomoConfig(...))`` attaches it to any model (plain, or NeuZip-compressed: :mod:`thrifty.neuzip`
hands its compressed blocks' updates to the same optimizer) and returns the :class:`FusedOptimizer`
(``set_lr``, ``remove``, ``state_bytes``). SGD or AdamW; AdamW states in float32, bfloat16 or 8-bit block-quantized
codes (:mod:`thrifty.optim.state8`); on CUDA the AdamW update is one Triton launch per parameter
(:mod:`thrifty.optim.lomo_kernel`, ``impl``: "auto" | "triton" | "reference"). NOTES.md: how it works now.
"""

from . import state8
from .lomo import OPTIMIZERS, STATE_DTYPES, FusedOptimizer, LomoConfig, lomo

__all__ = ["LomoConfig", "lomo", "FusedOptimizer", "OPTIMIZERS", "STATE_DTYPES", "state8"]
