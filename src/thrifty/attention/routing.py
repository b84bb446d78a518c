"""Which path an attention call takes. The prefill kernel works on 64-row query tiles after a K/V
quantization pre-pass: for a query of a few rows (decoding, speculative drafts) both are waste, and SDPA's
decode kernels are the floor to beat. Only a quantized KV cache kept across steps (``thrifty.kv``) can beat
it, by reading half the bytes; without one, short queries go to SDPA."""

from __future__ import annotations

from ..kv.decode import DECODE_MAX_ROWS


def short_query_goes_to_sdpa(impl: str, q_len: int, kv_len: int, causal: bool) -> bool:
    """True when ``sage_attention`` hands the call to exact SDPA: ``impl="auto"`` (an explicit "triton" or
    "reference" is obeyed), 1–16 query rows, and every causal row sees at least one key (SDPA gives nan
    for rows that see none; the quantized paths give zeros)."""
    return impl == "auto" and 1 <= q_len <= DECODE_MAX_ROWS and (not causal or q_len <= kv_len)
