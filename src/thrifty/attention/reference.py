"""SageAttention2 in readable PyTorch: the specification every kernel is tested against, and the CPU path.

Tensors are (B, H, S, D) queries and (B, Hkv, S, D) keys/values (grouped-query: H a multiple of Hkv).
The algorithm (arXiv 2411.10958, Fig. 3), with every step switchable so that the accuracy study can ablate it:

1. Smooth K: subtract its per-channel mean over tokens. Every score of a query row shifts by the same
   q·mean(K), which softmax cancels: O is unchanged, only the quantization range shrinks (real K has
   channels with a large shared bias).
2. Smooth Q (optional): subtract the mean of each block of queries; add ΔS = mean(q_block)·Kᵀ (fp32) back
   to the scores.
3. Quantize Q and K to INT8 (|x| ≤ 127) or INT4 (|x| ≤ 7) with one scale per group of tokens:
   tensor / block / warp / thread / token granularity (:func:`token_groups`).
4. S = (Q̂·K̂ᵀ)·scale_q·scale_k·sm_scale, with an online softmax over KV tiles of ``block_n`` keys.
5. P̃ = exp(S − running max) ∈ [0, 1] is quantized with a *static* scale (448 for FP8 e4m3, so P̃ = 1
   maps to the largest e4m3 value); V gets one FP8 scale per channel. P̃·V of each tile goes into a fresh
   fp32 partial that is added to the running output (two-level accumulation: the tensor core's imprecise
   accumulator only ever sums one tile).
6. Smooth V (optional): V's per-channel mean is subtracted before quantization and added to the output
   (rows of the softmax sum to one).

Values are simulated exactly: an INT8 or FP8 value times its scale is computed in fp32, which is what the
tensor cores do (8-bit products are exact in fp32, sums of one tile are nearly so).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kv.reference import causal_mask, expand_kv, nonfinite_rows

# SageAttention2-4b as thrifty runs it (``SageConfig(qk_bits=4)``): Q smoothed per group of SMOOTH_Q_BLOCK queries
# (ΔS = one GEMV per group and KV tile), Q and K scaled per token. On the real SmolLM2 (512 tokens x 2 windows,
# 30 layers, cos vs fp64, NOTES.md "4-bit accuracy"): per-64-query smoothing and per-64-key K scales gave mean
# 0.9811 / worst 0.9587; per-token K 0.9889 / 0.9799; with 16-query groups as well 0.9910 / 0.9848.
SMOOTH_Q_BLOCK = 16
K_GRANULARITY_4BIT = "token"

# Largest magnitude of each quantized format; a scale maps a group's absmax onto it.
QMAX = {"int8": 127.0, "int4": 7.0, "e4m3": 448.0, "e5m2": 57344.0}
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
GRANULARITIES = ("tensor", "block", "warp", "thread", "token")
PV_FORMATS = ("fp8", "e4m3", "e5m2", "int8", "fp16", "fp32")
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------- quantizers
def round_to_format(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` (already divided by its scale) rounded to the grid of ``fmt``, returned in fp32."""
    if fmt in ("int8", "int4"):
        q = QMAX[fmt]
        return torch.round(x).clamp_(-q, q)
    if fmt in FP8_DTYPES:
        return x.clamp(-QMAX[fmt], QMAX[fmt]).to(FP8_DTYPES[fmt]).float()
    if fmt == "fp16":
        return x.half().float()
    if fmt == "fp32":
        return x.float()
    raise ValueError(f"fmt: expected one of {list(QMAX) + ['fp16', 'fp32']}, got {fmt!r}")


def token_groups(seq_len: int, granularity: str, *, block: int = 128, warp: int = 16,
                 thread_groups: int = 8, device=None) -> torch.Tensor:
    """Group id of each token position: tokens of one group share one scale.

    ``block``: consecutive tokens per block. ``warp``: consecutive tokens per warp slice (a block is split
    among warps). ``thread``: inside a warp slice, rows ``r`` with equal ``r % thread_groups`` share a scale
    (the MMA register layout: a thread holds rows r and r+8 of a 16-row fragment). ``token``: one per row.
    """
    t = torch.arange(seq_len, device=device)
    if granularity == "tensor":
        return torch.zeros_like(t)
    if granularity == "block":
        return t // block
    if granularity == "warp":
        return t // warp
    if granularity == "thread":
        return (t // warp) * thread_groups + t % thread_groups
    if granularity == "token":
        return t
    raise ValueError(f"granularity: expected one of {list(GRANULARITIES)}, got {granularity!r}")


def quantize_tokens(x: torch.Tensor, fmt: str, granularity: str, **group_kw):
    """Symmetric quantization of (B, H, S, D) ``x`` with one scale per (b, h, token group).

    Returns ``(values, scale)``: ``values`` on the format's grid (fp32), ``scale`` broadcastable to ``x``
    with ``values * scale ≈ x``. ``tensor`` granularity uses one scale for the whole tensor.
    """
    x = x.float()
    B, H, S, D = x.shape
    token_amax = x.abs().amax(dim=-1)  # (B, H, S)
    if granularity == "tensor":
        scale = token_amax.amax().expand(B, H, S)
    else:
        gid = token_groups(S, granularity, device=x.device, **group_kw)
        n_groups = int(gid.max()) + 1 if S else 1
        group_amax = torch.zeros(B, H, n_groups, device=x.device)
        group_amax.scatter_reduce_(2, gid.expand(B, H, S), token_amax, "amax")
        scale = group_amax[:, :, gid]
    scale = (scale / QMAX[fmt]).clamp_min(1e-12)[..., None]  # all-zero groups: any positive scale works
    return round_to_format(x / scale, fmt), scale


def quantize_channels(x: torch.Tensor, fmt: str):
    """One scale per (b, h, channel) over all tokens (how V is quantized): ``(values, scale)``."""
    x = x.float()
    if fmt in ("fp16", "fp32"):
        return round_to_format(x, fmt), torch.ones_like(x[..., :1, :])
    scale = (x.abs().amax(dim=-2, keepdim=True) / QMAX[fmt]).clamp_min(1e-12)
    return round_to_format(x / scale, fmt), scale


# ---------------------------------------------------------------------------------------------- attention
def sage_attention_reference(
    q, k, v, *, causal: bool = False, sm_scale: Optional[float] = None,
    qk_format: str = "int8", q_granularity: str = "token", k_granularity: str = "block",
    pv: str = "fp8", smooth_k: bool = True, smooth_q: bool = False, smooth_v: bool = False,
    block_m: int = 128, block_n: int = 64, warp_rows: int = 16, p_scale: Optional[float] = None,
    two_level_accum: bool = True, accum_mantissa_bits: int = 13, return_lse: bool = False,
):
    """Quantized attention as specified in the module docstring; returns ``out`` (q's dtype) or ``(out, lse)``.

    ``qk_format``: "int8", "int4", "e4m3", "e5m2" or "fp16"/"fp32" (no quantization).
    ``q_granularity`` / ``k_granularity``: one of :data:`GRANULARITIES`; "block" means ``block_m`` queries or
    ``block_n`` keys, "warp" ``warp_rows`` queries (keys: a whole ``block_n`` block, as in SageAttention2),
    "thread" the MMA-fragment row groups (8 for Q, 4 for K, as in SageAttention2's per-thread mode).
    ``pv``: format of P̃ and V: "fp8"/"e4m3", "e5m2", "int8" (static scales 448 / 57344 / 127 for P̃,
    per-channel scales for V), "fp16" or "fp32". ``p_scale`` overrides P̃'s static scale.
    ``two_level_accum=False`` simulates one-level FP8 accumulation: the running output is kept with only
    ``accum_mantissa_bits`` bits of mantissa (a pessimistic model of the FP8 MMA's imprecise adder).
    LSE (natural log, fp32) is of the true scores ``sm_scale·q·k``, smoothing shifts added back.
    """
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    if min(B, H, Sq, Sk, D) == 0:
        return empty_attention(q, k, causal, return_lse)
    # Non-finite inputs: computed as zeros (so that one bad key cannot spread through K's mean or a block's
    # scale), and every output row that attends to one is set to NaN at the end (see nonfinite_rows).
    bad_rows = nonfinite_rows(q, k, v, causal)
    qf, kf, vf = (_finite_or_zero(x.float()) for x in (q, expand_kv(k, H), expand_kv(v, H)))

    # 1. K smoothing: exact for O; the per-row shift q·mean(K)·sm_scale is added back to the LSE only.
    k_mean = kf.mean(dim=2, keepdim=True) if smooth_k else torch.zeros_like(kf[:, :, :1])
    ks = kf - k_mean
    # 2. Q smoothing: remove each query block's mean, remember ΔS = mean·Kᵀ (fp32, unquantized).
    if smooth_q:
        q_mean = _block_mean(qf, block_m)
        qs = qf - q_mean
        delta_s = q_mean @ ks.transpose(-1, -2)  # (B, H, Sq, Sk): one row per query, equal within a block
    else:
        qs, delta_s = qf, None
    # 3. Quantize Q, K.
    if qk_format in ("fp16", "fp32"):
        q_hat, k_hat = round_to_format(qs, qk_format), round_to_format(ks, qk_format)
    else:
        q_vals, q_scale = quantize_tokens(qs, qk_format, q_granularity, block=block_m, warp=warp_rows,
                                          thread_groups=8)
        k_gran = "block" if k_granularity == "warp" else k_granularity
        k_vals, k_scale = quantize_tokens(ks, qk_format, k_gran, block=block_n, warp=block_n, thread_groups=4)
        q_hat, k_hat = q_vals * q_scale, k_vals * k_scale
    # 6. V smoothing, then V and P̃ formats.
    v_mean = vf.mean(dim=2, keepdim=True) if smooth_v else torch.zeros_like(vf[:, :, :1])
    pv_fmt = "e4m3" if pv == "fp8" else pv
    v_vals, v_scale = quantize_channels(vf - v_mean, pv_fmt)
    if p_scale is None:
        p_scale = QMAX.get(pv_fmt, 1.0)

    # 4-5. Online softmax over KV tiles (base 2, as the kernel computes it).
    scale2 = sm_scale * LOG2E
    m = torch.full((B, H, Sq, 1), float("-inf"), device=q.device)
    l = torch.zeros(B, H, Sq, 1, device=q.device)
    acc = torch.zeros(B, H, Sq, D, device=q.device)
    allowed = causal_mask(Sq, Sk, q.device) if causal else None
    for start in range(0, Sk, block_n):
        sl = slice(start, min(start + block_n, Sk))
        s = q_hat @ k_hat[:, :, sl].transpose(-1, -2)
        if delta_s is not None:
            s = s + delta_s[..., sl]
        s = s * scale2
        if allowed is not None:
            s = s.masked_fill(~allowed[:, sl], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows that have seen no key yet
        alpha = torch.exp2(m - m_safe)
        p = torch.exp2(s - m_safe)  # in [0, 1]
        l = l * alpha + p.sum(dim=-1, keepdim=True)  # the normalizer uses fp32 P, as the kernel does
        p_tilde = round_to_format(p * p_scale, pv_fmt)
        partial = p_tilde @ v_vals[:, :, sl]  # fresh fp32 partial of one tile
        if two_level_accum:
            acc = acc * alpha + partial
        else:
            acc = _keep_mantissa(acc * alpha + partial, accum_mantissa_bits)
        m = m_new
    out = acc * v_scale / (l * p_scale)
    out = torch.where(l > 0, out + v_mean, torch.zeros_like(out))  # rows that see no key output zeros
    out = out.masked_fill(bad_rows[..., None], float("nan")).to(q.dtype)
    if not return_lse:
        return out
    lse = (m + torch.log2(l)) / LOG2E  # natural log of Σ exp(sm_scale·s_smoothed)
    lse = lse.squeeze(-1) + (qf @ k_mean.transpose(-1, -2)).squeeze(-1) * sm_scale
    return out, lse.masked_fill(bad_rows, float("nan"))


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def empty_attention(q, k, causal: bool, return_lse: bool):
    """The result of a degenerate size: no batch, heads, queries or head_dim give an empty output; no keys give
    zeros (each row sees no key) with LSE −inf; a row whose query holds NaN/inf is NaN either way."""
    B, H, Sq, D = q.shape
    out = torch.zeros(B, H, Sq, D, dtype=q.dtype, device=q.device)
    lse = torch.full((B, H, Sq), float("-inf"), device=q.device)
    if out.numel() or lse.numel():
        bad = ~torch.isfinite(q).all(dim=-1) if D else torch.zeros_like(lse, dtype=torch.bool)
        out, lse = out.masked_fill(bad[..., None], float("nan")), lse.masked_fill(bad, float("nan"))
    return (out, lse) if return_lse else out


def _block_mean(x, block):
    """Mean over each block of ``block`` consecutive tokens, broadcast back to every token of the block."""
    B, H, S, D = x.shape
    gid = torch.arange(S, device=x.device) // block
    n = int(gid[-1]) + 1 if S else 0
    sums = torch.zeros(B, H, n, D, device=x.device).index_add_(2, gid, x)
    counts = torch.bincount(gid, minlength=n).clamp_min(1).to(x.dtype)[:, None]
    return (sums / counts)[:, :, gid]


def _keep_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Truncates fp32 ``x`` to ``bits`` mantissa bits (round toward zero, like a narrow adder)."""
    drop = 23 - bits
    return (x.view(torch.int32) & ~((1 << drop) - 1)).view(torch.float32)


# ------------------------------------------------------------------------------------------------ metrics
def accuracy_metrics(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """The paper's metrics: cosine similarity, relative L1 (Σ|o−r| / Σ|r|), RMSE; and the max abs error."""
    if out.numel() != ref.numel() or out.numel() == 0:
        raise ValueError(f"out, ref: expected two non-empty tensors of one size, got {tuple(out.shape)} and "
                         f"{tuple(ref.shape)}")
    o, r = out.double().flatten(), ref.double().flatten()
    cos = torch.nn.functional.cosine_similarity(o, r, dim=0).item()
    rel_l1 = ((o - r).abs().sum() / r.abs().sum().clamp_min(1e-30)).item()
    rmse = (o - r).pow(2).mean().sqrt().item()
    return {"cos_sim": cos, "rel_l1": rel_l1, "rmse": rmse, "max_abs": (o - r).abs().max().item(),
            "score": cos * (1.0 - rel_l1)}


def lse_shift_for_smoothing(q, k_mean, sm_scale):
    """``q·mean(K)·sm_scale`` per query (B, H, Sq): what K smoothing removes from the LSE."""
    return (q.float() @ k_mean.float().transpose(-1, -2)).squeeze(-1) * sm_scale


__all__ = ["QMAX", "GRANULARITIES", "PV_FORMATS", "round_to_format", "token_groups", "quantize_tokens",
           "quantize_channels", "sage_attention_reference",
           "accuracy_metrics", "lse_shift_for_smoothing", "empty_attention", "SMOOTH_Q_BLOCK", "K_GRANULARITY_4BIT"]
