"""Public decode API: :func:`decode_attention` over a :class:`~thrifty.kv.QuantizedKV`, which implementation runs
it (the split-K kernel in ``decode_kernel.py``, or :func:`decode_attention_reference`, its specification)."""

from __future__ import annotations

from typing import Optional

import torch

from .._checks import check_bool, check_impl, check_range, check_tensor
from ..triton_utils import kernels_available
from .quantized import QuantizedKV
from .reference import exact_attention, nonfinite_rows

DECODE_MAX_ROWS = 16  # query rows up to which a call counts as decoding (speculative drafts included)
DECODE_HEAD_DIMS = (64, 128)


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




def _validate_decode(q, cache):
    check_tensor("q", q, ndim=4, floating=True)
    if not isinstance(cache, QuantizedKV):
        raise TypeError(f"cache: expected a thrifty.kv.QuantizedKV, got {type(cache).__name__}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q: expected float16, bfloat16 or float32, got {q.dtype}")
    B, H, Sq, D = q.shape
    if H == 0:
        raise ValueError(f"q: expected at least one head, got shape {tuple(q.shape)}")
    Bc, Hkv, _, Dc = cache.shape
    if B != Bc or D != Dc:
        raise ValueError(f"q: expected batch {Bc} and head_dim {Dc} like the cache, got {tuple(q.shape)}")
    if H % Hkv:
        raise ValueError(f"q: query heads ({H}) must be a multiple of the cache's key/value heads ({Hkv})")
    if not 1 <= Sq <= DECODE_MAX_ROWS:
        raise ValueError(f"q: decode takes 1..{DECODE_MAX_ROWS} query rows, got {Sq} (use sage_attention)")
    if cache.length < Sq:
        raise ValueError(f"cache: holds {cache.length} tokens, fewer than the {Sq} queries")
    if q.device != cache.device:
        raise ValueError(f"q, cache: expected one device, got {q.device} and {cache.device}")


def decode_path(q: torch.Tensor, impl: str = "auto") -> str:
    """Which implementation :func:`decode_attention` runs: "triton" (the split-K kernel: CUDA, or the
    interpreter when asked for explicitly, head_dim 64/128) or "reference"."""
    if impl == "reference":
        return "reference"
    ok = q.shape[-1] in DECODE_HEAD_DIMS and kernels_available(q.device)
    if impl == "triton":
        if not ok:
            raise ValueError(f"impl='triton': needs CUDA tensors (or TRITON_INTERPRET=1) and head_dim in "
                             f"{DECODE_HEAD_DIMS}, got {q.device}, head_dim {q.shape[-1]}")
        return "triton"
    return "triton" if ok and q.is_cuda else "reference"


def decode_attention(q: torch.Tensor, cache: QuantizedKV, *, causal: bool = True,
                     sm_scale: Optional[float] = None, impl: str = "auto") -> torch.Tensor:
    """softmax(q·Kᵀ·sm_scale)·V over a quantized KV cache, for 1–16 query rows (decoding; speculative
    drafts). q: ``(B, H, Sq, D)``, H a multiple of the cache's Hkv; ``causal``: the queries are the cache's
    last Sq positions (their own K/V already appended). Output like q. NaN in -> NaN out: the rows that see a
    NaN/inf query value or cached token are NaN, the others unaffected. ``sm_scale``: finite, > 0. Zero heads
    or query rows, or fewer cached tokens than queries: ValueError (a cache has batch, heads, head_dim ≥ 1). ``impl``: "auto" (the split-K kernel
    on CUDA, head_dim 64 or 128; else the reference), "triton", "reference". No autograd (inference)."""
    _validate_decode(q, cache)
    check_impl(impl)
    check_bool("causal", causal)
    if sm_scale is not None:
        check_range("sm_scale", sm_scale, 0.0, float("inf"), lo_open=True)
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    if decode_path(q, impl) == "triton":
        from .decode_kernel import decode_forward_triton  # kernels are imported on first use only
        return decode_forward_triton(q, cache, causal=bool(causal), sm_scale=sm_scale)
    return decode_attention_reference(q, cache, causal=causal, sm_scale=sm_scale).to(q.dtype)


__all__ = ["decode_attention", "decode_attention_reference", "decode_path", "DECODE_MAX_ROWS", "DECODE_HEAD_DIMS"]
