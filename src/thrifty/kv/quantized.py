"""The quantized static KV cache: the layout the split-K decode kernel (``decode_kernel.py``) reads and the
quantizer that writes it (``decode.py`` holds the reference of decode attention over it).

Quantization (BitNet a4.8 §3.1, for every width): post-RoPE keys and values, one absmax per token and head,
**unsigned** codes. With ``top = 2^bits - 1`` and ``α`` the token's absmax over its D channels:

    scale = α / (top / 2),   code = clamp(floor(x / scale + top/2 + 1/2), 0, top),   x ≈ (code - top/2) · scale

All 2^bits levels are used, evenly over [-α, α] (no level at 0): at 3 bits a step of 2α/7, where the signed
grid [-3, 3] wastes one level for a zero and steps α/3. **The first token is kept at 4 bits in the 3-bit
mode** (the paper keeps the BOS token's heads at 4 bits: they carry the outlier features; the first token is
the attention sink whatever its id, and the cache sees keys, not ids).

Layout (one :class:`QuantizedKV` per attention layer), for B sequences, Hkv key/value heads, head_dim D:

* ``k``, ``v``: uint8 ``(B, Hkv, capacity, D·bits/8)``, the packed codes of each token and head, tokens
  ``[0, length)`` filled. A code is split into bit fields of power-of-two widths (:data:`FIELDS`: 8 = one
  byte, 4 = one nibble, 3 = a 2-bit field then a 1-bit field), the fields stored one after the other in the
  row. A field of width w takes ``n = D·w/8`` bytes; byte ``j`` holds channels ``j, j + n, j + 2n, ...`` at
  bit shifts ``0, w, 2w, ...`` (consecutive channels sit in consecutive bytes, so the kernel's loads of one
  field are contiguous runs, and packing is a reshape). 3 bits cost exactly 3 bits per value.
* ``k_scale``, ``v_scale``: fp32 ``(B, Hkv, capacity)``, one scale per token and head. Per-token scales let
  tokens be appended one at a time without re-quantizing anything already stored.
* ``k_sink``, ``v_sink`` (3-bit mode only, else None): uint8 ``(B, Hkv, D/8)``, bit 3 of the first token's
  4-bit codes (a 1-bit field); its low 3 bits sit in the token's row like any other token's.
* ``length``: tokens stored; ``bits``: 8, 4 or 3.

NaN in -> NaN out: a token holding NaN/±inf is stored as the codes of its finite values with a NaN scale, so
the cache remembers it without touching any other token (scales are per token); decoding then makes exactly
the query rows that see it NaN (the rule of ``reference.nonfinite_rows``), and ``dequantize`` gives NaN there.

Bytes per token, head and tensor (K or V): D·bits/8 codes + 4 scale bytes, against 2·D for bf16:
D=128: 8 bits 0.52×, 4 bits 0.27×, 3 bits 0.20×; D=64: 0.53×, 0.28×, 0.22× (:func:`bytes_per_token`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .._checks import check_choice, check_positive_int, check_tensor

CACHE_BITS = (8, 4, 3)
SINK_BITS = 4  # the first token's width in the 3-bit mode
# (width, bit offset in the code) of each field of a packed row, in row order; decode_kernel._load_codes reads
# the same fields
FIELDS = {8: ((8, 0),), 4: ((4, 0),), 3: ((2, 0), (1, 2))}
SCALE_BYTES = 4


def check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int):  # 8.0 == 8 would pass check_choice
        raise TypeError(f"bits: expected an int in {list(CACHE_BITS)}, got {bits!r}")
    check_choice("bits", bits, CACHE_BITS)
    return bits


def top_code(bits: int) -> int:
    """The largest unsigned code of ``bits`` bits; the zero point is half of it."""
    return (1 << bits) - 1


def has_sink(bits: int) -> bool:
    """Whether the first token is stored wider than the others (the 3-bit mode)."""
    return bits < SINK_BITS


def check_head_dim(head_dim: int, bits: int) -> None:
    multiple = 8 // min(width for width, _ in FIELDS[bits])  # the narrowest field fills whole bytes
    if head_dim % multiple:
        raise ValueError(f"head_dim: {bits}-bit codes pack whole bytes only for head_dim a multiple of "
                         f"{multiple}, got {head_dim}")


def bytes_per_token(head_dim: int, bits: Optional[int]) -> int:
    """Cache bytes per token, kv head and tensor (K or V): packed codes + one fp32 scale; ``bits=None``:
    bf16 (what the cache replaces). The 3-bit mode's first-token extra (D/8 bytes per head) is not per token."""
    return 2 * head_dim if bits is None else head_dim * bits // 8 + SCALE_BYTES


def quantize_per_token(x: torch.Tensor, bits: int = 8):
    """``(B, H, S, D)`` floats → (uint8 codes ``(B, H, S, D)``, one per byte, fp32 scale ``(B, H, S)``) on the
    unsigned absmax grid of the module docstring (as the append kernel computes it, bit for bit). An all-zero
    token gets scale 1e-12 (it dequantizes to ±5e-13). A token holding NaN/±inf gets the codes of its finite
    values (the others coded as 0.0 would be) and a NaN scale."""
    top = top_code(check_bits(bits))
    half = top / 2
    xf = x.float()
    finite = torch.isfinite(xf)
    xf = torch.where(finite, xf, 0.0)  # a NaN must not reach the token's absmax, nor the integer conversion
    scale = (xf.abs().amax(dim=-1) / half).clamp_min(1e-12)
    y = xf / scale[..., None]
    codes = torch.floor(y + (half + 0.5)).clamp_(0, top).to(torch.uint8)  # y + top/2 ≥ 0: round half up
    return codes, scale.masked_fill(~finite.all(dim=-1), float("nan"))


def _pack_field(codes: torch.Tensor, width: int, shift: int) -> torch.Tensor:
    """Bits ``[shift, shift + width)`` of ``(..., D)`` codes as ``(..., D·width/8)`` bytes: byte j holds
    channels j, j + n, j + 2n, ... (n = D·width/8) at bit shifts 0, width, 2·width, ..."""
    per_byte = 8 // width
    parts = ((codes >> shift) & top_code(width)).unflatten(-1, (per_byte, -1))
    out = torch.zeros_like(parts[..., 0, :])
    for r in range(per_byte):
        out |= parts[..., r, :] << (width * r)
    return out


def _unpack_field(packed: torch.Tensor, width: int, shift: int) -> torch.Tensor:
    """The inverse of :func:`_pack_field`: ``(..., n)`` bytes → ``(..., n·8/width)`` codes holding the field's
    bits at ``shift``."""
    per_byte = 8 // width
    parts = [(packed >> (width * r)) & top_code(width) for r in range(per_byte)]
    return torch.cat(parts, dim=-1) << shift


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``(..., D)`` uint8 codes (< 2^bits) → ``(..., D·bits/8)`` packed rows (layout in the module docstring)."""
    return torch.cat([_pack_field(codes, w, s) for w, s in FIELDS[bits]], dim=-1)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``(..., D·bits/8)`` packed rows → ``(..., D)`` uint8 codes."""
    head_dim = packed.shape[-1] * 8 // bits
    out, start = None, 0
    for width, shift in FIELDS[bits]:
        n = head_dim * width // 8
        part = _unpack_field(packed[..., start:start + n], width, shift)
        out, start = part if out is None else out | part, start + n
    return out


def _check_sink(name, sink, k, bits, head_dim):
    if not has_sink(bits):
        if sink is not None:
            raise ValueError(f"{name}: only the {CACHE_BITS[-1]}-bit mode keeps a first-token plane, got one "
                             f"with bits={bits}")
        return
    check_tensor(name, sink, ndim=3, dtypes=(torch.uint8,))
    if sink.shape != (*k.shape[:2], head_dim // 8):
        raise ValueError(f"{name}: expected shape {(*k.shape[:2], head_dim // 8)}, got {tuple(sink.shape)}")


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
    k_sink: Optional[torch.Tensor] = None
    v_sink: Optional[torch.Tensor] = None

    def __post_init__(self):
        check_bits(self.bits)
        check_tensor("k", self.k, ndim=4, dtypes=(torch.uint8,))
        check_tensor("v", self.v, ndim=4, dtypes=(torch.uint8,))
        check_tensor("k_scale", self.k_scale, ndim=3, dtypes=(torch.float32,))
        check_tensor("v_scale", self.v_scale, ndim=3, dtypes=(torch.float32,))
        scales_ok = self.k_scale.shape == self.k.shape[:3] and self.v_scale.shape == self.k.shape[:3]
        if self.v.shape != self.k.shape or not scales_ok:
            raise ValueError(f"k, v, k_scale, v_scale: expected shapes (B, Hkv, capacity, D·bits/8) and (B, Hkv, "
                             f"capacity), got {tuple(self.k.shape)}, {tuple(self.v.shape)}, "
                             f"{tuple(self.k_scale.shape)}, {tuple(self.v_scale.shape)}")
        if 0 in (self.k.shape[0], self.k.shape[1], self.k.shape[3]):
            raise ValueError(f"k: expected batch, kv heads and head_dim > 0, got shape {tuple(self.k.shape)}")
        if (self.k.shape[3] * 8) % self.bits:
            raise ValueError(f"k: {self.k.shape[3]} bytes per row do not hold whole {self.bits}-bit codes")
        check_head_dim(self.head_dim, self.bits)
        if self.k.stride(-1) != 1 or self.v.stride(-1) != 1:
            raise ValueError("k, v: expected each packed row contiguous (stride 1)")
        _check_sink("k_sink", self.k_sink, self.k, self.bits, self.head_dim)
        _check_sink("v_sink", self.v_sink, self.k, self.bits, self.head_dim)
        if not isinstance(self.length, int) or not 0 <= self.length <= self.k.shape[2]:
            raise ValueError(f"length: expected an int in [0, {self.k.shape[2]}], got {self.length!r}")

    @classmethod
    def empty(cls, batch: int, kv_heads: int, capacity: int, head_dim: int, *, device=None,
              bits: int = 8) -> "QuantizedKV":
        for name, n in (("batch", batch), ("kv_heads", kv_heads), ("capacity", capacity), ("head_dim", head_dim)):
            check_positive_int(name, n)
        check_bits(bits)
        check_head_dim(head_dim, bits)
        shape = (batch, kv_heads, capacity, head_dim * bits // 8)
        codes = lambda: torch.zeros(shape, dtype=torch.uint8, device=device)  # noqa: E731
        scales = lambda: torch.ones(shape[:3], dtype=torch.float32, device=device)  # noqa: E731
        sink = (lambda: torch.zeros(batch, kv_heads, head_dim // 8, dtype=torch.uint8, device=device)) \
            if has_sink(bits) else (lambda: None)
        return cls(codes(), scales(), codes(), scales(), 0, bits, sink(), sink())

    @property
    def head_dim(self) -> int:
        return self.k.shape[3] * 8 // self.bits

    @property
    def shape(self):
        """(B, Hkv, length, D): the shape of the K (or V) this cache stands for."""
        B, H = self.k.shape[:2]
        return (B, H, self.length, self.head_dim)

    @property
    def device(self):
        return self.k.device

    def nbytes(self) -> int:
        """Bytes of the tokens held (codes, scales and the first-token plane), K and V together."""
        B, H, L, D = self.shape
        sink = 2 * B * H * (D // 8) if self.k_sink is not None and L else 0
        return 2 * B * H * L * bytes_per_token(D, self.bits) + sink

    def append(self, k: torch.Tensor, v: torch.Tensor) -> "QuantizedKV":
        """Quantizes ``(B, Hkv, n, D)`` new keys/values into the next ``n`` slots (doubling the capacity when
        full); returns self."""
        check_tensor("k", k, ndim=4, floating=True)
        check_tensor("v", v, ndim=4, floating=True)
        (B, H), D = self.k.shape[:2], self.head_dim
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
        for x, codes, scale, sink in ((k, self.k, self.k_scale, self.k_sink), (v, self.v, self.v_scale, self.v_sink)):
            c, s = quantize_per_token(x, self.bits)
            if sink is not None and self.length == 0 and x.shape[2]:  # the first token, at SINK_BITS
                c0, s0 = quantize_per_token(x[:, :, :1], SINK_BITS)
                c[:, :, :1], s[:, :, :1] = c0, s0
                sink.copy_(_pack_field(c0[:, :, 0], 1, self.bits))
            codes[:, :, self.length:end] = pack_codes(c, self.bits)  # a wider code keeps its low `bits` bits
            scale[:, :, self.length:end] = s

    def _grow(self, capacity: int) -> None:
        def grown(x, fill):
            new = torch.full((*x.shape[:2], capacity, *x.shape[3:]), fill, dtype=x.dtype, device=x.device)
            new[:, :, :x.shape[2]] = x
            return new
        self.k, self.v = grown(self.k, 0), grown(self.v, 0)
        self.k_scale, self.v_scale = grown(self.k_scale, 1.0), grown(self.v_scale, 1.0)

    def codes(self):
        """(K codes, V codes, zero points): uint8 ``(B, Hkv, length, D)`` codes (the first token's carrying its
        4th bit in the 3-bit mode) and fp32 ``(length,)`` zero points (top/2 of each token's width)."""
        L = self.length
        zero = torch.full((L,), top_code(self.bits) / 2, device=self.device)
        out = []
        for packed, sink in ((self.k, self.k_sink), (self.v, self.v_sink)):
            c = unpack_codes(packed[:, :, :L], self.bits)
            if sink is not None and L:
                c[:, :, 0] |= _unpack_field(sink, 1, self.bits)
            out.append(c)
        if has_sink(self.bits) and L:
            zero[0] = top_code(SINK_BITS) / 2
        return out[0], out[1], zero

    def dequantize(self, dtype=torch.float32):
        """(K, V) as ``(B, Hkv, length, D)`` tensors of ``dtype``: (code − zero point) · scale."""
        L = self.length
        kc, vc, zero = self.codes()
        k = (kc.float() - zero[:, None]) * self.k_scale[:, :, :L, None]
        v = (vc.float() - zero[:, None]) * self.v_scale[:, :, :L, None]
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


__all__ = ["QuantizedKV", "quantize_kv_cache", "quantize_per_token", "pack_codes", "unpack_codes", "bytes_per_token",
           "CACHE_BITS", "SINK_BITS"]
