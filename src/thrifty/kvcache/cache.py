"""``ShadowKVCache(model, config)``: one object that plugs ShadowKV into a transformers Llama-family model
(``model.generate(ids, past_key_values=cache)``) or into thrifty's reference model (its pre-RoPE cache seam).

The cache decides dense or compressed from the first prompt and feeds the :class:`~.engine.ShadowKVEngine`;
on a transformers model it switches the attention implementation to ShadowKV's (see ``hf.py`` for why a cache
needs an attention function, and the marks it leaves on the attention modules).
"""

from __future__ import annotations

from typing import Optional

import torch

from .config import ShadowKVConfig
from .engine import ShadowKVEngine
from .hf import (ATTN_NAME, PENDING_ATTR, PREVIOUS_ATTR, ROUTES_SHADOWKV_ATTR, ShadowKVLayer, _cache_base,
                 find_rotary, register_attention, valid_keys)


def _is_thrifty_model(model) -> bool:
    from ..models.llama import LlamaForCausalLM

    return isinstance(model, LlamaForCausalLM)


class ShadowKVCache(_cache_base()):
    """A ShadowKV KV cache for one ``generate`` call (one batch).

    ``cache = ShadowKVCache(model, ShadowKVConfig(...))`` then ``model.generate(input_ids, past_key_values=cache,
    attention_mask=...)`` on a transformers Llama-family model (left padding for prompts of different lengths),
    or ``thrifty.models.generate(model, ids, n, cache_factory=lambda: ShadowKVCache(model, cfg))`` on the
    reference model. A prompt shorter than ``config.min_prompt_len`` stays dense (a plain KV cache).

    ``impl`` picks the kernels: ``"auto"`` (Triton on CUDA where they apply, the reference elsewhere), ``"triton"``
    (forced: CUDA, or the CPU under ``TRITON_INTERPRET=1``) or ``"reference"``; ``cache.engine.impl`` changes it
    later. ``cache.engine`` holds the per-layer state (``engine.stats`` says which path ran);
    :meth:`host_bytes_per_sequence` reports the pinned value bytes.

    NaN: a NaN in a query head, a prompt value or a generated key/value gives NaN in exactly the output rows that
    attend it; a NaN/inf prompt key is refused at compression (ValueError naming ``keys``), since the low-rank
    SVD mixes every token and head of a sequence.
    """

    # the settings the compressed prompt depends on: forks must share them (the rest are per decode step)
    COMPRESSION_FIELDS = ("rank", "chunk_size", "outlier_chunks", "local_chunks", "host_values", "selector",
                          "outlier_radius_share", "outlier_window_share", "observation_window")

    def __new__(cls, model=None, config: Optional[ShadowKVConfig] = None, *, impl: str = "auto"):
        if cls is ShadowKVCache and model is not None and _is_thrifty_model(model):
            cls = ThriftyModelShadowKVCache
        return super().__new__(cls)

    def __init__(self, model, config: Optional[ShadowKVConfig] = None, *, impl: str = "auto"):
        config = ShadowKVConfig() if config is None else config
        num_layers, kv_heads, head_dim = model_shape(model)
        self.engine = ShadowKVEngine(config, num_layers, kv_heads, head_dim, self._rope_table_fn(model), impl=impl)
        self.config = config
        self._dense: Optional[bool] = None  # decided by the first prompt
        self._dense_k: list = [None] * num_layers
        self._dense_v: list = [None] * num_layers
        self._prompt_width = 0
        self._setup_model(model)
        layers = [ShadowKVLayer(self, i) for i in range(num_layers)]
        if _cache_base() is not object:
            super().__init__(layers=layers)

    # -- shared
    @property
    def dense(self) -> bool:
        """True when the prompt was too short to compress (None before the prompt)."""
        return self._dense

    def logical_length(self, layer: int = 0) -> int:
        if self._dense_k[layer] is not None:
            return self._dense_k[layer].shape[2]
        if self.engine.compressed(layer):
            return self._prompt_width + self.engine.generated(layer)
        return 0

    def host_bytes_per_sequence(self) -> int:
        return self.engine.host_bytes_per_sequence()

    def load_prompt(self, keys_values, lengths: Optional[torch.Tensor] = None, window_queries=None) -> None:
        """Fills the cache from a prompt already run densely: per layer the post-RoPE keys and values
        (B, H, T, D), token t of sequence b at index t (what a transformers ``DynamicCache`` holds), ``lengths``
        (B,) when prompts differ. Lets several configurations share one prefill. ``window_queries``: per layer
        the post-RoPE queries (B, Hq, w, D) of each prompt's last w tokens, for ``outlier_window_share``
        (``needle.dense_prefill`` returns them)."""
        from .._checks import check_tensor

        if self._dense is not None:
            raise ValueError("keys_values: this cache already holds a prompt")
        if len(keys_values) != self.engine.num_layers:
            raise ValueError(f"keys_values: expected {self.engine.num_layers} layers, got {len(keys_values)}")
        k0 = check_tensor("keys_values[0][0]", keys_values[0][0], ndim=4, floating=True)
        B, H, T, D = k0.shape
        if (H, D) != (self.engine.kv_heads, self.engine.head_dim):
            raise ValueError(f"keys_values: expected {self.engine.kv_heads} heads of {self.engine.head_dim}, "
                             f"got shape {tuple(k0.shape)}")
        if lengths is None:
            lengths = torch.full((B,), T, device=k0.device)
        if window_queries is not None and len(window_queries) != len(keys_values):
            raise ValueError(f"window_queries: expected one tensor per layer ({len(keys_values)}), "
                             f"got {len(window_queries)}")
        if self._decide(T):
            for i, (k, v) in enumerate(keys_values):
                self._dense_append(i, k, v)
            return
        for i, (k, v) in enumerate(keys_values):
            wq = None if window_queries is None else self._check_window(window_queries[i], B)
            self.engine.prefill(i, k, v, lengths, window_q=wq)

    def _check_window(self, q: torch.Tensor, batch: int) -> torch.Tensor:
        from .._checks import check_tensor

        check_tensor("window_queries", q, ndim=4, floating=True)
        Hq = q.shape[1]
        if q.shape[0] != batch or q.shape[3] != self.engine.head_dim or Hq % self.engine.kv_heads:
            raise ValueError(f"window_queries: expected ({batch}, a multiple of {self.engine.kv_heads} heads, w, "
                             f"{self.engine.head_dim}), got shape {tuple(q.shape)}")
        return q

    def _window_rows(self, q: torch.Tensor, order: Optional[torch.Tensor], lengths: torch.Tensor):
        """The observation window of a prefill's queries (B, Hq, T, D): each sequence's last w real rows (its
        tokens left-aligned by ``order`` (B, T), or in place when None), or None when the config takes none."""
        if self.config.outlier_window_share <= 0:
            return None
        B, Hq, T, D = q.shape
        w = min(self.config.observation_window, T)
        rows = (lengths[:, None] - w + torch.arange(w, device=q.device)).clamp_min(0)  # (B, w) left-aligned
        if order is not None:
            rows = order.gather(1, rows)
        return q.gather(2, rows[:, None, :, None].expand(B, Hq, w, D))

    def fork(self, model, config: ShadowKVConfig) -> "ShadowKVCache":
        """A new cache over this cache's compressed prompt with another ``sparse_budget`` / ``max_generated``
        (the compression, which does not depend on them, is done once: a sweep over budgets shares it). Only
        before this cache decodes; the compression settings (``COMPRESSION_FIELDS``) must match. The prompt
        state is shared read-only: each cache decodes on its own (the reference path appends into new tensors,
        the kernel path into its own buffers)."""
        import dataclasses

        if not isinstance(config, ShadowKVConfig):
            raise TypeError(f"config: expected a ShadowKVConfig, got {type(config).__name__}")
        if self._dense is not False:
            raise ValueError("fork: this cache holds no compressed prompt (none yet, or a dense one)")
        if any(self.engine.generated(i) for i in range(self.engine.num_layers)):
            raise ValueError("fork: this cache has already decoded; fork it before its first decode step")
        diff = [f"{f} ({getattr(self.config, f)!r} vs {getattr(config, f)!r})" for f in self.COMPRESSION_FIELDS
                if getattr(config, f) != getattr(self.config, f)]
        if diff:
            raise ValueError(f"config: a fork shares the compressed prompt, so these must match: {', '.join(diff)}")
        new = type(self)(model, config, impl=self.engine.impl)
        new._dense, new._prompt_width = False, self._prompt_width
        new.engine.states = [dataclasses.replace(st) for st in self.engine.states]
        new.engine.cos, new.engine.sin = self.engine.cos, self.engine.sin
        return new

    def _decide(self, prompt_len: int) -> bool:
        if self._dense is None:
            self._dense = prompt_len < self.config.min_prompt_len
            self._prompt_width = prompt_len
        return self._dense

    def _dense_append(self, layer: int, k, v):
        if self._dense_k[layer] is not None:
            k = torch.cat((self._dense_k[layer], k), 2)
            v = torch.cat((self._dense_v[layer], v), 2)
        self._dense_k[layer], self._dense_v[layer] = k, v
        return k, v

    # -- transformers
    def _rope_table_fn(self, model):
        rotary = find_rotary(model)

        def table(n: int, device: torch.device):
            x = torch.zeros(1, dtype=torch.float32, device=device)
            cos, sin = rotary(x, torch.arange(n, device=device)[None])
            return cos[0], sin[0]

        return table

    def _setup_model(self, model) -> None:
        register_attention()
        # A model whose attention function already hands marked calls to shadowkv_attention (thrifty.optimize's
        # dispatcher, which also runs quantized attention) keeps it: switching would drop that attention.
        previous = model.config._attn_implementation
        self._modules = {}
        for m in model.modules():
            if hasattr(m, "layer_idx") and hasattr(m, "o_proj"):
                self._modules[m.layer_idx] = m
                if previous != ATTN_NAME:  # the calls ShadowKV does not take keep running it
                    m.__dict__[PREVIOUS_ATTR] = previous
        if not getattr(model, ROUTES_SHADOWKV_ATTR, False):
            model.set_attn_implementation(ATTN_NAME)

    def _update_hf(self, layer: "ShadowKVLayer", k, v):
        idx = layer.layer_idx
        if self._dense_k[idx] is not None or self._decide(k.shape[2]):
            return self._dense_append(idx, k, v)
        self._modules[idx].__dict__[PENDING_ATTR] = self
        return k, v

    def _compress_hf(self, layer: int, k, v, mask, position_ids, query=None) -> None:
        B, _, T, _ = k.shape
        valid = valid_keys(mask, B, T, k.device)
        lengths = valid.sum(-1)
        # left-align every sequence (padding may sit on either side); stable sort keeps token order
        order = torch.sort((~valid).to(torch.int8), dim=-1, stable=True).indices
        if position_ids is not None:
            pos = position_ids.expand(B, -1).gather(1, order)
            want = torch.arange(T, device=k.device)[None].expand(B, -1)
            bad = (pos != want) & (want < lengths[:, None])
            if bool(bad.any()):
                raise ValueError("position_ids: ShadowKV expects the tokens of each prompt at positions 0..n-1")
        idx = order[:, None, :, None].expand_as(k)
        window = None if query is None else self._window_rows(query, order, lengths)
        self.engine.prefill(layer, k.gather(2, idx), v.gather(2, idx), lengths, window_q=window)


class ThriftyModelShadowKVCache(ShadowKVCache):
    """The same cache through thrifty's reference model seam ``update(layer, k_pre_rope, v, positions, rope)``
    (pre-RoPE keys: no un-rotation needed). Equal-length prompts (the reference model has no padding)."""

    def _rope_table_fn(self, model):
        rope = model.model.rotary

        def table(n: int, device: torch.device):
            return rope.cos_sin(torch.arange(n, device=device))

        return table

    def _setup_model(self, model) -> None:
        self._dispatch = []
        for layer in model.model.layers:
            attn = layer.self_attn
            if not isinstance(attn.attention, _ThriftyDispatch):
                attn.attention = _ThriftyDispatch(attn.attention)
            self._dispatch.append(attn.attention)

    def update(self, layer_idx, k, v, positions, rope):  # the reference model's seam, not transformers'
        k_post = rope(k, positions)
        if self._dense_k[layer_idx] is not None or self._decide(k.shape[2]):
            return self._dense_append(layer_idx, k_post, v)
        if not self.engine.compressed(layer_idx):
            lengths = torch.full((k.shape[0],), k.shape[2], device=k.device)
            if self.config.outlier_window_share > 0:  # the queries come with the attention call: compress there
                self._dispatch[layer_idx].pending = (self, layer_idx, (k_post, v, lengths, k))
            else:
                self.engine.prefill(layer_idx, k_post, v, lengths, k_pre=k)
            return k_post, v
        self._dispatch[layer_idx].pending = (self, layer_idx, None)
        return k_post, v

    def __len__(self) -> int:  # the reference model reads the cached length this way
        return self.logical_length(0)


class _ThriftyDispatch:
    """The reference model's attention seam: a decode step of a compressed ShadowKV layer when marked, else
    the attention the model had."""

    def __init__(self, inner):
        self.inner = inner
        self.pending = None

    def __call__(self, q, k, v, *, causal: bool, scale: float):
        pending, self.pending = self.pending, None
        if pending is None:
            return self.inner(q, k, v, causal=causal, scale=scale)
        cache, layer, prompt = pending
        if prompt is None:
            return cache.engine.decode(layer, q, k, v, scale)
        out = self.inner(q, k, v, causal=causal, scale=scale)  # the prefill itself runs dense
        k_post, v_prompt, lengths, k_pre = prompt
        cache.engine.prefill(layer, k_post, v_prompt, lengths, k_pre=k_pre,
                             window_q=cache._window_rows(q, None, lengths))
        return out


# ----------------------------------------------------------------------------------------------- helpers

def model_shape(model) -> tuple[int, int, int]:
    """(num_layers, kv_heads, head_dim) of a Llama-family model (transformers or thrifty's reference model)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "num_hidden_layers"):
        raise TypeError(f"model: expected a Llama-family model with a .config (transformers or "
                        f"thrifty.models.LlamaForCausalLM), got {type(model).__name__}")
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv, head_dim
