"""A preallocated 16-bit K/V cache behind the reference model's cache seam, for decoding inside a CUDA graph.

Why: a graph replays fixed shapes and fixed addresses, so a cache that grows by concatenation (``KVCache``) or
whose length lives on the host (``QuantizedKVCache``) cannot be captured. :class:`StaticKVCache` keeps each
layer's K/V in buffers of a fixed ``capacity`` and writes new tokens at their positions with ``index_copy_``
(positions read on the device, never on the host).

Two ways out of ``update``:
- prefill and eager calls get the filled prefix (``[:, :, :length]``, a view), as any cache would give;
- in ``graph_mode`` a call of one query row gets the whole buffer, and the keys carry a boolean mask
  (attribute :data:`~thrifty.layers.KEY_MASK_ATTR`, shape (1, 1, 1, capacity)) that is True for the positions
  written so far. The seams that read it (the reference model's ``sdpa_attention``, ``thrifty.attention``'s
  ``sage_seam``) say so with ``fn.reads_key_mask = True``; ``generate(..., cuda_graph=True)`` refuses any other,
  since a seam that ignored the mask would attend to empty slots.
"""

from __future__ import annotations

import torch

from .._checks import check_positive_int
from ..layers import KEY_MASK_ATTR, fused_inference


class StaticKVCache:
    """Post-RoPE keys and values of every layer in ``(B, Hkv, capacity, D)`` buffers (the dtype of the first
    keys written). ``len(cache)`` is the number of positions written, kept on the host: ``update`` adds the new
    tokens in eager mode; in ``graph_mode`` the caller (``generate``) calls :meth:`advance` after each replay."""

    def __init__(self, capacity: int):
        self.capacity = check_positive_int("capacity", capacity)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.lengths: dict[int, int] = {}
        self.graph_mode = False
        self._mask = None  # (positions tensor, its (version, capturing), the mask): see _key_mask
        self.fused_updates = 0  # writes that took the one-launch RoPE + write (update_with_query)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, positions, rope):
        k = rope(k, positions)
        keys, values = self._prepare(layer_idx, k, v, positions)
        keys.index_copy_(2, positions, k.to(keys.dtype))
        values.index_copy_(2, positions, v.to(values.dtype))
        return self._hand_out(layer_idx, keys, values, positions, k.shape[2])

    def update_with_query(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions,
                          rope):
        """``(rope(q), *update(...))``: on CUDA without autograd, with the model's ``RotaryEmbedding`` (its
        ``cos_sin``), one launch rotates q and k and writes k and v at their slots
        (``fused_layers.rope_qk_into_cache``: the same values bit for bit) where four would run; else the two
        calls. The reference model's attention calls it when its cache has it."""
        if not self._fuses(q, k, v, positions, rope):
            return (rope(q, positions), *self.update(layer_idx, k, v, positions, rope))
        from ..fused_layers import rope_qk_into_cache

        keys, values = self._prepare(layer_idx, k, v, positions)
        cos, sin = rope.cos_sin(positions)
        q = rope_qk_into_cache(q, k, v, cos, sin, keys, values, positions)
        self.fused_updates += 1
        return (q, *self._hand_out(layer_idx, keys, values, positions, k.shape[2]))

    @staticmethod
    def _fuses(q, k, v, positions, rope) -> bool:
        return (fused_inference(q) and hasattr(rope, "cos_sin") and positions.ndim == 1
                and q.dtype == k.dtype == v.dtype and q.shape[-1] == k.shape[-1] == v.shape[-1])

    def _prepare(self, layer_idx, k, v, positions):
        """The layer's buffers for ``k``/``v`` (made at the first write), after the checks of a write."""
        if positions.ndim != 1:
            raise ValueError(f"positions: the static cache takes one row of positions (T,) shared by the batch, "
                             f"got shape {tuple(positions.shape)}")
        keys, values = self._buffers(layer_idx, k, v)
        T = k.shape[2]
        start = self.lengths[layer_idx]
        if not self.graph_mode and start + T > self.capacity:
            raise ValueError(f"capacity: {start} cached + {T} new tokens exceed the static cache's {self.capacity}; "
                             "build it with a larger capacity")
        if self.graph_mode and T != 1:
            raise ValueError(f"input_ids: graph_mode decodes one token per step, got {T}")
        return keys, values

    def _hand_out(self, layer_idx, keys, values, positions, T):
        """What a write returns: the whole buffers with the mask of written slots in graph mode, else the filled
        prefix (and the layer's length counts the new tokens)."""
        if self.graph_mode:
            setattr(keys, KEY_MASK_ATTR, self._key_mask(positions, keys.device))
            return keys, values
        start = self.lengths[layer_idx]
        self.lengths[layer_idx] = start + T
        return keys[:, :, : start + T], values[:, :, : start + T]

    def _key_mask(self, positions, device):
        """The (1, 1, 1, capacity) mask of written slots, made once per step and shared by every layer (keyed on
        the positions tensor, its in-place version and the capture state, as the model's RoPE reuses cos/sin)."""
        try:
            version = positions._version
        except RuntimeError:  # an inference-mode tensor keeps no version: no reuse across steps then
            version = object()
        key = (version, torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())
        if self._mask is None or self._mask[0] is not positions or self._mask[1] != key:
            mask = (torch.arange(self.capacity, device=device) <= positions[-1]).view(1, 1, 1, -1)
            self._mask = (positions, key, mask)
        return self._mask[2]

    def _buffers(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        if layer_idx not in self.keys:
            if self.graph_mode:
                raise ValueError("graph_mode: prefill the cache eagerly first (the buffers are made then)")
            B, H, _, D = k.shape
            self.keys[layer_idx] = torch.zeros(B, H, self.capacity, D, dtype=k.dtype, device=k.device)
            self.values[layer_idx] = torch.zeros(B, H, self.capacity, v.shape[3], dtype=k.dtype, device=k.device)
            self.lengths[layer_idx] = 0
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys.shape[0] != k.shape[0] or keys.shape[1] != k.shape[1] or keys.shape[3] != k.shape[3]:
            raise ValueError(f"input_ids: batch/heads {tuple(k.shape[:2])} and head_dim {k.shape[3]} do not match "
                             f"the cache's {tuple(keys.shape[:2])} and {keys.shape[3]}; use a new cache")
        return keys, values

    def reset(self) -> None:
        """Empties the cache for a new prompt, keeping its buffers (and so their addresses, which a captured
        graph reads): every layer's length back to 0, eager mode."""
        for i in self.lengths:
            self.lengths[i] = 0
        self.graph_mode = False

    def advance(self, n: int = 1) -> None:
        """Counts ``n`` more positions as written in every layer (after a graph replay wrote them)."""
        for i in self.lengths:
            self.lengths[i] += n

    def __len__(self) -> int:
        return self.lengths.get(0, 0)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))


__all__ = ["StaticKVCache"]
