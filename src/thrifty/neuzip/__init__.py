"""NeuZip weight compression (arXiv 2410.20650): entropy-coded exponents, raw sign+mantissa, lossy bf16 mode.

Tensors: ``compress(tensor, mantissa_bits=None)`` -> :class:`CompressedTensor` (``.decompress()``, ``.nbytes``,
``.ratio``); ``save``/``load`` for the checked on-disk format; ``reference`` holds the spec (CPU path).
Models: ``compress_model(model, mode="lossless" | "lossy", mantissa_bits=k)`` keeps every block's linear weights
compressed (one decode launch per block), ``decompress_model(model)`` undoes it; ``save_compressed`` /
``load_compressed`` for whole models. Training: ``compress_model(model, train=LomoConfig(...))`` or
``thrifty.optim.lomo(model, LomoConfig(...))`` (the fused per-layer optimizer lives in :mod:`thrifty.optim`).
"""

from .format import FORMAT_VERSION, load, save
from .model import NeuZipConfig, compress_model, decompress_model, load_compressed, save_compressed
from .tensor import CompressedTensor, compress

__all__ = ["CompressedTensor", "compress", "save", "load", "FORMAT_VERSION", "compress_model", "decompress_model", "NeuZipConfig",
           "save_compressed", "load_compressed"]
