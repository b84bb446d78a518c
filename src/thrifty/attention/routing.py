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


# A transformers prefill call with less attention work than this (B·H·Sq·Sk·D multiply-adds, causal: the ones
# under the mask) goes to transformers' SDPA under impl="auto": ~0.5 ms of GPU work at 450 TFLOP/s, the least that
# hides the quantized path's host time per call (H200 box, 28f8255: ~150-200 µs for validation, the K/V pre-pass
# and the attention launch, against SDPA's ~30) when a small model's forward is host-bound. SmolLM2-135M-shaped
# prefill at 8K (9 heads, 1.9e10) ran 0.94x SDPA through the quantized path and 0.98x with this rule, in one run
# (attention_e2e_h200-prefill-small{,-base}.json; an earlier run said 0.70x, with a 22% spread); the Llama-3.2-1B
# shape at 8K (6.9e10) 0.98-1.00x, the 8B shape at 8K (1.4e11) 1.00x: both stay on the quantized path.
HF_MIN_PREFILL_WORK = 5.6e10


def attention_work(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, causal: bool) -> float:
    """Multiply-adds of Q·Kᵀ of one call (as many again for P·V): causal queries are the last ``q_len`` of
    ``kv_len`` positions, so query i sees kv_len − q_len + i + 1 keys."""
    pairs = q_len * kv_len - (q_len * (q_len - 1) / 2 if causal else 0)
    return float(batch) * heads * pairs * head_dim


def small_prefill_goes_to_sdpa(impl: str, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                               causal: bool) -> bool:
    """True when a transformers attention call (``enable_hf``) on CUDA takes transformers' own SDPA because its
    work is below :data:`HF_MIN_PREFILL_WORK` (``impl="auto"`` only; an explicit ``impl`` is obeyed)."""
    return impl == "auto" and attention_work(batch, heads, q_len, kv_len, head_dim, causal) < HF_MIN_PREFILL_WORK


def training_goes_to_sdpa(impl: str, needs_grad: bool) -> bool:
    """True when a call that needs gradients runs exact SDPA, forward and backward: ``impl="auto"`` only (in
    transformers models, transformers' own SDPA call).
    Why: the quantized forward is inference-only in the paper, and its exact backward recomputes SDPA's
    forward, so a training step paid the quantized forward on top of SDPA's forward and backward: 0.948× SDPA's
    step at 8K on a Llama-3.2-1B shape, 0.972× on 8 Llama-3.1-8B layers (H100, 42abedf, attention_e2e.py).
    Routed to ``sage_attention``'s exact path it was still 0.962× / 0.974× (H200, c2ce4f8: its NaN rule costs
    ~4% there), hence transformers' SDPA itself in models.
    A backward that reuses the quantized forward's output and LSE would only pay where that forward beats
    SDPA's (causal S ≥ 32K at head_dim 128 today). An explicit ``impl`` keeps the quantized forward."""
    return impl == "auto" and needs_grad


# Prefill calls go to the Gluon kernel on sm_90 (``impl="auto"``) from these query lengths, where it was measured
# faster than the Triton kernel, pre-pass included (H200, B=2 H=32 bf16). Head_dim 128, causal, ping-pong (4cb493d,
# attention_gluon_h200-pp128.json): 615 vs 557 TFLOP/s at 8K (447 vs 467 at 4K), 802 vs 727 at 32K. Head_dim 128,
# full, free-running consumers (gluon_config pingpong=False there; same run): 614 vs 590 at 4K (438 vs 450 at 2K),
# 739 vs 636 at 8K, 842 vs 723 at 32K. Head_dim 64 with its 128x128 tiles (gluon_kernel.D64_TILES; ad1a33c,
# attention_gluon_h200-d64.json): full 516 vs 474 at 8K (334 vs 349 at 2K), 586 vs 497 at 32K; causal 405 vs 406 at
# 8K, 517 vs 481 at 32K (4cb493d, attention_gluon_h200-pp.json: 403 vs 421 at 8K).
GLUON_HEAD_DIMS = (64, 128)
GLUON_MIN_QUERIES = {64: 8192, 128: 4096}  # per head_dim
GLUON_MIN_QUERIES_CAUSAL = {64: 16384, 128: 8192}


def prefill_goes_to_gluon(head_dim: int, q_len: int, causal: bool, compute_capability: tuple) -> bool:
    """True when an ``impl="auto"`` prefill call runs the Gluon (Hopper) kernel instead of the Triton kernel:
    sm_90, a head_dim where it was measured faster, and at least ``GLUON_MIN_QUERIES[head_dim]`` query rows
    (``GLUON_MIN_QUERIES_CAUSAL[head_dim]`` causal). What the Gluon kernel does not implement (pv="fp16", Q
    smoothing) still runs on the Triton kernel."""
    if tuple(compute_capability) != (9, 0) or head_dim not in GLUON_HEAD_DIMS:
        return False
    return q_len >= (GLUON_MIN_QUERIES_CAUSAL if causal else GLUON_MIN_QUERIES)[head_dim]
