"""A quantized KV cache for decoding: the layout the split-K decode kernel (``decode_kernel.py``) reads, the
quantizer that writes it, and the plain-PyTorch reference of decode attention over it.

Layout (one :class:`QuantizedKV` per attention layer), for B sequences, Hkv key/value heads, head_dim D:

* ``k``, ``v``: int8 codes ``(B, Hkv, capacity, D)``, head_dim contiguous, tokens ``[0, length)`` filled.
  Codes lie in ``[-qmax, qmax]`` with ``qmax = 2^(bits-1) - 1``: 127 (8 bits), 7 (4 bits), 3 (3 bits).
  Low-bit codes are stored one per byte for now; a packed layout (two 4-bit or ten 3-bit codes per word,
  the BitNet KV-cache work) changes only the load-and-unpack step of the kernel, not the math.
* ``k_scale``, ``v_scale``: fp32 ``(B, Hkv, capacity)``, one symmetric scale per token and head (absmax /
  qmax over the token's D channels): ``x ≈ code · scale``. Per-token scales let tokens be appended one at a
  time without re-quantizing anything already stored (per-block scales would need a block to fill first).
* ``length``: tokens stored; ``bits``: 8, 4 or 3.

NaN in -> NaN out: a token holding NaN/±inf is stored as the codes of its finite values with a NaN scale, so
the cache remembers it without touching any other token (scales are per token); decoding then makes exactly
the query rows that see it NaN (the rule of ``reference.nonfinite_rows``), and ``dequantize`` gives NaN there.

Bytes per token and head: 2·D codes + 8 scale bytes, against 4·D for bf16: 0.53× at D=64, 0.52× at D=128.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .._checks import check_choice, check_positive_int, check_tensor
from .reference import exact_attention, nonfinite_rows

CACHE_BITS = (8, 4, 3)


def check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int):  # 8.0 == 8 would pass check_choice
        raise TypeError(f"bits: expected an int in {list(CACHE_BITS)}, got {bits!r}")
    check_choice("bits", bits, CACHE_BITS)
    return bits


def qmax_of(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def quantize_per_token(x: torch.Tensor, bits: int = 8):
    """``(B, H, S, D)`` floats → (int8 codes, fp32 scale ``(B, H, S)``), symmetric, round half away from zero
    (as the append kernel). An all-zero token gets scale 1e-12 (any positive scale reproduces its zeros).
    A token holding NaN/±inf gets the codes of its finite values (the others coded 0) and a NaN scale."""
    qmax = qmax_of(check_bits(bits))
    xf = x.float()
    finite = torch.isfinite(xf)
    xf = torch.where(finite, xf, 0.0)  # a NaN must not reach the token's absmax, nor int8 conversion
    scale = (xf.abs().amax(dim=-1) / qmax).clamp_min(1e-12)
    y = xf / scale[..., None]
    codes = (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp_(-qmax, qmax).to(torch.int8)
    return codes, scale.masked_fill(~finite.all(dim=-1), float("nan"))


@dataclass
class QuantizedKV:
    """One layer's quantized K/V cache (layout in the module docstring). Build it with
    :meth:`empty` or :func:`quantize_kv_cache`; add tokens with :meth:`append`."""

    k: torch.Tensor
    k_scale: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor
    length: int
    bits: int = 8

    def __post_init__(self):
        check_bits(self.bits)
        check_tensor("k", self.k, ndim=4, dtypes=(torch.int8,))
        check_tensor("v", self.v, ndim=4, dtypes=(torch.int8,))
        check_tensor("k_scale", self.k_scale, ndim=3, dtypes=(torch.float32,))
        check_tensor("v_scale", self.v_scale, ndim=3, dtypes=(torch.float32,))
        scales_ok = self.k_scale.shape == self.k.shape[:3] and self.v_scale.shape == self.k.shape[:3]
        if self.v.shape != self.k.shape or not scales_ok:
            raise ValueError(f"k, v, k_scale, v_scale: expected shapes (B, Hkv, capacity, D) and (B, Hkv, capacity), "
                             f"got {tuple(self.k.shape)}, {tuple(self.v.shape)}, {tuple(self.k_scale.shape)}, "
                             f"{tuple(self.v_scale.shape)}")
        if 0 in (self.k.shape[0], self.k.shape[1], self.k.shape[3]):
            raise ValueError(f"k: expected batch, kv heads and head_dim > 0, got shape {tuple(self.k.shape)}")
        if self.k.stride(-1) != 1 or self.v.stride(-1) != 1:
            raise ValueError("k, v: expected head_dim contiguous (stride 1)")
        if not isinstance(self.length, int) or not 0 <= self.length <= self.k.shape[2]:
            raise ValueError(f"length: expected an int in [0, {self.k.shape[2]}], got {self.length!r}")

    @classmethod
    def empty(cls, batch: int, kv_heads: int, capacity: int, head_dim: int, *, device=None,
              bits: int = 8) -> "QuantizedKV":
        for name, n in (("batch", batch), ("kv_heads", kv_heads), ("capacity", capacity), ("head_dim", head_dim)):
            check_positive_int(name, n)
        shape = (batch, kv_heads, capacity, head_dim)
        return cls(torch.zeros(shape, dtype=torch.int8, device=device),
                   torch.ones(shape[:3], dtype=torch.float32, device=device),
                   torch.zeros(shape, dtype=torch.int8, device=device),
                   torch.ones(shape[:3], dtype=torch.float32, device=device), 0, bits)

    @property
    def shape(self):
        """(B, Hkv, length, D): the shape of the K (or V) this cache stands for."""
        B, H, _, D = self.k.shape
        return (B, H, self.length, D)

    @property
    def device(self):
        return self.k.device

    def append(self, k: torch.Tensor, v: torch.Tensor) -> "QuantizedKV":
        """Quantizes ``(B, Hkv, n, D)`` new keys/values into the next ``n`` slots (doubling the capacity when
        full); returns self."""
        check_tensor("k", k, ndim=4, floating=True)
        check_tensor("v", v, ndim=4, floating=True)
        B, H, _, D = self.k.shape
        if k.shape != v.shape or k.shape[0] != B or k.shape[1] != H or k.shape[3] != D:
            raise ValueError(f"k, v: expected equal shapes (B={B}, Hkv={H}, n, D={D}), got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        n = k.shape[2]
        end = self.length + n
        if end > self.k.shape[2]:
            self._grow(max(end, 2 * self.k.shape[2]))
        if self.k.is_cuda and D in (64, 128):  # one launch per tensor (decode steps: ~12 torch ops otherwise)
            from .decode_kernel import append_triton
            append_triton(self, k, v)
        else:
            self._append_torch(k, v, end)
        self.length = end
        return self

    def _append_torch(self, k, v, end):
        kc, ks = quantize_per_token(k, self.bits)
        vc, vs = quantize_per_token(v, self.bits)
        self.k[:, :, self.length:end] = kc
        self.k_scale[:, :, self.length:end] = ks
        self.v[:, :, self.length:end] = vc
        self.v_scale[:, :, self.length:end] = vs

    def _grow(self, capacity: int) -> None:
        def grown(x, fill):
            new = torch.full((*x.shape[:2], capacity, *x.shape[3:]), fill, dtype=x.dtype, device=x.device)
            new[:, :, :x.shape[2]] = x
            return new
        self.k, self.v = grown(self.k, 0), grown(self.v, 0)
        self.k_scale, self.v_scale = grown(self.k_scale, 1.0), grown(self.v_scale, 1.0)

    def dequantize(self, dtype=torch.float32):
        """(K, V) as ``(B, Hkv, length, D)`` tensors of ``dtype``: codes times scales."""
        L = self.length
        k = self.k[:, :, :L].float() * self.k_scale[:, :, :L, None]
        v = self.v[:, :, :L].float() * self.v_scale[:, :, :L, None]
        return k.to(dtype), v.to(dtype)


def quantize_kv_cache(k: torch.Tensor, v: torch.Tensor, *, bits: int = 8,
                      capacity: Optional[int] = None) -> QuantizedKV:
    """A :class:`QuantizedKV` holding ``(B, Hkv, S, D)`` keys and values (room for ``capacity`` tokens)."""
    check_tensor("k", k, ndim=4, floating=True)
    B, H, S, D = k.shape
    if 0 in (B, H, D):
        raise ValueError(f"k: expected batch, kv heads and head_dim > 0, got shape {tuple(k.shape)}")
    if capacity is not None:
        check_positive_int("capacity", capacity)
    cache = QuantizedKV.empty(B, H, max(capacity or S, S, 1), D, device=k.device, bits=bits)
    return cache.append(k, v)


def decode_attention_reference(q: torch.Tensor, cache: QuantizedKV, *, causal: bool = True,
                               sm_scale: Optional[float] = None, dtype=torch.float32) -> torch.Tensor:
    """The specification of the decode kernel: exact softmax attention of ``q`` ``(B, H, Sq, D)`` over the
    dequantized cache, in ``dtype``; ``causal`` puts the queries at the last ``Sq`` positions. Output in
    q's dtype. NaN in -> NaN out: the rows that see a non-finite query or cached token are NaN, the others are
    computed with those values as zeros (``reference.nonfinite_rows``)."""
    k, v = cache.dequantize(torch.float32)
    bad_rows = nonfinite_rows(q, k, v, causal)
    zero = lambda x: torch.where(torch.isfinite(x), x, 0.0)  # noqa: E731  (0·NaN would leak to other rows)
    out = exact_attention(zero(q), zero(k), zero(v), causal=causal, sm_scale=sm_scale, dtype=dtype)
    return out.masked_fill(bad_rows[..., None], float("nan"))


__all__ = ["QuantizedKV", "quantize_kv_cache", "quantize_per_token", "decode_attention_reference", "CACHE_BITS"]
