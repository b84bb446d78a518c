"""Public API: :func:`sage_attention`, the model seam, exact-backward training, per-layer 4/8-bit plans."""

from __future__ import annotations

import functools
import json
import math
import warnings
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F

from .._checks import check_choice, check_number, check_range, check_tensor
from ..triton_utils import kernels_available
from .reference import accuracy_metrics, causal_mask, empty_attention, nonfinite_rows, sage_attention_reference
from .routing import short_query_goes_to_sdpa

# qk_bits=4 is SageAttention2-4b (arXiv 2411.10958): Q smoothed per block of SMOOTH_Q_BLOCK queries (one CTA
# tile of the GPU kernel) with ΔS = mean(q_block)·γ(K)ᵀ added back in fp32, K smoothed and quantized per KV
# block. Q scales per token, finer than the paper's per-warp (16 rows): free in Triton, and more accurate on
# the real SmolLM2 (worst layer 0.9587 vs 0.9513, benchmarks/results/attention_4bit_cosine_cpu.json).
SMOOTH_Q_BLOCK = 64

KERNEL_HEAD_DIMS = (64, 128)
PLAN_FORMAT = "thrifty.sage_plan/1"


def _validate(q, k, v, qk_bits, pv, impl, layout, sm_scale):
    """Checks arguments; returns q, k, v as (B, H, S, D) views."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, ndim=4, floating=True)
    check_choice("layout", layout, ("bhsd", "bshd"))
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q: expected float16, bfloat16 or float32, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: expected one device, got {q.device}, {k.device}, {v.device}")
    check_choice("qk_bits", qk_bits, (8, 4))
    check_choice("pv", pv, ("fp8", "fp16"))
    check_choice("impl", impl, ("auto", "triton", "gluon", "reference"))
    if sm_scale is not None:
        check_range("sm_scale", sm_scale, 0.0, float("inf"), lo_open=True)
    B, H, _, D = q.shape
    if H == 0 or k.shape[1] == 0:
        raise ValueError(f"q, k: expected at least one head, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if D == 0:
        raise ValueError(f"q: expected head_dim > 0, got shape {tuple(q.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k, v: expected equal shapes, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k: expected batch {B} and head_dim {D} like q {tuple(q.shape)}, got {tuple(k.shape)}")
    if H % k.shape[1]:
        raise ValueError(f"k: query heads ({H}) must be a multiple of key/value heads ({k.shape[1]})")
    return q, k, v


def _choose_impl(impl, q):
    if impl == "reference":
        return "reference"
    if impl == "gluon":  # issue #28: opt-in until measured; CUDA (sm_90) only, no interpreter for Gluon
        if not q.is_cuda:
            raise ValueError(f"impl='gluon': needs CUDA tensors on a Hopper GPU, got {q.device}")
        return "gluon"
    if impl == "triton":
        if not kernels_available(q.device):
            raise ValueError(f"impl='triton': needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {q.device}")
        return "triton"
    # auto: the kernel on CUDA (the interpreter is for tests, never chosen implicitly); else the reference
    return "triton" if q.is_cuda and kernels_available(q.device) else "reference"


def _forward(q, k, v, causal, sm_scale, qk_bits, pv, smooth_k, smooth_q, smooth_v, impl, return_lse):
    """(B, H, S, D) tensors, validated; no autograd."""
    if impl == "gluon":
        from . import gluon_kernel

        if gluon_kernel.supports(head_dim=q.shape[-1], qk_bits=qk_bits, pv=pv, smooth_q=smooth_q):
            return gluon_kernel.sage_forward_gluon(q, k, v, causal=causal, sm_scale=sm_scale, qk_bits=qk_bits, pv=pv,
                                                   smooth_k=smooth_k, smooth_v=smooth_v, return_lse=return_lse)
        impl = "triton"  # what the Gluon kernel does not implement (pv="fp16", smooth_q, other head dims)
    if impl == "triton":
        if q.shape[-1] not in KERNEL_HEAD_DIMS:
            warnings.warn(f"sage_attention: head_dim {q.shape[-1]} has no kernel (only {KERNEL_HEAD_DIMS}); "
                          "falling back to exact SDPA", stacklevel=3)
            bad_rows = nonfinite_rows(q, k, v, causal)  # NaN in -> NaN out (SDPA would not say which rows)
            return _nan_rows(_exact_sdpa(q, k, v, causal, sm_scale, return_lse), bad_rows, return_lse)
        from .attn_kernel import sage_forward_triton  # compiled kernels are imported on first use only
        # NaN in -> NaN out happens inside the kernels: the passes that read q, k and v anyway detect the
        # non-finite rows (no extra launch, no host sync; NOTES.md "NaN rule")
        return sage_forward_triton(q, k, v, causal=causal, sm_scale=sm_scale, qk_bits=qk_bits, pv=pv,
                                   smooth_k=smooth_k, smooth_v=smooth_v, return_lse=return_lse, smooth_q=smooth_q)
    return sage_attention_reference(
        q, k, v, causal=causal, sm_scale=sm_scale, qk_format="int8" if qk_bits == 8 else "int4",
        pv="fp8" if pv == "fp8" else "fp16", smooth_k=smooth_k, smooth_q=smooth_q, smooth_v=smooth_v,
        return_lse=return_lse, block_m=SMOOTH_Q_BLOCK)


def _nan_rows(result, bad_rows, return_lse):
    """Sets the output rows (and LSEs) that depend on a non-finite input to NaN (see ``nonfinite_rows``)."""
    if return_lse:
        return result[0].masked_fill(bad_rows[..., None], float("nan")), result[1].masked_fill(bad_rows, float("nan"))
    return result.masked_fill(bad_rows[..., None], float("nan"))


def _exact_sdpa(q, k, v, causal, sm_scale, return_lse=False):
    """Exact attention with SDPA (grouped heads, bottom-right causal mask); the fallback and the backward."""
    tq, tk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if causal and tq != tk:
        mask = causal_mask(tq, tk, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale, enable_gqa=gqa)
    if not return_lse:
        return out
    ke = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1) if gqa else k
    s = (q.float() @ ke.float().transpose(-1, -2)) * sm_scale
    if causal:
        s = s.masked_fill(~causal_mask(tq, tk, q.device), float("-inf"))
    return out, torch.logsumexp(s, dim=-1)


class _QuantizedForwardExactBackward(torch.autograd.Function):
    """Forward: quantized attention. Backward: recompute exact attention with SDPA in the inputs' dtype and
    differentiate that (straight-through), so fine-tuning through the quantized forward gets true gradients."""

    @staticmethod
    def forward(ctx, q, k, v, opts):
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.sm_scale = opts["causal"], opts["sm_scale"]
        result = _forward(q, k, v, **opts)
        if opts["return_lse"]:
            ctx.mark_non_differentiable(result[1])
        return result

    @staticmethod
    def backward(ctx, grad_out, *unused):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            q_, k_, v_ = (x.detach().requires_grad_() for x in (q, k, v))
            out = _exact_sdpa(q_, k_, v_, ctx.causal, ctx.sm_scale)
            dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), grad_out)
        return dq, dk, dv, None


def sage_attention(q, k, v, *, causal: bool = False, sm_scale: Optional[float] = None, qk_bits: int = 8,
                   pv: str = "fp8", smooth_k: bool = True, smooth_q: Optional[bool] = None, smooth_v: bool = False,
                   impl: str = "auto", return_lse: bool = False, layout: str = "bhsd"):
    """SageAttention2: softmax(q·kᵀ·sm_scale)·v with INT8 (or INT4-range) Q·K and FP8 P̃·V.

    q: (B, H, Sq, D); k, v: (B, Hkv, Sk, D), H a multiple of Hkv (GQA without copying K/V); with
    ``layout="bshd"`` the sequence axis comes before the heads, (B, S, H, D), in inputs and output.
    ``causal`` with Sq < Sk means the queries are the last Sq positions. Any lengths.
    ``qk_bits``: 8, or 4: SageAttention2-4b, Q and K in [-7, 7] with Q smoothed (ΔS added back), Q scales
    per token (finer than the paper's per-warp, see NOTES.md); still run on the int8 tensor cores (Hopper has
    no INT4 MMA: an accuracy mode, not a speed-up). ``pv``: "fp8" (e4m3 P̃ and per-channel V) or "fp16" (16-bit P·V).
    ``smooth_k`` (default, free and exact for O), ``smooth_v`` (mean added back), ``smooth_q`` (mean of each
    64-query block removed, ΔS = mean·γ(K)ᵀ added back in fp32; default: on for 4 bits, off for 8).
    Queries of 1–16 rows with ``impl="auto"`` go to exact SDPA (see ``routing.py``; the prefill kernel
    would be slower there), and so do their gradients.
    ``impl``: "triton" (CUDA, head_dim 64 or 128; other head dims warn and use exact SDPA), "gluon" (the
    Hopper Gluon kernel of issue #28, opt-in and unmeasured; what it does not implement runs on "triton"), "reference"
    (readable PyTorch, any device and head_dim), "auto" (triton on CUDA, else reference).
    ``return_lse``: also return the fp32 log-sum-exp of the scaled scores per query, (B, H, Sq).
    NaN/±inf in q, k or v: every output row that depends on one (its own query row, or a key/value row it
    attends to) is NaN, LSE too; the other rows are computed as if those elements were zero (so one bad key
    never spreads through K smoothing to the whole head). ``sm_scale`` must be finite and > 0.
    Degenerate sizes: zero heads or head_dim 0 raise ValueError; zero batch or queries give an empty output;
    zero keys give zeros (no key to attend to) with LSE −inf.
    Gradients, when inputs require them, are those of exact attention (see
    :class:`_QuantizedForwardExactBackward`).
    """
    q, k, v = _validate(q, k, v, qk_bits, pv, impl, layout, sm_scale)
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    smooth_q = (qk_bits == 4) if smooth_q is None else bool(smooth_q)
    opts = dict(causal=bool(causal), sm_scale=sm_scale, qk_bits=qk_bits, pv=pv, smooth_k=smooth_k,
                smooth_q=smooth_q, smooth_v=smooth_v, impl=_choose_impl(impl, q),
                return_lse=return_lse)
    if min(q.shape[0], q.shape[2], k.shape[2]) == 0:  # no batch, queries or keys: the documented empty result
        result = empty_attention(q, k, bool(causal), return_lse)
        if layout == "bshd":
            return (result[0].transpose(1, 2), result[1]) if return_lse else result.transpose(1, 2)
        return result
    if short_query_goes_to_sdpa(impl, q.shape[2], k.shape[2], causal):
        # NaN in -> NaN out here too: torch's CPU flash SDPA returns zeros for a NaN query row
        bad_rows = nonfinite_rows(q, k, v, bool(causal))
        result = _exact_sdpa(q, k, v, bool(causal), sm_scale, return_lse)
        result = _nan_rows(result, bad_rows, return_lse)
        if layout == "bshd":
            return (result[0].transpose(1, 2), result[1]) if return_lse else result.transpose(1, 2)
        return result
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    result = _QuantizedForwardExactBackward.apply(q, k, v, opts) if needs_grad else _forward(q, k, v, **opts)
    if layout == "bshd":
        return (result[0].transpose(1, 2), result[1]) if return_lse else result.transpose(1, 2)
    return result


# ---------------------------------------------------------------------------------------- model seam
def sage_seam(**options) -> Callable:
    """An attention function with the reference model's seam signature ``fn(q, k, v, *, causal, scale)``:
    ``model.set_attention(sage_seam(qk_bits=8))``. ``options`` are :func:`sage_attention`'s keywords."""
    check_sage_options(options)
    fn = functools.partial(_seam_call, options=options)
    fn.options = options
    fn.reads_kv_codes = True  # a QuantizedKVCache hands it tagged keys for decode steps (see _seam_call)
    return fn


def check_sage_options(options: dict) -> None:
    """sage_attention keywords (qk_bits, pv, smooth_*, impl), checked by name when a seam or a transformers
    model is set up rather than at its first forward."""
    allowed = {"qk_bits", "pv", "smooth_k", "smooth_q", "smooth_v", "impl"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"options: unknown sage_attention option(s) {unknown}; expected some of {sorted(allowed)}")
    x = torch.zeros(1, 1, 1, 8)  # a dry run on the CPU reference path checks every value by name
    sage_attention(x, x, x, **{**options, "impl": "reference"})
    check_choice("impl", options.get("impl", "auto"), ("auto", "triton", "gluon", "reference"))


def _seam_call(q, k, v, *, causal, scale, options):
    cache = getattr(k, "_thrifty_kv", None)  # a decode step's keys from a QuantizedKVCache: read its codes
    if cache is not None:
        from .decode import decode_attention
        return decode_attention(q, cache, causal=causal, sm_scale=scale)
    return sage_attention(q, k, v, causal=causal, sm_scale=scale, **options)


# ---------------------------------------------------------------------------------------- calibration
def _attention_layers(model):
    try:
        return [layer.self_attn for layer in model.model.layers]
    except AttributeError:
        raise TypeError("model: expected thrifty's reference LlamaForCausalLM (model.model.layers[i].self_attn)") from None


@torch.no_grad()
def calibrate(model, batches: Iterable, *, threshold: float = 0.99, low_bits: int = 4,
              return_scores: bool = False, **options):
    """Per-layer plan {layer index: bits}: 4 where the layer's 4-bit attention scores at least ``threshold``
    on every batch, else 8. Score = cos_sim·(1 − relative L1) of the 4-bit output against the layer's
    full-precision attention, on the layer's real inputs (the model runs in full precision meanwhile).

    ``batches``: input-id tensors (B, T) (or tuples whose first item is one). ``return_scores``: return
    ``(plan, {layer: worst score})``. ``options``: :func:`sage_attention` keywords.
    """
    check_range("threshold", threshold, 0.0, 1.0)
    check_choice("low_bits", low_bits, (4, 8))
    attns = _attention_layers(model)
    worst = [1.0] * len(attns)
    originals = [a.attention for a in attns]

    def recorder(i, original):
        def fn(q, k, v, *, causal, scale):
            exact = original(q, k, v, causal=causal, scale=scale)
            quant = sage_attention(q, k, v, causal=causal, sm_scale=scale, qk_bits=low_bits, **options)
            score = accuracy_metrics(quant, exact)["score"]
            if math.isnan(score):  # min() would skip a NaN and keep the layer's 1.0: a silent "4 bits is fine"
                raise ValueError(f"batches: layer {i}'s attention is NaN on this batch (NaN weights or inputs); "
                                 "cannot calibrate")
            worst[i] = min(worst[i], score)
            return exact
        return fn

    try:
        for i, a in enumerate(attns):
            a.attention = recorder(i, originals[i])
        n = 0
        for batch in batches:
            ids = batch[0] if isinstance(batch, (tuple, list)) else batch
            model(ids.to(next(model.parameters()).device))
            n += 1
        if n == 0:
            raise ValueError("batches: expected at least one batch")
    finally:
        for a, original in zip(attns, originals):
            a.attention = original
    plan = plan_from_scores(dict(enumerate(worst)), threshold, low_bits=low_bits)
    return (plan, dict(enumerate(worst))) if return_scores else plan


def plan_from_scores(scores: dict, threshold: float, *, low_bits: int = 4) -> dict:
    """{layer: bits}: ``low_bits`` where the layer's calibration score reaches ``threshold``, else 8. Lets one
    :func:`calibrate` run (``return_scores=True``) give the plans of several thresholds."""
    check_range("threshold", threshold, 0.0, 1.0)
    check_choice("low_bits", low_bits, (4, 8))
    if not isinstance(scores, dict):
        raise TypeError(f"scores: expected a dict {{layer: score}}, got {type(scores).__name__}")
    for i, s in scores.items():
        check_number(f"scores[{i!r}]", s, finite=False)
    return {i: (low_bits if s >= threshold else 8) for i, s in scores.items()}


def save_plan(plan: dict, path, *, scores: Optional[dict] = None, **meta) -> Path:
    """Writes ``plan`` as JSON: {"format", "layers": {"0": 8, ...}, "scores"?, "meta"?}."""
    _check_plan(plan)
    doc = {"format": PLAN_FORMAT, "layers": {str(i): int(b) for i, b in sorted(plan.items())}}
    if scores:
        doc["scores"] = {str(i): float(s) for i, s in sorted(scores.items())}
    if meta:
        doc["meta"] = meta
    from .._io import atomic_path, check_output_path

    path = check_output_path("path", path)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def load_plan(path) -> dict:
    """Reads a plan written by :func:`save_plan`: {layer index: bits}."""
    from .._io import read_json

    doc = read_json(path, "sage plan")
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise ValueError(f"{path}: not a thrifty sage plan (expected format {PLAN_FORMAT!r})")
    layers = doc.get("layers")
    if not isinstance(layers, dict) or not all(isinstance(i, str) and i.isdigit() and type(b) is int
                                               for i, b in layers.items()):
        raise ValueError(f"{path}: corrupted plan (expected \"layers\": {{\"0\": 4 or 8, ...}})")
    plan = {int(i): b for i, b in layers.items()}
    try:
        _check_plan(plan)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return plan


def _check_plan(plan):
    if not isinstance(plan, dict):
        raise TypeError(f"plan: expected a dict {{layer: bits}}, got {type(plan).__name__}")
    for i, b in plan.items():
        if not isinstance(i, int) or b not in (4, 8):
            raise ValueError(f"plan: expected int layer -> 4 or 8, got {i!r} -> {b!r}")


def apply_plan(model, plan: dict, **options) -> None:
    """Sets each layer's attention to sage attention with the plan's bits (layers not in the plan: 8)."""
    _check_plan(plan)
    attns = _attention_layers(model)
    bad = [i for i in plan if not 0 <= i < len(attns)]
    if bad:
        raise ValueError(f"plan: layers {bad} do not exist (model has {len(attns)})")
    for i, a in enumerate(attns):
        a.attention = sage_seam(qk_bits=plan.get(i, 8), **options)


__all__ = ["sage_attention", "sage_seam", "calibrate", "save_plan", "load_plan", "apply_plan",
           "KERNEL_HEAD_DIMS"]
