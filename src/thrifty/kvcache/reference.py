"""ShadowKV in plain PyTorch: the spec every kernel is tested against, and the CPU path.

One layer of a batch of B sequences (prompt lengths may differ; token t of sequence b sits at index t, rows
past its length are padding). H KV heads, Hq = G*H query heads (grouped-query), head dim D, chunk size c.

Prefill (:func:`compress_prompt`), once per layer:
  1. keys back to pre-RoPE (RoPE is a rotation: exact up to rounding), one SVD per sequence of the
     (tokens, H*D) matrix: ``K_pre ~= U @ SV`` with U (tokens, rank) shared by the heads, SV (H, rank, D);
  2. the prompt minus a local window (the last ``local_chunks`` chunks plus the remainder) is cut into chunks;
     a landmark is the mean of a chunk's post-RoPE keys;
  3. per KV head, the ``outlier_chunks`` chunks whose keys are least like their landmark (minimum cosine) stay
     exact, as does the local window; the rest can only be reached through selection;
  4. values go to host memory (the model's dtype, or fp8 e4m3 with a per-token scale).

Decode (:func:`decode_step`), one token per step:
  1. score every selectable chunk: softmax over chunks of ``q . landmark / sqrt(D)`` per query head, the max over
     the G query heads of a KV head's group; the top ``sparse_budget / c`` chunks per KV head;
  2. rebuild their keys ``U[pos] @ SV[h]`` and rotate them at their positions; fetch their values from host;
  3. attend over outliers + local + selected + generated tokens.

NaN: a NaN query head gives a NaN output row and does not affect the picks of the other heads of its group; a
NaN prompt value or generated key/value makes NaN the rows that attend it; a non-finite prompt key is refused
(ValueError naming ``keys``). Rows past a sequence's length are never read (zeroed at prefill).

The Quest-style baseline (``selector="quest"``) scores a chunk by ``sum_d max(q_d min_d, q_d max_d)`` over the
chunk's per-channel min/max of exact post-RoPE keys and attends exact keys; it keeps no outliers and gets their
tokens added to its budget instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .config import ShadowKVConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


# ----------------------------------------------------------------------------------------------- RoPE

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE in fp32: ``x*cos + rotate_half(x)*sin``; cos/sin broadcast against x."""
    x = x.float()
    return x * cos + rotate_half(x) * sin


def undo_rope(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`apply_rope` in fp32. Divides by ``cos^2 + sin^2`` so rope types that scale cos/sin
    (YaRN's attention factor) come back exactly too."""
    y = y.float()
    return (y * cos - rotate_half(y) * sin) / (cos * cos + sin * sin)


# ----------------------------------------------------------------------------------------------- host values

@dataclass
class HostValues:
    """Values of every prompt token, (B, H, T, D), in host memory; with fp8 one fp32 scale per (b, h, t)."""
    data: torch.Tensor
    scale: Optional[torch.Tensor]
    dtype: torch.dtype  # what gathered values are returned in

    @classmethod
    def store(cls, v: torch.Tensor, kind: str, device: torch.device) -> "HostValues":
        pin = device.type == "cpu" and v.device.type == "cuda"
        if kind == "fp8":
            amax = v.float().abs().amax(-1).clamp_min(1e-12)
            scale = amax / FP8_MAX
            data = (v.float() / scale[..., None]).to(FP8)
            return cls(_to_host(data, device, pin), _to_host(scale, device, pin), v.dtype)
        return cls(_to_host(v, device, pin), None, v.dtype)

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        """Values at ``positions`` (B, H, N) -> (B, H, N, D) on the positions' device."""
        idx = positions.to(self.data.device)
        data = self.data.view(torch.uint8) if self.scale is not None else self.data  # fp8 has no CPU gather
        rows = data.gather(2, idx[..., None].expand(-1, -1, -1, data.shape[-1]))
        rows = rows.to(positions.device)
        if self.scale is not None:
            rows = rows.view(FP8)
        if self.scale is None:
            return rows
        scale = self.scale.gather(2, idx).to(positions.device)
        return (rows.float() * scale[..., None]).to(self.dtype)

    def bytes_per_sequence(self) -> int:
        """Host bytes of one sequence of this layer at the padded length."""
        b = self.data.shape[0]
        total = self.data.numel() * self.data.element_size()
        if self.scale is not None:
            total += self.scale.numel() * self.scale.element_size()
        return total // b


def _to_host(x: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """Pinned: an exact-size registered host tensor, checked against the safe host budget (``host.py``: the
    caching host allocator would round it up to a power of two), filled straight from the device."""
    if not pin:
        return x.to(device).contiguous()
    from .host import pinned_empty

    out = pinned_empty(x.shape, x.dtype, what=f"host values {tuple(x.shape)} {x.dtype}")
    out.copy_(x)
    return out


# ----------------------------------------------------------------------------------------------- prefill

@dataclass
class LayerState:
    """What one layer keeps after prefill; ``gen_*`` grow by one token per decode step."""
    lengths: torch.Tensor  # (B,) prompt lengths
    n_chunks: torch.Tensor  # (B,) chunks in the selectable region of each prompt
    u: Optional[torch.Tensor]  # (B, T, rank) low-rank factor of pre-RoPE keys, shared by the heads
    sv: Optional[torch.Tensor]  # (B, H, rank, D)
    landmarks: Optional[torch.Tensor]  # (B, H, C, D) chunk means of post-RoPE keys
    radius: Optional[torch.Tensor]  # (B, H, C) fp32: a chunk's largest key-to-landmark distance (ShadowKV only)
    radius_weight: float  # λ of the chunk logit (q.landmark + λ |q| r) / sqrt(D); 0: the paper's score
    chunk_min: Optional[torch.Tensor]  # (B, H, C, D) Quest baseline only
    chunk_max: Optional[torch.Tensor]
    keys_exact: Optional[torch.Tensor]  # (B, H, T, D) post-RoPE, Quest baseline only
    selectable: torch.Tensor  # (B, H, C) bool: a real chunk that is not an outlier
    outlier_ids: torch.Tensor  # (B, H, O) chunk ids kept exact
    dense_k: torch.Tensor  # (B, H, N, D) exact post-RoPE keys of outliers + local window
    dense_v: torch.Tensor
    dense_valid: torch.Tensor  # (B, H, N) bool
    values: HostValues
    gen_k: torch.Tensor  # (B, H, G, D) generated tokens (all valid)
    gen_v: torch.Tensor

    def bytes_on_device_per_sequence(self) -> int:
        parts = [self.u, self.sv, self.landmarks, self.radius, self.chunk_min, self.chunk_max, self.keys_exact,
                 self.dense_k, self.dense_v, self.gen_k, self.gen_v]
        return sum(p.numel() * p.element_size() for p in parts if p is not None) // self.lengths.numel()


def low_rank_keys(k_pre: torch.Tensor, lengths: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One truncated SVD per sequence of its (tokens, H*D) pre-RoPE keys: returns U (B, T, rank) and SV
    (B, H, rank, D), fp32, with ``U[b, :n] @ SV[b, h] ~= k_pre[b, h, :n]``. Rows past a sequence's length are 0.

    The SVD goes through the eigen-decomposition of the small (H*D, H*D) Gram matrix in float64: X = U S V^T
    with X^T X = V S^2 V^T and U = X V / S. Same factors as ``torch.linalg.svd`` for the kept directions, at a
    fraction of its cost when tokens >> H*D (a LAPACK SVD of 1100 x 192 took 0.3 s on the CI CPU)."""
    B, H, T, D = k_pre.shape
    u = k_pre.new_zeros(B, T, rank, dtype=torch.float32)
    sv = k_pre.new_zeros(B, H, rank, D, dtype=torch.float32)
    for b in range(B):
        n = int(lengths[b])
        x = k_pre[b, :, :n].double().transpose(0, 1).reshape(n, H * D)
        evals, evecs = torch.linalg.eigh(x.T @ x)  # ascending
        r = min(rank, n, H * D)
        s = evals.flip(0)[:r].clamp_min(0).sqrt()
        v = evecs.flip(1)[:, :r]  # (H*D, r)
        keep = s > s[0] * 1e-7 if r else s > 0  # directions with no energy get U = 0, not 0/0
        inv = torch.where(keep, 1.0 / s.clamp_min(1e-300), 0.0)
        u[b, :n, :r] = (x @ v * inv).float()
        sv[b, :, :r] = (s[:, None] * v.T).view(r, H, D).transpose(0, 1).float()
    return u, sv


def chunk_layout(lengths: torch.Tensor, config: ShadowKVConfig) -> torch.Tensor:
    """Chunks in the selectable region per sequence: what is left after the local window, in whole chunks."""
    c = config.chunk_size
    return (lengths - config.local_chunks * c).clamp_min(0) // c


def window_mass(window_q: torch.Tensor, k_post: torch.Tensor, lengths: torch.Tensor, n_chunks_total: int,
                chunk: int, block: int = 16384) -> torch.Tensor:
    """(B, H, C) fp32: the attention mass each chunk of the prompt gets from the observation window (SnapKV).
    ``window_q`` (B, Hq, w, D): post-RoPE queries, row j of sequence b at position lengths[b] - w + j (rows
    before position 0 count for nothing); they attend causally over ``k_post`` (B, H, T, D); softmax per query
    head and row, summed over the rows and the KV head's group, then over each chunk's tokens. Keys in blocks
    of ``block`` (two passes: the row maxima and sums, then the mass), so no (Hq, w, T) tensor is whole."""
    B, Hq, w, D = window_q.shape
    H, T = k_post.shape[1], k_post.shape[2]
    dev = k_post.device
    q = window_q.float().reshape(B, H, (Hq // H) * w, D) / math.sqrt(D)  # row g*w + j: head g of the group
    qpos = (lengths.to(dev)[:, None] - w + torch.arange(w, device=dev)).repeat(1, Hq // H)  # (B, G*w)
    row_ok = (qpos >= 0)[:, None, :]

    def scores(t0):
        kb = k_post[:, :, t0:t0 + block].float()
        kpos = t0 + torch.arange(kb.shape[2], device=dev)
        seen = kpos[None, None, :] <= qpos[:, :, None]  # (B, G*w, tb): causal, and never past the length
        return (q @ kb.transpose(-1, -2)).masked_fill(~seen[:, None], float("-inf"))

    m = torch.full(q.shape[:3], float("-inf"), device=dev)
    total = torch.zeros(q.shape[:3], device=dev)
    for t0 in range(0, T, block):
        sc = scores(t0)
        new_m = torch.maximum(m, sc.amax(-1))
        safe = torch.where(torch.isfinite(new_m), new_m, 0.0)
        total = total * torch.exp(torch.where(torch.isfinite(m), m, 0.0) - safe) + torch.exp(sc - safe[..., None]).sum(-1)
        m = new_m
    m = torch.where(torch.isfinite(m), m, 0.0)
    inv = torch.where(row_ok & (total > 0), 1.0 / total.clamp_min(1e-30), 0.0)
    mass = torch.zeros(B, H, max(T, n_chunks_total * chunk), device=dev)
    for t0 in range(0, T, block):
        p = torch.exp(scores(t0) - m[..., None]) * inv[..., None]
        mass[:, :, t0:t0 + p.shape[-1]] = p.sum(2)
    return mass[:, :, :n_chunks_total * chunk].view(B, H, n_chunks_total, chunk).sum(-1)


def choose_outliers(min_cos, radius, mass, chunk_real, O: int, config: ShadowKVConfig) -> torch.Tensor:
    """(B, H, O) outlier chunk ids: first the chunks with the lowest min cosine to their landmark (the paper's
    rule), then, among the rest, ``outlier_window_share`` of O by the observation window's mass (when ``mass`` is
    given) and ``outlier_radius_share`` of O by the largest radius (when ``radius`` is: ShadowKV). Padding chunks
    come last in every ranking."""
    n_rad = O - int(O * (1.0 - config.outlier_radius_share) + 1e-9) if radius is not None else 0
    n_win = 0
    if mass is not None and radius is not None:
        n_win = O - n_rad - int(O * (1.0 - config.outlier_radius_share - config.outlier_window_share) + 1e-9)
    ids = min_cos.topk(O - n_rad - n_win, dim=-1, largest=False).indices  # (B, H, by_cos)
    real = chunk_real[:, None].expand_as(min_cos)
    for n, rank in ((n_win, mass), (n_rad, radius)):
        if n:
            rest = rank.masked_fill(~real, -1.0).scatter(2, ids, -2.0)
            ids = torch.cat((ids, rest.topk(n, dim=-1).indices), 2)
    return ids


def compress_prompt(k_post: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, config: ShadowKVConfig, *, host_device: Optional[torch.device] = None,
                    k_pre: Optional[torch.Tensor] = None, window_q: Optional[torch.Tensor] = None) -> LayerState:
    """Prefill of one layer. ``k_post``/``v``: (B, H, T, D), token t of sequence b at index t; ``lengths`` (B,);
    ``cos``/``sin``: (T, D) the RoPE table at positions 0..T-1. ``k_pre`` skips the un-rotation when the caller
    has the pre-RoPE keys (the reference model's seam). ``window_q``: the observation window's post-RoPE queries
    (B, Hq, w, D), row j of sequence b at position lengths[b] - w + j (:func:`window_mass`), for
    ``config.outlier_window_share``; without them that share goes to the min-cosine rule."""
    B, H, T, D = k_post.shape
    c, dev, dtype = config.chunk_size, k_post.device, k_post.dtype
    lengths = lengths.to(dev)
    _check_finite_keys(k_post, lengths)
    k_post, v, k_pre = _zero_padding(lengths, k_post, v, k_pre)
    n_chunks = chunk_layout(lengths, config)
    C = max(int(n_chunks.max()), 1)
    chunk_real = torch.arange(C, device=dev)[None, :] < n_chunks[:, None]  # (B, C)
    if T < C * c:  # every prompt shorter than one chunk: zero rows so that the (padding) chunk 0 exists, for
        # the chunk views here and for the masked picks of decode (which read U, values, cos at its positions)
        if config.selector == "shadowkv" and k_pre is None:
            k_pre = undo_rope(k_post, cos, sin)
        k_post, v, k_pre = (None if x is None else torch.nn.functional.pad(x, (0, 0, 0, C * c - T))
                            for x in (k_post, v, k_pre))
        T = C * c
    keys_c = k_post[:, :, :C * c].float().view(B, H, C, c, D)
    means = keys_c.mean(3)

    u = sv = landmarks = radius = cmin = cmax = keys_exact = None
    if config.selector == "shadowkv":
        if k_pre is None:
            k_pre = undo_rope(k_post, cos, sin)
        u, sv = low_rank_keys(k_pre, lengths, config.rank)
        u, sv = u.to(dtype), sv.to(dtype)
        landmarks = means.to(dtype)
        radius = (keys_c - means[:, :, :, None]).norm(dim=-1).amax(-1)  # (B, H, C) fp32
    else:
        keys_exact = k_post
        cmin, cmax = keys_c.amin(3).to(dtype), keys_c.amax(3).to(dtype)

    # outliers: the chunks whose least similar key is furthest from the landmark (and, for a share of them, the
    # chunks of the largest radius among the rest)
    min_cos = torch.nn.functional.cosine_similarity(keys_c, means[:, :, :, None], dim=-1).amin(-1)
    min_cos = min_cos.masked_fill(~chunk_real[:, None], float("inf"))
    O = min(config.kept_outlier_chunks, C)
    mass = None
    if window_q is not None and config.outlier_window_share > 0 and O > 0:
        mass = window_mass(window_q, k_post, lengths, C, c)
    outlier_ids = choose_outliers(min_cos, radius, mass, chunk_real, O, config)  # (B, H, O)
    outlier_real = chunk_real[:, None].expand(B, H, C).gather(2, outlier_ids)
    selectable = chunk_real[:, None].expand(B, H, C).clone()
    selectable.scatter_(2, outlier_ids, False)

    # exact tokens: outlier chunks, then the local window [n_chunks*c, length)
    out_pos = (outlier_ids[..., None] * c + torch.arange(c, device=dev)).flatten(2)  # (B, H, O*c)
    out_valid = outlier_real[..., None].expand(-1, -1, -1, c).flatten(2)
    start = n_chunks * c
    L = max(int((lengths - start).max()), 0)
    loc_pos = start[:, None] + torch.arange(L, device=dev)  # (B, L)
    loc_valid = loc_pos < lengths[:, None]
    loc_pos = torch.where(loc_valid, loc_pos, 0)[:, None].expand(B, H, L)
    pos = torch.cat((out_pos, loc_pos), 2)
    valid = torch.cat((out_valid, loc_valid[:, None].expand(B, H, L)), 2)
    dense_k = gather_tokens(k_post, pos)
    dense_v = gather_tokens(v, pos)

    host = HostValues.store(v, config.host_values, host_device or dev)
    empty = k_post.new_zeros(B, H, 0, D)
    return LayerState(lengths=lengths, n_chunks=n_chunks, u=u, sv=sv, landmarks=landmarks, radius=radius,
                      radius_weight=config.radius_weight, chunk_min=cmin, chunk_max=cmax, keys_exact=keys_exact,
                      selectable=selectable, outlier_ids=outlier_ids, dense_k=dense_k, dense_v=dense_v, dense_valid=valid, values=host, gen_k=empty,
                      gen_v=empty.clone())


def _check_finite_keys(k_post: torch.Tensor, lengths: torch.Tensor) -> None:
    """NaN/inf in a prompt key is refused: the SVD mixes every token and head of a sequence, so one bad key would
    turn all of that sequence's rebuilt keys (every head) to NaN, or fail to converge. Padding rows are ignored."""
    T = k_post.shape[2]
    real = torch.arange(T, device=k_post.device)[None, :] < lengths[:, None]  # (B, T)
    bad = (~torch.isfinite(k_post)).any(-1).any(1) & real
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"keys: the prompt key of sequence {b} at token {t} holds NaN/inf; ShadowKV compresses a "
                         "sequence's keys jointly (one SVD over all heads) and refuses non-finite prompt keys")


def _zero_padding(lengths: torch.Tensor, *xs: Optional[torch.Tensor]) -> tuple:
    """Rows past a sequence's length set to 0: padding may hold anything (NaN from a fully masked pad row of
    SDPA), and a masked pick still multiplies its value by a zero weight (0 * NaN = NaN)."""
    T = xs[0].shape[2]
    if bool((lengths >= T).all()):
        return xs
    real = (torch.arange(T, device=lengths.device)[None, :] < lengths[:, None])[:, None, :, None]
    return tuple(None if x is None else torch.where(real, x, torch.zeros((), dtype=x.dtype, device=x.device))
                 for x in xs)


def gather_tokens(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D) at pos (B, H, N) -> (B, H, N, D)."""
    return x.gather(2, pos[..., None].expand(-1, -1, -1, x.shape[-1]))


# ----------------------------------------------------------------------------------------------- decode

def landmark_scores(q: torch.Tensor, state: LayerState) -> torch.Tensor:
    """(B, H, C) chunk scores: per query head the softmax over selectable chunks of
    (q.landmark + λ |q| r)/sqrt(D) (λ = ``radius_weight``, r the chunk's ``radius``), then the max over the query
    heads of each KV head's group. Non-selectable chunks score -1."""
    B, Hq, _, D = q.shape
    H = state.selectable.shape[1]
    qg = q[:, :, 0].float().view(B, H, Hq // H, D)
    if state.landmarks is not None:
        logits = torch.einsum("bhgd,bhcd->bhgc", qg, state.landmarks.float())
        if state.radius_weight:
            logits = logits + state.radius_weight * qg.norm(dim=-1)[..., None] * state.radius[:, :, None]
        logits = logits / math.sqrt(D)
    else:  # Quest: an upper bound of q.k over the chunk from per-channel min/max
        lo = qg[:, :, :, None] * state.chunk_min.float()[:, :, None]
        hi = qg[:, :, :, None] * state.chunk_max.float()[:, :, None]
        logits = torch.maximum(lo, hi).sum(-1) / math.sqrt(D)
    sel = state.selectable[:, :, None]
    probs = logits.masked_fill(~sel, float("-inf")).softmax(-1)
    probs = torch.where(sel, probs, -1.0)  # also clears the NaN of a row with nothing selectable
    # a NaN query head (its own output is NaN anyway) must not decide the picks of the other heads of its group
    probs = torch.where(probs.isnan(), -1.0, probs)
    return probs.amax(2)


def select_chunks(q: torch.Tensor, state: LayerState, config: ShadowKVConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Top chunks per KV head: ids (B, H, K) and whether each pick is a real selectable chunk (a sequence with
    fewer selectable chunks than K gets padding picks)."""
    scores = landmark_scores(q, state)
    K = min(config.select_chunks, scores.shape[-1])
    top = scores.topk(K, dim=-1)
    return top.indices, top.values >= 0


def chunk_positions(ids: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Token positions of chunks: (B, H, K) -> (B, H, K*c)."""
    return (ids[..., None] * chunk_size + torch.arange(chunk_size, device=ids.device)).flatten(2)


def rebuild_keys(state: LayerState, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Keys at ``positions`` (B, H, N): exact ones for the Quest baseline, else ``U[pos] @ SV[h]`` rotated at
    pos (fp32 arithmetic, returned in the cache dtype)."""
    if state.keys_exact is not None:
        return gather_tokens(state.keys_exact, positions)
    B, H, N = positions.shape
    u = state.u.float()
    rows = u.gather(1, positions.reshape(B, H * N, 1).expand(-1, -1, u.shape[-1])).view(B, H, N, -1)
    k_pre = rows @ state.sv.float()  # (B, H, N, D)
    return apply_rope(k_pre, cos[positions], sin[positions]).to(state.dense_k.dtype)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence over a set of keys per KV head: q (B, Hq, 1, D), keys/values (B, H, N, D), valid
    (B, H, N). fp32 softmax; returns (B, Hq, 1, D) in q's dtype."""
    B, Hq, _, D = q.shape
    H = keys.shape[1]
    qg = q.float().view(B, H, Hq // H, D)
    s = torch.einsum("bhgd,bhnd->bhgn", qg, keys.float()) * scale
    s = s.masked_fill(~valid[:, :, None], float("-inf"))
    p = s.softmax(-1)
    out = torch.einsum("bhgn,bhnd->bhgd", p, values.float())
    return out.reshape(B, Hq, 1, D).to(q.dtype)


def append_generated(state: LayerState, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
    state.gen_k = torch.cat((state.gen_k, k_new), 2)
    state.gen_v = torch.cat((state.gen_v, v_new), 2)


def decode_step(state: LayerState, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                config: ShadowKVConfig, cos: torch.Tensor, sin: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode step of one layer: q (B, Hq, 1, D) and the new token's post-RoPE key/value (B, H, 1, D).
    Appends the token, selects, rebuilds, attends. Returns (B, Hq, 1, D)."""
    append_generated(state, k_new, v_new)
    ids, picked = select_chunks(q, state, config)
    c = config.chunk_size
    pos = chunk_positions(ids, c)
    pos_valid = picked[..., None].expand(-1, -1, -1, c).flatten(2)
    k_sel = rebuild_keys(state, pos, cos, sin)
    v_sel = state.values.gather(pos)
    return attend_parts(q, state, k_sel, v_sel, pos_valid, scale)


def attend_parts(q, state: LayerState, k_sel, v_sel, sel_valid, scale: float) -> torch.Tensor:
    """Attention over [outliers + local | selected | generated]."""
    B, H = sel_valid.shape[:2]
    G = state.gen_k.shape[2]
    gen_valid = torch.ones(B, H, G, dtype=torch.bool, device=q.device)
    keys = torch.cat((state.dense_k, k_sel, state.gen_k), 2)
    values = torch.cat((state.dense_v, v_sel, state.gen_v), 2)
    valid = torch.cat((state.dense_valid, sel_valid, gen_valid), 2)
    return attend(q, keys, values, valid, scale)


# ----------------------------------------------------------------------------------------------- reuse buffer

class ChunkReuseBuffer:
    """Temporal locality: the chunks selected at the previous step of a layer keep their rebuilt keys and
    fetched values; at the next step only the chunks not selected last time are rebuilt and fetched. The
    result is by definition what rebuilding everything gives (tested); ``moved``/``kept`` count chunks."""

    def __init__(self):
        self.ids: Optional[torch.Tensor] = None  # (B, H, K)
        self.keys: Optional[torch.Tensor] = None  # (B, H, K, c, D)
        self.values: Optional[torch.Tensor] = None
        self.moved = 0
        self.kept = 0

    def hits(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For each new id: was it selected last step (B, H, K) bool, and in which slot."""
        if self.ids is None or self.ids.shape != ids.shape:
            return torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
        match = ids[..., :, None] == self.ids[..., None, :]
        return match.any(-1), match.int().argmax(-1)

    def step(self, state: LayerState, ids: torch.Tensor, picked: torch.Tensor, chunk_size: int,
             cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hit, slot = self.hits(ids)
        miss = ~hit & picked
        B, H, K = ids.shape
        pos = chunk_positions(ids, chunk_size)
        # only the misses are rebuilt/fetched (the other positions are pointed at chunk 0 and discarded)
        miss_pos = torch.where(miss[..., None].expand(-1, -1, -1, chunk_size).flatten(2), pos, 0)
        new_k = rebuild_keys(state, miss_pos, cos, sin).view(B, H, K, chunk_size, -1)
        new_v = state.values.gather(miss_pos).view(B, H, K, chunk_size, -1)
        if self.keys is not None and self.ids.shape == ids.shape:
            idx = slot[..., None, None].expand(-1, -1, -1, chunk_size, new_k.shape[-1])
            new_k = torch.where(hit[..., None, None], self.keys.gather(2, idx), new_k)
            new_v = torch.where(hit[..., None, None], self.values.gather(2, idx), new_v)
        self.ids, self.keys, self.values = ids, new_k, new_v
        self.moved += int(miss.sum())
        self.kept += int((hit & picked).sum())
        return new_k.flatten(2, 3), new_v.flatten(2, 3)


# ----------------------------------------------------------------------------------------------- accounting

def host_bytes_per_sequence(num_layers: int, kv_heads: int, head_dim: int, tokens: int, value_bytes: int,
                            fp8: bool) -> int:
    """Pinned host bytes one sequence's values take (fp8: one byte per element plus a 4-byte scale per token
    and head)."""
    per_token_head = head_dim * (1 if fp8 else value_bytes) + (4 if fp8 else 0)
    return num_layers * kv_heads * tokens * per_token_head


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """The yardstick: one query over every cached token of each sequence (keys (B, H, S, D) with token t of
    sequence b at t, the first ``lengths[b]`` valid)."""
    B, H, S, _ = k.shape
    valid = (torch.arange(S, device=k.device)[None] < lengths[:, None].to(k.device))[:, None].expand(B, H, S)
    return attend(q, k, v, valid, scale)
