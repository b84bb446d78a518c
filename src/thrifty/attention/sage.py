"""The quantized attention function, :func:`sage_attention` (SageAttention2): argument checks, the choice between
the Triton kernel and the PyTorch reference, exact SDPA for short queries and the fallback, and the
exact-attention backward used when fine-tuning through it."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from .._checks import check_bool, check_choice, check_config as _check_config, check_impl, check_range, check_tensor
from ..kv.reference import causal_mask, nonfinite_rows
from ..triton_utils import capability, kernels_available
from .reference import K_GRANULARITY_4BIT, SMOOTH_Q_BLOCK, empty_attention, sage_attention_reference
from .routing import prefill_goes_to_gluon, short_query_goes_to_sdpa, training_goes_to_sdpa

# qk_bits=4 is SageAttention2-4b (arXiv 2411.10958): Q smoothed per group of SMOOTH_Q_BLOCK queries with
# ΔS = mean(q_group)·γ(K)ᵀ added back in fp32, K smoothed; Q and K scaled per token (finer than the paper's
# per-warp/per-thread: more accurate on the real SmolLM2, benchmarks/results/attention_4bit_cosine_cpu.json).
# The 8-bit mode keeps one K scale per KV block (its exponent is folded into one FFMA per score).

KERNEL_HEAD_DIMS = (64, 128)
EXTRA_IMPLS = ("gluon",)  # beyond the library's IMPLS: the Gluon (sm_90) kernel, opt-in


@dataclass(frozen=True)
class SageConfig:
    """How :func:`sage_attention` quantizes (SageAttention2); validated when built, so a call does no checks of
    its own on these. The defaults are SageAttention2-8b.

    qk_bits: 8 (INT8 Q·Kᵀ), or 4: SageAttention2-4b, Q and K in [-7, 7] with Q smoothed per 16 queries (ΔS added
        back), Q and K scales per token (finer than the paper's per-warp, see NOTES.md); still run on the int8
        tensor cores (Hopper has no INT4 MMA: an accuracy mode, not a speed-up). Real SmolLM2 layers: cos mean
        0.991, worst 0.985 at 4 bits against 0.9995 / 0.9991 at 8; use 4 bits through a calibrated per-layer plan
        (:func:`thrifty.attention.calibrate`).
    pv: "fp8" (e4m3 P̃ and per-channel V) or "fp16" (16-bit P·V).
    smooth_k: subtract K's per-channel mean over the keys before quantizing (default; free, and exact for the
        output: softmax cancels the shift).
    smooth_q: remove the mean of each group of 16 queries from Q and add ΔS = mean·γ(K)ᵀ back in fp32. None (default):
        on for 4 bits, off for 8 (``q_smoothed`` holds the resolved choice).
    smooth_v: subtract V's per-channel mean before quantizing and add it to the output.
    """

    qk_bits: int = 8
    pv: str = "fp8"
    smooth_k: bool = True
    smooth_q: Optional[bool] = None
    smooth_v: bool = False
    q_smoothed: bool = field(init=False, repr=False, compare=False)  # smooth_q resolved against qk_bits

    def __post_init__(self):
        check_choice("qk_bits", self.qk_bits, (8, 4))
        check_choice("pv", self.pv, ("fp8", "fp16"))
        check_bool("smooth_k", self.smooth_k)
        if self.smooth_q is not None:
            check_bool("smooth_q", self.smooth_q)
        check_bool("smooth_v", self.smooth_v)
        object.__setattr__(self, "q_smoothed", self.qk_bits == 4 if self.smooth_q is None else self.smooth_q)


DEFAULT_CONFIG = SageConfig()


# thrifty.AttentionConfig is optimize()'s, easily passed here by mistake
_LOOKALIKE = ("AttentionConfig", "build SageConfig(qk_bits=..., pv=...) for this call")


def check_config(config) -> SageConfig:
    """``config`` or the defaults; a TypeError naming ``config`` for anything else."""
    return _check_config(config, SageConfig, DEFAULT_CONFIG, "thrifty.attention.SageConfig", _LOOKALIKE)


def _validate(q, k, v, impl, layout, sm_scale):
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
    check_impl(impl, EXTRA_IMPLS)
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


def _choose_impl(impl, q, causal):
    if impl == "reference":
        return "reference"
    if impl == "gluon":  # CUDA (sm_90) only, no interpreter for Gluon; "auto" picks it where measured faster
        if not q.is_cuda:
            raise ValueError(f"impl='gluon': needs CUDA tensors on a Hopper GPU, got {q.device}")
        return "gluon"
    if impl == "triton":
        if not kernels_available(q.device):
            raise ValueError(f"impl='triton': needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {q.device}")
        return "triton"
    # auto: a kernel on CUDA (the interpreter is for tests, never chosen implicitly); else the reference
    if not (q.is_cuda and kernels_available(q.device)):
        return "reference"
    return "gluon" if prefill_goes_to_gluon(q.shape[-1], q.shape[2], causal, capability(q.device)) else "triton"


def _forward(q, k, v, causal, sm_scale, config, impl, return_lse):
    """(B, H, S, D) tensors, validated; no autograd."""
    qk_bits, pv, smooth_q = config.qk_bits, config.pv, config.q_smoothed
    if impl == "gluon":
        from . import gluon_kernel

        if gluon_kernel.supports(head_dim=q.shape[-1], qk_bits=qk_bits, pv=pv, smooth_q=smooth_q):
            return gluon_kernel.sage_forward_gluon(q, k, v, causal=causal, sm_scale=sm_scale, qk_bits=qk_bits, pv=pv,
                                                   smooth_k=config.smooth_k, smooth_v=config.smooth_v,
                                                   return_lse=return_lse)
        impl = "triton"  # what the Gluon kernel does not implement (pv="fp16", 4 bits, smooth_q, other head dims)
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
                                   smooth_k=config.smooth_k, smooth_v=config.smooth_v, return_lse=return_lse,
                                   smooth_q=smooth_q)
    return sage_attention_reference(
        q, k, v, causal=causal, sm_scale=sm_scale, qk_format="int8" if qk_bits == 8 else "int4",
        pv="fp8" if pv == "fp8" else "fp16", smooth_k=config.smooth_k, smooth_q=smooth_q, smooth_v=config.smooth_v,
        return_lse=return_lse, block_m=SMOOTH_Q_BLOCK, k_granularity=K_GRANULARITY_4BIT if qk_bits == 4 else "block")


def _nan_rows(result, bad_rows, return_lse):
    """Sets the output rows (and LSEs) that depend on a non-finite input to NaN (see ``nonfinite_rows``)."""
    if return_lse:
        return result[0].masked_fill(bad_rows[..., None], float("nan")), result[1].masked_fill(bad_rows, float("nan"))
    return result.masked_fill(bad_rows[..., None], float("nan"))


def one_row_flash_fits(q, k, v) -> bool:
    """True when :func:`one_row_flash` can take this call: one query row over at least one key, CUDA fp16/bf16 of
    one dtype, head_dim a multiple of 8 up to 256, query heads a multiple of the KV heads, unit stride on head_dim,
    no gradient."""
    if not (q.is_cuda and q.shape[2] == 1 and k.shape[2] >= 1 and q.dtype in (torch.float16, torch.bfloat16)
            and k.dtype == q.dtype and v.dtype == q.dtype and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
            and k.shape[1] == v.shape[1] and q.shape[1] % k.shape[1] == 0
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return capability(q.device)[0] >= 8  # torch's FlashAttention-2 build: sm_80 or newer


def one_row_flash(q, k, v, sm_scale: Optional[float]) -> torch.Tensor:
    """Exact attention of one query row (a decode step) through torch's FlashAttention-2 op, past SDPA's backend
    choice. Why: on sm_90, SDPA in torch 2.11 picks cuDNN, which builds a graph on the host for every key length
    it has not seen (4.8 ms per call on the H100 box, 42abedf), and a decode step's key length is always new:
    ~77 ms per token for 16 layers where the kernels need ~10. FlashAttention-2 needs no per-shape build and
    takes grouped KV heads as they are. No mask and no causal flag are needed: one row sees every key."""
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=sm_scale)[0]


def _exact_sdpa(q, k, v, causal, sm_scale, return_lse=False):
    """Exact attention with SDPA (grouped heads, bottom-right causal mask); the fallback and the backward."""
    tq, tk = q.shape[2], k.shape[2]
    if not return_lse and one_row_flash_fits(q, k, v):
        return one_row_flash(q, k, v, sm_scale)
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


def sage_attention(q, k, v, *, causal: bool = False, sm_scale: Optional[float] = None, impl: str = "auto",
                   return_lse: bool = False, layout: str = "bhsd", config: Optional[SageConfig] = None):
    """SageAttention2: softmax(q·kᵀ·sm_scale)·v with INT8 (or INT4-range) Q·K and FP8 P̃·V.

    q: (B, H, Sq, D); k, v: (B, Hkv, Sk, D), H a multiple of Hkv (GQA without copying K/V); with
    ``layout="bshd"`` the sequence axis comes before the heads, (B, S, H, D), in inputs and output.
    ``causal`` with Sq < Sk means the queries are the last Sq positions. Any lengths.
    ``config``: a :class:`SageConfig`, how Q·Kᵀ and P·V are quantized (qk_bits 8 or 4, pv "fp8" or "fp16",
    smooth_k, smooth_q, smooth_v); None: ``SageConfig()``, SageAttention2-8b.
    Queries of 1–16 rows with ``impl="auto"`` go to exact SDPA (see ``routing.py``; the prefill kernel
    would be slower there), and so do their gradients.
    ``impl``: "triton" (CUDA, head_dim 64 or 128; other head dims warn and use exact SDPA), "gluon" (the
    Hopper Gluon kernel; what it does not implement runs on "triton"), "reference" (readable PyTorch, any device
    and head_dim), "auto" (on CUDA "gluon" where it was measured faster, ``routing.prefill_goes_to_gluon``: sm_90,
    head_dim 64 or 128, from ``routing.GLUON_MIN_QUERIES[head_dim]`` query rows, causal from
    ``GLUON_MIN_QUERIES_CAUSAL[head_dim]``; else "triton"; the reference off CUDA).
    ``return_lse``: also return the fp32 log-sum-exp of the scaled scores per query, (B, H, Sq).
    NaN/±inf in q, k or v: every output row that depends on one (its own query row, or a key/value row it
    attends to) is NaN, LSE too; the other rows are computed as if those elements were zero (so one bad key
    never spreads through K smoothing to the whole head). ``sm_scale`` must be finite and > 0.
    Degenerate sizes: zero heads or head_dim 0 raise ValueError; zero batch or queries give an empty output;
    zero keys give zeros (no key to attend to) with LSE −inf.
    Calls that need gradients run exact SDPA with ``impl="auto"`` (``routing.training_goes_to_sdpa``: the
    quantized forward made a training step slower); with an explicit ``impl`` they run the quantized forward
    and the gradients of exact attention (:class:`_QuantizedForwardExactBackward`).
    """
    config = check_config(config)
    q, k, v = _validate(q, k, v, impl, layout, sm_scale)
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    opts = dict(causal=bool(causal), sm_scale=sm_scale, config=config, impl=_choose_impl(impl, q, bool(causal)),
                return_lse=return_lse)
    if min(q.shape[0], q.shape[2], k.shape[2]) == 0:  # no batch, queries or keys: the documented empty result
        result = empty_attention(q, k, bool(causal), return_lse)
        if layout == "bshd":
            return (result[0].transpose(1, 2), result[1]) if return_lse else result.transpose(1, 2)
        return result
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if short_query_goes_to_sdpa(impl, q.shape[2], k.shape[2], causal) or training_goes_to_sdpa(impl, needs_grad):
        # NaN in -> NaN out here too: torch's CPU flash SDPA returns zeros for a NaN query row
        bad_rows = nonfinite_rows(q, k, v, bool(causal))
        result = _exact_sdpa(q, k, v, bool(causal), sm_scale, return_lse)
        result = _nan_rows(result, bad_rows, return_lse)
        if layout == "bshd":
            return (result[0].transpose(1, 2), result[1]) if return_lse else result.transpose(1, 2)
        return result
    result = _QuantizedForwardExactBackward.apply(q, k, v, opts) if needs_grad else _forward(q, k, v, **opts)
    if layout == "bshd":
        return (result[0].transpose(1, 2), result[1]) if return_lse else result.transpose(1, 2)
    return result


__all__ = ["sage_attention", "SageConfig", "KERNEL_HEAD_DIMS", "SMOOTH_Q_BLOCK"]
