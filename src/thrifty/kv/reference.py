"""Exact attention in plain PyTorch: the ground truth that every thrifty attention path is tested against
(decoding over the caches here, the quantized prefill in ``thrifty.attention``), and the NaN rule they share.

Tensors are (B, H, Sq, D) queries and (B, Hkv, Sk, D) keys/values (grouped-query: H a multiple of Hkv).
"""

from __future__ import annotations

import torch


def exact_attention(q, k, v, *, causal=False, sm_scale=None, dtype=torch.float64, return_lse=False):
    """Plain softmax attention in ``dtype`` (fp64 by default): the ground truth of the tests.

    ``causal`` with fewer queries than keys means the queries are the *last* positions (bottom-right mask).
    Rows that see no key output zeros and have LSE −inf.
    """
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    s = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * sm_scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = (p @ v.to(dtype)).to(q.dtype)
    return (out, lse.float()) if return_lse else out


def causal_mask(q_len: int, kv_len: int, device=None) -> torch.Tensor:
    """True where query i may see key j: j ≤ i + (kv_len − q_len), queries aligned to the end."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    return j <= i + (kv_len - q_len)


def expand_kv(x, n_heads):
    """(B, Hkv, ...) keys or values repeated to ``n_heads`` query heads (grouped-query attention)."""
    return x if x.shape[1] == n_heads else x.repeat_interleave(n_heads // x.shape[1], dim=1)


def nonfinite_rows(q, k, v, causal: bool) -> torch.Tensor:
    """(B, H, Sq) bool: the output rows that depend on a NaN or ±inf of the inputs — the query row itself, or
    a key or value row the query attends to (with ``causal``, key j is seen by the queries i with
    j ≤ i + Sk − Sq). The contract of every path: these rows are NaN (LSE too), the others are computed as if
    the bad elements were zeros, so they are unaffected (exact attention would also spread a NaN value row to
    the rows that do not see it, through 0·NaN)."""
    H, Sq, Sk = q.shape[1], q.shape[2], k.shape[2]
    bad_q = ~torch.isfinite(q).all(dim=-1)
    bad_kv = ~(torch.isfinite(k).all(dim=-1) & torch.isfinite(v).all(dim=-1))  # (B, Hkv, Sk)
    if causal:
        keys = torch.arange(Sk, device=k.device)
        first_bad = torch.where(bad_kv, keys, Sk).amin(dim=-1, keepdim=True) if Sk else \
            torch.full(bad_kv.shape[:2] + (1,), Sk, device=k.device)
        sees_bad = first_bad <= torch.arange(Sq, device=q.device) + (Sk - Sq)  # (B, Hkv, Sq)
    else:
        sees_bad = bad_kv.any(dim=-1, keepdim=True).expand(-1, -1, Sq)
    return bad_q | expand_kv(sees_bad, H)


__all__ = ["exact_attention", "causal_mask", "expand_kv", "nonfinite_rows"]
