"""The kernel path of a ShadowKV decode step, and its static per-layer buffers.

Per layer, one buffer per (sequence, KV head) of ``N = dense + K*c + max_generated`` rows:

    [ outliers + local window (exact, written at prefill) | K selection slots | generated tokens ]

with a validity byte per row. A step is six launches:
  1. ``score_kernel``: the landmark logits, split over ~4 programs per SM;
  2. ``score_kernel``: the scores (softmax + group max) and their first-level histogram, on the same grid;
  3. ``score_kernel``: on the same grid, the threshold bin from the histogram, the marks of the chunks above it
     and per-program lists of misses and candidates; the last program of each head to finish runs the head's
     tail: the exact top-K among the candidates (radix select) and the reuse plan (a chunk still selected keeps
     its slot, nothing moves; each new one takes a freed slot; ``work[slot]`` says which chunk each slot must
     receive). Program 0 of each head appends the new token (row ``gen_base + n_generated``, a device counter);
  4. ``fill_kernel``: rebuild the keys and fetch the values (from host memory) of those chunks, both in one
     launch so that they overlap;
  5-6. the KV family's split-K decode kernel (``thrifty.kv.decode_kernel.masked_decode_attention``) over the
     whole buffer, invalid rows masked, then the merge of the splits.
Every tensor has a fixed shape and nothing reads a value back to the host, so the step is CUDA-graph capturable
(the reuse state is updated in place). The per-step scratch (logits, scores, marks) is shared by the layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.decode_kernel import masked_decode_attention
from .fill_kernel import fill_slots
from .score_kernel import TUNING, SelectTuning, g_pads, logit_splits, score_and_select


@dataclass
class Scratch:
    """Per-step temporaries of the select stage (one set per engine and shape, shared by the layers)."""
    logits: torch.Tensor  # (B*H, G, C) fp32
    part_m: torch.Tensor  # (B*H, splits, G_PAD) fp32
    part_l: torch.Tensor
    scores: torch.Tensor  # (B, H, C) fp32
    hist: torch.Tensor  # (B*H, bins) int32: first-level histogram of the scores
    key_ref: torch.Tensor  # (B*H,) int32: the key the bins count down from
    mark: torch.Tensor  # (B, H, C) int8: selected this step
    seg_miss: torch.Tensor  # (B*H, splits*span) int32: per mark program, its sure misses (chunk*2 + selectable)
    seg_cand: torch.Tensor  # (B*H, splits*span) int32: per mark program, its candidates (chunk*4 + miss*2 + sel)
    seg_key: torch.Tensor  # (B*H, splits*span) int32: the candidates' score keys
    counts: torch.Tensor  # (B*H, splits, 4) int32: per mark program: misses, candidates, min and max key
    tail_path: torch.Tensor  # (B*H,) int32: how the last tail took its candidates (1 ranked pairwise, 2 radix)
    candidates: torch.Tensor  # (B*H, C) int32: the candidates of the head, in chunk order
    cand_keys: torch.Tensor  # (B*H, C) int32
    miss_list: torch.Tensor  # (B*H, K) int32: newly selected chunks (chunk*2 + selectable)
    logit_splits: tuple[int, int]
    tuning: SelectTuning

    @classmethod
    def allocate(cls, B, H, G, C, K, device, tuning: SelectTuning = TUNING) -> "Scratch":
        splits, span = logit_splits(B * H, C, device, tuning.logit_block)
        g_pad = g_pads(G)[0]
        f32, i32 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int32, device=device)
        R = B * H
        return cls(torch.empty(R, G, C, **f32), torch.empty(R, splits, g_pad, **f32),
                   torch.empty(R, splits, g_pad, **f32), torch.empty(B, H, C, **f32),
                   torch.empty(R, tuning.hist_bins, **i32), torch.empty(R, **i32),
                   torch.empty(B, H, C, dtype=torch.int8, device=device), torch.empty(R, splits * span, **i32),
                   torch.empty(R, splits * span, **i32), torch.empty(R, splits * span, **i32),
                   torch.empty(R, splits, 4, **i32), torch.zeros(R, **i32), torch.empty(R, C, **i32),
                   torch.empty(R, C, **i32),
                   torch.empty(R, K, **i32), (splits, span), tuning)


@dataclass
class FastLayer:
    k: torch.Tensor  # (B, H, N, D)
    v: torch.Tensor
    valid: torch.Tensor  # (B, H, N) bool
    slot_ids: torch.Tensor  # (B, H, K) int32: chunk held by each slot, -1 = empty
    slot_of: torch.Tensor  # (B, H, C) int32: slot holding each chunk, -1 = none
    work: torch.Tensor  # (B, H, K) int32: chunk the last step wrote into each slot, -1 = none (a hit)
    n_generated: torch.Tensor  # (1,) int64 on the device
    sel_base: int
    gen_base: int
    chunk_size: int
    scratch: Scratch

    @property
    def last_miss(self) -> torch.Tensor:
        """(B, H, K) bool: the slots the last step filled (rebuilt and fetched)."""
        return self.work >= 0

    @classmethod
    def from_state(cls, state, K: int, chunk_size: int, max_generated: int, scratch: Scratch) -> "FastLayer":
        B, H, Nd, D = state.dense_k.shape
        C = state.selectable.shape[-1]
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
        i32 = dict(dtype=torch.int32, device=dev)
        return cls(k, v, valid, torch.full((B, H, K), -1, **i32), torch.full((B, H, C), -1, **i32),
                   torch.full((B, H, K), -1, **i32), torch.full((1,), G, dtype=torch.long, device=dev),
                   sel_base, gen_base, chunk_size, scratch)


def fast_layer(engine, layer: int, G: int) -> FastLayer:
    """The layer's kernel-path buffers, built at its first kernel step."""
    fl = engine.fast[layer]
    if fl is None:
        cfg, st = engine.config, engine.states[layer]
        B, H, C = st.selectable.shape
        K = min(cfg.select_chunks, C)
        tuning = engine.select_tuning or TUNING
        key = (B, H, G, C, K, st.selectable.device, tuning)
        scratch = engine.scratch.get(key)
        if scratch is None:
            scratch = engine.scratch[key] = Scratch.allocate(B, H, G, C, K, st.selectable.device, tuning)
        fl = engine.fast[layer] = FastLayer.from_state(st, K, cfg.chunk_size, cfg.max_generated, scratch)
    return fl


def kernel_decode_step(engine, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                       scale: float) -> torch.Tensor:
    st = engine.states[layer]
    if st.landmarks is None:
        raise ValueError("selector: the kernel path implements ShadowKV's landmarks; use impl='reference' "
                         "for the Quest baseline")
    fl = fast_layer(engine, layer, q.shape[1] // k_new.shape[1])
    score_and_select(q, k_new, v_new, st.landmarks, st.selectable, 1.0 / st.landmarks.shape[-1] ** 0.5, fl,
                     radius=st.radius, radius_weight=st.radius_weight)
    fl.n_generated += 1
    fill_slots(fl.work, st.u, st.sv, engine.cos, engine.sin, st.values.data, st.values.scale, fl.k, fl.v,
               fl.sel_base, fl.chunk_size)
    return masked_decode_attention(q, fl.k, fl.v, fl.valid, scale)
