"""The kernel path of a ShadowKV decode step, and its static per-layer buffers.

Per layer, one buffer per (sequence, KV head) of ``N = dense + K*c + max_generated`` rows:

    [ outliers + local window (exact, written at prefill) | K selection slots | generated tokens ]

with a validity byte per row. A step:
  1. the new token's key/value go to row ``gen_base + n_generated`` (a device counter: no host sync);
  2. landmark scores (score_kernel) and ``torch.topk`` pick K chunks per KV head;
  3. the reuse plan (:func:`plan_reuse`) keeps every chunk that is still selected in the slot it already
     occupies and sends each newly selected chunk to a slot whose chunk left the selection: hits move nothing
     at all (the public code copies them to the front of its buffer every step);
  4. rebuild_kernel writes the missed chunks' keys and values_kernel their values (from host memory);
  5. attention_kernel attends over the whole buffer.
Every tensor has a fixed shape and nothing reads a value back to the host, so the step is CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_kernel import decode_attention
from .rebuild_kernel import rebuild_keys
from .score_kernel import landmark_scores
from .values_kernel import gather_values


@dataclass
class FastLayer:
    k: torch.Tensor  # (B, H, N, D)
    v: torch.Tensor
    valid: torch.Tensor  # (B, H, N) bool
    slot_ids: torch.Tensor  # (B, H, K) chunk held by each slot, -1 = empty
    n_generated: torch.Tensor  # (1,) int64 on the device
    sel_base: int
    gen_base: int
    last_miss: torch.Tensor  # (B, H, K) bool: which selections the last step moved (for statistics)

    @classmethod
    def from_state(cls, state, K: int, chunk_size: int, max_generated: int) -> "FastLayer":
        B, H, Nd, D = state.dense_k.shape
        sel_base, gen_base = Nd, Nd + K * chunk_size
        N = gen_base + max_generated
        dev, dt = state.dense_k.device, state.dense_k.dtype
        k = torch.zeros(B, H, N, D, dtype=dt, device=dev)
        v = torch.zeros_like(k)
        valid = torch.zeros(B, H, N, dtype=torch.bool, device=dev)
        k[:, :, :Nd], v[:, :, :Nd], valid[:, :, :Nd] = state.dense_k, state.dense_v, state.dense_valid
        G = state.gen_k.shape[2]  # tokens the reference path generated before the switch
        k[:, :, gen_base:gen_base + G], v[:, :, gen_base:gen_base + G] = state.gen_k, state.gen_v
        valid[:, :, gen_base:gen_base + G] = True
        slot_ids = torch.full((B, H, K), -1, dtype=torch.long, device=dev)
        n_gen = torch.full((1,), G, dtype=torch.long, device=dev)
        return cls(k, v, valid, slot_ids, n_gen, sel_base, gen_base, torch.zeros_like(slot_ids, dtype=torch.bool))


def plan_reuse(slot_ids: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each newly selected chunk goes. slot_ids (B, H, K): the chunk in each slot (-1 empty); ids
    (B, H, K): the new selection (distinct per row). Returns (dest slot (B, H, K), miss (B, H, K) bool: must be
    rebuilt/fetched, the new slot_ids). A hit keeps its slot; misses take the freed slots in order."""
    match = ids[..., :, None] == slot_ids[..., None, :]  # (B, H, K new, K slots)
    hit = match.any(-1)
    still_used = match.any(-2)
    miss = ~hit
    free_first = torch.sort(still_used.to(torch.int8), dim=-1, stable=True).indices
    miss_rank = (miss.cumsum(-1) - 1).clamp_min(0)
    dest = torch.where(miss, free_first.gather(-1, miss_rank), match.to(torch.int8).argmax(-1))
    return dest, miss, slot_ids.scatter(-1, dest, ids)


def kernel_decode_step(engine, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                       scale: float) -> torch.Tensor:
    cfg, st = engine.config, engine.states[layer]
    if st.landmarks is None:
        raise ValueError("selector: the kernel path implements ShadowKV's landmarks; use backend='reference' "
                         "for the Quest baseline")
    c = cfg.chunk_size
    K = min(cfg.select_chunks, st.selectable.shape[-1])
    fl = engine.fast[layer]
    if fl is None:
        fl = engine.fast[layer] = FastLayer.from_state(st, K, c, cfg.max_generated)
    row = fl.gen_base + fl.n_generated
    fl.k.index_copy_(2, row, k_new.to(fl.k.dtype))
    fl.v.index_copy_(2, row, v_new.to(fl.v.dtype))
    fl.valid.index_fill_(2, row, True)
    fl.n_generated += 1

    scores = landmark_scores(q, st.landmarks, st.selectable, 1.0 / st.landmarks.shape[-1] ** 0.5)
    top = scores.topk(K, dim=-1)
    dest, miss, slot_ids = plan_reuse(fl.slot_ids, top.indices)
    fl.slot_ids.copy_(slot_ids)  # in place: a captured graph must see this step's slots at the next replay
    fl.last_miss.copy_(miss)
    rebuild_keys(st.u, st.sv, engine.cos, engine.sin, top.indices, dest, miss, fl.k, fl.sel_base, c)
    gather_values(st.values.data, st.values.scale, top.indices, dest, miss, fl.v, fl.sel_base, c)
    picked = torch.zeros_like(miss).scatter_(-1, dest, top.values >= 0)
    fl.valid[:, :, fl.sel_base:fl.gen_base] = picked[..., None].expand(-1, -1, -1, c).flatten(2)
    return decode_attention(q, fl.k, fl.v, fl.valid, scale)
