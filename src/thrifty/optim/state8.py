"""8-bit optimizer states: block-wise absmax scale + a logarithmic 8-bit code (plain torch ops, CPU and GPU).

A tensor is cut into blocks of ``block`` consecutive values (the last one may be short); each block keeps its
absmax as one float32 scale, and each value a code of 8 bits for ``|x| / absmax``:

* signed (``exp_avg``): int8, sign + magnitude j = 0..127; j = 0 is 0, j >= 1 is 2^((j - 127) / S) with
  S = 126/16 levels per octave, so levels 1..127 span the 16 octaves below the block's absmax. A value below half an
  octave-step under the smallest level becomes 0 (its update is < 2^-16 of the block's largest).
* unsigned (``exp_avg_sq``): uint8, j = 0..255, 2^((j - 255) / S) with S = 254/32: 32 octaves of v, i.e. the
  same 16 octaves of sqrt(v) that Adam divides by. Only an exact 0 codes to 0: a positive v below the smallest
  level is rounded *up* to it, so the denominator sqrt(v) + eps is never underestimated (no exploding step).

Why logarithmic (NOTES.md has the arithmetic): Adam's step is the ratio m / sqrt(v), so the error that matters
is relative, per element. A log code has the same relative error everywhere in its range, at most
2^(1/(2S)) - 1 ≈ 4.5% (m) and 4.5% (v; 2.2% on sqrt(v)); a linear absmax code would round every value under
absmax/255 of its block to 0, and a zeroed v with a non-zero m makes the step m / eps explode.

NaN: a NaN makes its block's absmax (the scale) NaN, so the whole block dequantizes to NaN (an inf: inf/NaN),
as a NaN gradient would poison the fp32 states' weight anyway. An all-zero block has scale 0 and decodes to 0.
"""

from __future__ import annotations

import torch

SIGNED_LEVELS, SIGNED_OCTAVES = 127, 16
UNSIGNED_LEVELS, UNSIGNED_OCTAVES = 255, 32


def _per_octave(signed: bool) -> float:
    """Levels per octave: level 1 sits at 2^-octaves, level ``top`` at 1 (the absmax)."""
    return (SIGNED_LEVELS - 1) / SIGNED_OCTAVES if signed else (UNSIGNED_LEVELS - 1) / UNSIGNED_OCTAVES


def relative_error_bound(signed: bool) -> float:
    """Largest relative error of a value inside the code's range (half a level step, geometric)."""
    return 2.0 ** (0.5 / _per_octave(signed)) - 1.0


def smallest_level(signed: bool) -> float:
    """The smallest non-zero magnitude, as a fraction of the block's absmax."""
    return 2.0 ** -(SIGNED_OCTAVES if signed else UNSIGNED_OCTAVES)


_TABLES: dict = {}


def _table(signed: bool, device) -> torch.Tensor:
    """float32 value of each magnitude code (index j), 0 for j = 0; cached per device."""
    key = (signed, str(device))
    t = _TABLES.get(key)
    if t is None:
        top = SIGNED_LEVELS if signed else UNSIGNED_LEVELS
        j = torch.arange(top + 1, dtype=torch.float64)
        t = torch.exp2((j - top) / _per_octave(signed)).float()
        t[0] = 0.0
        t = _TABLES[key] = t.to(device)
    return t


def num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    """x flat, zero-padded to whole blocks, as [blocks, block]."""
    flat = x.reshape(-1)
    pad = num_blocks(flat.numel(), block) * block - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


@torch.no_grad()
def quantize_into(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int, signed: bool) -> None:
    """Writes the 8-bit codes of float tensor ``x`` into ``codes`` (int8 if signed else uint8, ``x.numel()``
    values) and the per-block absmax into ``scales`` (float32, ceil(numel / block) values)."""
    n = x.numel()
    xb = _blocked(x.float(), block)
    absmax = xb.abs().amax(dim=1)  # NaN propagates: the block's scale is NaN
    scales.copy_(absmax)
    u = xb.abs() / torch.where(absmax > 0, absmax, 1.0).unsqueeze(1)
    top = SIGNED_LEVELS if signed else UNSIGNED_LEVELS
    j = torch.round(torch.log2(u) * _per_octave(signed) + top)  # -inf for 0, NaN for NaN
    j = torch.nan_to_num(j, nan=0.0, posinf=float(top), neginf=0.0).clamp_(0, top)
    if signed:
        j = torch.where(j < 1, 0.0, j)  # below half a step under the smallest level: 0
        q = torch.where(xb < 0, -j, j).to(torch.int8)
    else:
        j = torch.where(u > 0, j.clamp(min=1), 0.0)  # any positive v keeps at least the smallest level
        q = j.to(torch.uint8)
    codes.copy_(q.view(-1)[:n])


def quantize(x: torch.Tensor, block: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of ``x``: see :func:`quantize_into`."""
    codes = torch.empty(x.numel(), dtype=torch.int8 if signed else torch.uint8, device=x.device)
    scales = torch.empty(num_blocks(x.numel(), block), dtype=torch.float32, device=x.device)
    quantize_into(x, codes, scales, block, signed)
    return codes, scales


@torch.no_grad()
def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """float32 values (flat, ``codes.numel()``) of codes made by :func:`quantize_into`."""
    signed = codes.dtype == torch.int8
    n = codes.numel()
    mag = codes.to(torch.int64)
    table = _table(signed, codes.device)
    vals = table[mag.abs()]
    if signed:
        vals = torch.where(mag < 0, -vals, vals)
    vals = _blocked(vals, block) * scales.unsqueeze(1)
    return vals.view(-1)[:n]


def state_bytes_per_value(block: int) -> float:
    """Bytes per parameter of one 8-bit state: 1 B code + a 4 B scale per block."""
    return 1.0 + 4.0 / block


def check_block(name: str, block) -> int:
    """A block size: a power of two in [16, 4096] (so it divides the update's chunk of 2^22 values)."""
    if isinstance(block, bool) or not isinstance(block, int):
        raise TypeError(f"{name}: expected an int, got {type(block).__name__}")
    if not (16 <= block <= 4096 and block & (block - 1) == 0):
        raise ValueError(f"{name}: expected a power of two in [16, 4096], got {block}")
    return block


__all__ = ["quantize", "quantize_into", "dequantize", "relative_error_bound", "smallest_level", "num_blocks",
           "state_bytes_per_value", "check_block"]
