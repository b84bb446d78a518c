"""NeuZip weight compression (arXiv 2410.20650): entropy-coded exponents, raw sign+mantissa, lossy bf16 mode.

Tensors: ``compress(tensor, mantissa_bits=None)`` -> :class:`CompressedTensor` (``.decompress()``, ``.nbytes``,
``.ratio``); ``save``/``load`` for the checked on-disk format; ``reference`` holds the spec (CPU path).
Models: ``compress_model(model, mode="lossless" | "lossy", mantissa_bits=k)`` keeps every block's linear weights
compressed (one decode launch per block), ``decompress_model(model)`` undoes it; ``save_compressed`` /
``load_compressed`` for whole models. Training: ``compress_model(model, train=LomoConfig(...))`` or
``thrifty.optim.lomo(model, LomoConfig(...))`` (the fused per-layer optimizer lives in :mod:`thrifty.optim`).

Modules: ``reference`` (the codec's spec, NumPy), ``tensor`` (one compressed tensor), ``encode`` and
``encode_kernel`` (encoding: torch ops / Triton), ``decode_kernel`` and ``block_decode`` (Triton decoding: one
tensor / one block's pack), ``format`` (the on-disk format); in models: ``config`` (``NeuZipConfig``),
``convert`` (``compress_model`` / ``decompress_model``), ``linear`` (the compressed linear and its backward),
``state`` (``model.neuzip``: packs, decode buffers, re-encode), ``vocab`` (the coded embedding and lm_head),
``checkpoint`` (``save_compressed`` / ``load_compressed``).
"""

from .checkpoint import load_compressed, save_compressed
from .config import NeuZipConfig
from .convert import compress_model, decompress_model
from .format import FORMAT_VERSION, load, save
from .tensor import CompressedTensor, compress

__all__ = ["CompressedTensor", "compress", "save", "load", "FORMAT_VERSION", "compress_model", "decompress_model", "NeuZipConfig",
           "save_compressed", "load_compressed"]
