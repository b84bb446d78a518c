"""Ternary weight packing: 2 bits per weight in the layout the kernels read, and base-3 (5 per byte) for storage.

**2-bit layout** (``pack_ternary``): a (N, K) ternary matrix becomes uint8 (N, Kp / 4), Kp = K rounded up to a
multiple of :data:`GROUP` (256). Each weight is stored as its code ``c = w + 1`` ∈ {0, 1, 2}. K is cut into groups of
256 weights; byte ``j`` (0..63) of a group holds, in bits ``2i..2i+1``, the weight ``j + 64·i`` of that group
(i = 0..3). Why this order:

* one 64-byte load per row and group gives all 256 weights, and field ``i`` of the loaded bytes is a *contiguous*
  64-weight slice, so it is dotted with a contiguous slice of the activation: no shuffles, no reloads;
* read as little-endian int32 words, ``(word >> 2i) & 0x03030303`` is 4 consecutive codes as 4 bytes (2 ops per
  4 weights), ready for ``dp4a`` against 4 consecutive int8 activations;
* the kernels never subtract the 1: ``Σ (c − 1)·x = Σ c·x − Σ x``, and ``Σ x`` is one integer per token.

Padding weights (k ≥ K) are stored as code 1 (weight 0), so whatever the activation holds there adds nothing.

**Base-3** (``pack_base3``): 5 codes per byte as ``Σ c_t·3^t`` (0..242), 1.6 bits per weight, row-major over the
flattened matrix; a storage format only (export's ``storage="base3"``), unpacked to the 2-bit layout on load.
"""

from __future__ import annotations

import torch

GROUP = 256  # weights per interleave group along K (64 bytes per row)
FIELDS = 4  # 2-bit fields per byte
SLICE = GROUP // FIELDS  # contiguous weights per field: 64
TRITS = 5  # base-3 codes per byte
_POW3 = (1, 3, 9, 27, 81)


def padded_k(k: int) -> int:
    """K rounded up to a whole number of groups (the packed matrix's logical width)."""
    return -(-k // GROUP) * GROUP


def _check_ternary(name: str, w: torch.Tensor) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(w).__name__}")
    if w.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D (out, in) matrix, got shape {tuple(w.shape)}")
    if w.dtype.is_floating_point or w.dtype.is_complex or w.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor of -1/0/+1, got {w.dtype}")
    if w.numel() and (w.min() < -1 or w.max() > 1):
        raise ValueError(f"{name}: values must be -1, 0 or +1")


def pack_ternary(w: torch.Tensor) -> torch.Tensor:
    """uint8 (N, padded_k(K) / 4) of an integer (N, K) matrix of −1/0/+1, in the kernels' layout (module doc)."""
    _check_ternary("w", w)
    n, k = w.shape
    kp = padded_k(k)
    codes = torch.ones((n, kp), dtype=torch.uint8, device=w.device)  # code 1 = weight 0 in the padding
    codes[:, :k] = (w + 1).to(torch.uint8)
    fields = codes.view(n, kp // GROUP, FIELDS, SLICE)  # [row, group, field i, byte j] = weight j + 64 i
    packed = fields[:, :, 0] | (fields[:, :, 1] << 2) | (fields[:, :, 2] << 4) | (fields[:, :, 3] << 6)
    return packed.reshape(n, kp // FIELDS)


def unpack_codes(packed: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 codes (N, padded_k(k)) of a packed matrix (0, 1, 2 = weight −1, 0, +1; padding included)."""
    check_packed("packed", packed, k)
    n = packed.shape[0]
    kp = padded_k(k)
    groups = packed.view(n, kp // GROUP, 1, SLICE)
    shifts = torch.arange(0, 2 * FIELDS, 2, dtype=torch.uint8, device=packed.device).view(1, 1, FIELDS, 1)
    return ((groups >> shifts) & 3).reshape(n, kp)


def unpack_ternary(packed: torch.Tensor, k: int) -> torch.Tensor:
    """int8 (N, k) of −1/0/+1: the exact inverse of :func:`pack_ternary`."""
    return unpack_codes(packed, k)[:, :k].to(torch.int8) - 1


def check_packed(name: str, packed: torch.Tensor, k: int) -> None:
    """A packed matrix of logical width ``k``: uint8, 2-D, padded_k(k) / 4 bytes per row, contiguous."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"{name}: expected uint8 packed weights, got {packed.dtype}")
    if packed.ndim != 2 or packed.shape[1] != padded_k(k) // FIELDS:
        raise ValueError(f"{name}: expected shape (N, {padded_k(k) // FIELDS}) for {k} input features, got "
                         f"{tuple(packed.shape)}")
    if not packed.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


# ----------------------------------------------------------------------------------------------- base 3

def pack_base3(w: torch.Tensor) -> torch.Tensor:
    """uint8 (ceil(N·K / 5),) of an integer (N, K) matrix of −1/0/+1: 5 codes per byte, Σ c_t·3^t."""
    _check_ternary("w", w)
    flat = (w.reshape(-1) + 1).to(torch.int16)
    n_bytes = -(-flat.numel() // TRITS)
    codes = torch.zeros(n_bytes * TRITS, dtype=torch.int16, device=w.device)  # padding trits: code 0
    codes[:flat.numel()] = flat
    pow3 = torch.tensor(_POW3, dtype=torch.int16, device=w.device)
    return (codes.view(n_bytes, TRITS) * pow3).sum(1).to(torch.uint8)


def unpack_base3(packed: torch.Tensor, shape) -> torch.Tensor:
    """int8 matrix of ``shape`` (N, K) from :func:`pack_base3`'s bytes; refuses bytes > 242 (no such code)."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.ndim != 1:
        raise TypeError("packed: expected a 1-D uint8 tensor of base-3 bytes")
    n, k = (int(s) for s in shape)
    if packed.numel() != -(-(n * k) // TRITS):
        raise ValueError(f"packed: expected {-(-(n * k) // TRITS)} bytes for shape ({n}, {k}), got {packed.numel()}")
    if packed.numel() and int(packed.max()) > 242:
        raise ValueError("packed: byte values above 242 are not base-3 codes (corrupted data)")
    b = packed.to(torch.int16).view(-1, 1)
    pow3 = torch.tensor(_POW3, dtype=torch.int16, device=packed.device).view(1, TRITS)
    codes = (b // pow3) % 3
    return (codes.reshape(-1)[:n * k].to(torch.int8) - 1).view(n, k)
