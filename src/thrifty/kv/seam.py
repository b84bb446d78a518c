"""The quantized cache behind the reference model's cache seam (``thrifty.models.llama``): one
:class:`~thrifty.kv.QuantizedKV` per layer."""

from __future__ import annotations

import torch

from .._checks import check_bool, check_positive_int
from .decode import DECODE_MAX_ROWS
from .quantized import QuantizedKV, check_bits, quantize_kv_cache


class QuantizedKVCache:
    """A :class:`QuantizedKV` per layer behind the reference model's cache seam (``thrifty.models.llama``:
    ``update(layer_idx, k, v, positions, rope)`` with pre-RoPE keys): keys are rotated first, then quantized
    (post-RoPE, as the paper). ``update`` returns the dequantized K/V of every cached position, so any
    attention reads what the cache holds (a prompt attends to its own quantized K/V, as in decoding); with
    ``reads_codes`` (the model's attention is a :func:`~thrifty.attention.sage_seam`) a call of ≤ 16 rows
    gets the new tokens' K/V tagged with the cache instead, and the seam's decode kernel reads the packed codes:
    ``generate(model, ids, n, cache_factory=lambda: QuantizedKVCache(3, reads_codes=True))``."""

    def __init__(self, bits: int = 8, *, reads_codes: bool = False, headroom: int = 256):
        self.bits = check_bits(bits)
        self.reads_codes = check_bool("reads_codes", reads_codes)
        self.headroom = check_positive_int("headroom", headroom)
        self.layers: dict[int, QuantizedKV] = {}

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, positions, rope):
        k = rope(k, positions)
        kv = self.layers.get(layer_idx)
        if kv is None:
            kv = self.layers[layer_idx] = quantize_kv_cache(k, v, bits=self.bits, capacity=k.shape[2] + self.headroom)
        elif kv.k.shape[0] != k.shape[0]:
            raise ValueError(f"input_ids: batch {k.shape[0]} does not match the cache's batch {kv.k.shape[0]}; "
                             "use a new cache for a new batch")
        else:
            kv.append(k, v)
        if self.reads_codes and k.shape[2] <= DECODE_MAX_ROWS:
            k._thrifty_kv = kv  # read by thrifty.attention.seam._seam_call with decode_attention
            return k, v
        return tuple(x.to(k.dtype) for x in kv.dequantize())

    def __len__(self) -> int:
        return self.layers[0].length if self.layers else 0

    def nbytes(self) -> int:
        return sum(kv.nbytes() for kv in self.layers.values())


__all__ = ["QuantizedKVCache"]
