"""NeuZip weight compression (arXiv 2410.20650): entropy-coded exponents, raw sign+mantissa, lossy bf16 mode.

``compress(tensor, mantissa_bits=None)`` -> :class:`CompressedTensor` (``.decompress()``, ``.nbytes``,
``.ratio``); ``save``/``load`` for the checked on-disk format; ``reference`` holds the spec (CPU path).
"""

from .format import FORMAT_VERSION, load, save
from .tensor import CompressedTensor, compress

__all__ = ["CompressedTensor", "compress", "save", "load", "FORMAT_VERSION"]
