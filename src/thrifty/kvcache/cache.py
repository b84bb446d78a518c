"""``ShadowKVCache(model, config)``: one object that plugs ShadowKV into a transformers Llama-family model
(``model.generate(ids, past_key_values=cache)``) or into thrifty's reference model (its pre-RoPE cache seam).

Why an attention function as well as a cache: the decode step needs the query to select chunks, and a cache's
``update`` never sees it. So the cache marks the attention module of the layer it just updated, and the
attention function registered under :data:`ATTN_NAME` (transformers ``AttentionInterface``, with SDPA's mask
builder under the same name in ``AttentionMaskInterface``) finds the mark and hands the query to the cache.
Calls without a mark (another cache, no cache, a dense ShadowKV cache) run the attention the model had before the
switch when it takes SDPA's masks (quantized attention, say), else plain SDPA, so the switch is safe to leave on a
model. The mark lives on the model's own modules: nothing process-wide but the name.

transformers gives caches post-RoPE keys; the prefill un-rotates them with the model's own rotary embedding
(exact up to rounding, RoPE being a rotation) before the SVD.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .config import ShadowKVConfig
from . import reference as ref

ATTN_NAME = "thrifty_shadowkv"
_PENDING = "_thrifty_shadowkv_pending"
_PREVIOUS = "_thrifty_shadowkv_previous"  # per attention module: the implementation before the switch
# set True on a model whose attention implementation routes ShadowKV's marked calls itself (see _setup_model)
ROUTES_SHADOWKV_ATTR = "_thrifty_routes_shadowkv"
BACKENDS = ("auto", "reference", "triton")


class ShadowKVEngine:
    """Per-layer ShadowKV state of one batch, and the two operations a model needs: compress a prompt, decode
    one token. ``backend``: ``"auto"`` (Triton kernels on CUDA, the reference elsewhere), ``"reference"`` or
    ``"triton"`` (also on the CPU under ``TRITON_INTERPRET=1``). ``stats`` counts which path ran."""

    def __init__(self, config: ShadowKVConfig, num_layers: int, kv_heads: int, head_dim: int,
                 cos_sin: Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]):
        if not isinstance(config, ShadowKVConfig):
            raise TypeError(f"config: expected a ShadowKVConfig, got {type(config).__name__}")
        config.check_model(kv_heads, head_dim)
        self.config = config
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self._cos_sin_fn = cos_sin
        self.states: list[Optional[ref.LayerState]] = [None] * num_layers
        self.fast: list = [None] * num_layers  # kernel-path buffers per layer (see decode.py)
        self.scratch: dict = {}  # kernel-path per-step scratch, shared by the layers (decode.Scratch)
        self.select_tuning = None  # kernel-path block sizes (score_kernel.SelectTuning); None: the GPU's defaults
        self.n_generated = [0] * num_layers
        self.cos = self.sin = None
        self.backend = "auto"
        self.stats = {"reference_steps": 0, "kernel_steps": 0}

    def compressed(self, layer: int) -> bool:
        return self.states[layer] is not None

    def generated(self, layer: int) -> int:
        return self.n_generated[layer]

    def prefill(self, layer: int, k_post: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                k_pre: Optional[torch.Tensor] = None) -> None:
        B, T = k_post.shape[0], k_post.shape[2]
        if B == 0 or T == 0:
            raise ValueError(f"k_post: an empty prompt (shape {tuple(k_post.shape)}) has nothing to compress; "
                             "a ShadowKVCache keeps prompts shorter than min_prompt_len dense")
        rows = max(T, self.config.chunk_size)  # a prompt shorter than one chunk still has one (padding) chunk
        if self.cos is None or self.cos.shape[0] < rows or self.cos.device != k_post.device:
            self.cos, self.sin = (t.float() for t in self._cos_sin_fn(rows, k_post.device))
        host = torch.device("cpu") if k_post.device.type == "cuda" else k_post.device
        self.n_generated[layer], self.fast[layer] = 0, None
        self.states[layer] = ref.compress_prompt(k_post, v, lengths, self.cos[:T], self.sin[:T], self.config,
                                                 host_device=host, k_pre=k_pre)

    def decode(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scale: float) -> torch.Tensor:
        if q.shape[2] != 1:
            raise ValueError(f"query: a compressed ShadowKV cache decodes one token per step, got {q.shape[2]} "
                             "(chunked prefill is not supported)")
        if self.generated(layer) >= self.config.max_generated:
            raise ValueError(f"max_generated: the cache holds {self.config.max_generated} generated tokens; "
                             "build it with a larger ShadowKVConfig.max_generated")
        self.n_generated[layer] += 1
        if self._use_kernels(q.device):
            from .decode import kernel_decode_step

            self.stats["kernel_steps"] += 1
            return kernel_decode_step(self, layer, q, k_new, v_new, scale)
        self.stats["reference_steps"] += 1
        return ref.decode_step(self.states[layer], q, k_new, v_new, self.config, self.cos, self.sin, scale)

    def kernels_support(self) -> Optional[str]:
        """Why the Triton path cannot run this cache (None when it can)."""
        d = self.head_dim
        if d < 32 or d & (d - 1):
            return f"head_dim: the Triton path needs a power of two >= 32, got {d}"
        if self.config.selector != "shadowkv":
            return "selector: the Triton path implements ShadowKV's landmarks, not the Quest baseline"
        return None

    def _use_kernels(self, device: torch.device) -> bool:
        from .._checks import check_choice

        check_choice("backend", self.backend, BACKENDS)
        if self.backend == "reference":
            return False
        why = self.kernels_support()
        if self.backend == "triton":
            if why:
                raise ValueError(why)
            return True
        return device.type == "cuda" and why is None  # unsupported shapes run the (exact, slower) reference

    def host_bytes_per_sequence(self) -> int:
        return sum(st.values.bytes_per_sequence() for st in self.states if st is not None)


# ----------------------------------------------------------------------------------------------- transformers

def shadowkv_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                       scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    """transformers attention signature. With a ShadowKV mark on ``module``: the cache's prefill or sparse decode;
    otherwise transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cache = module.__dict__.pop(_PENDING, None)
    if cache is None:
        attention = _previous_attention(module) or sdpa_attention_forward
        return attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = module.layer_idx
    if cache.engine.compressed(layer):
        out = cache.engine.decode(layer, query, key, value, scale)
        return out.transpose(1, 2).contiguous(), None
    out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 is_causal=is_causal, **kwargs)
    cache._compress_hf(layer, key, value, attention_mask, kwargs.get("position_ids"))
    return out


def _previous_attention(module):
    """The attention function the model ran before a ShadowKVCache switched it (e.g. quantized attention), for
    the calls ShadowKV does not take; None when it was SDPA or eager, or when it needs a mask of another shape
    than SDPA's (the mask builder registered for ShadowKV), e.g. flash attention: those calls run SDPA."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = module.__dict__.get(_PREVIOUS)
    if name in (None, "sdpa", ATTN_NAME) or name not in ALL_ATTENTION_FUNCTIONS:
        return None
    if ALL_MASK_ATTENTION_FUNCTIONS.get(name) is not sdpa_mask:
        return None
    return ALL_ATTENTION_FUNCTIONS[name]


def register_attention() -> None:
    """Registers :data:`ATTN_NAME` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, shadowkv_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def _cache_base():
    try:
        from transformers.cache_utils import Cache
        return Cache
    except ImportError:  # pragma: no cover - transformers is a dependency; keep the reference model usable
        return object


def _layer_base():
    try:
        from transformers.cache_utils import CacheLayerMixin
        return CacheLayerMixin
    except ImportError:  # pragma: no cover
        return object


class ShadowKVLayer(_layer_base()):
    """One layer's view for transformers' ``Cache`` machinery; the work is done by the owning cache."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: "ShadowKVCache", layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner._update_hf(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.logical_length(self.layer_idx)

    def get_max_length(self) -> int:
        return -1


def _is_thrifty_model(model) -> bool:
    from ..models.llama import LlamaForCausalLM

    return isinstance(model, LlamaForCausalLM)


class ShadowKVCache(_cache_base()):
    """A ShadowKV KV cache for one ``generate`` call (one batch).

    ``cache = ShadowKVCache(model, ShadowKVConfig(...))`` then ``model.generate(input_ids, past_key_values=cache,
    attention_mask=...)`` on a transformers Llama-family model (left padding for prompts of different lengths),
    or ``thrifty.models.generate(model, ids, n, cache_factory=lambda: ShadowKVCache(model, cfg))`` on the
    reference model. A prompt shorter than ``config.min_prompt_len`` stays dense (a plain KV cache).

    ``cache.engine`` holds the per-layer state (``engine.backend`` picks kernels or the reference;
    ``engine.stats`` says which ran); :meth:`host_bytes_per_sequence` reports the pinned value bytes.

    NaN: a NaN in a query head, a prompt value or a generated key/value gives NaN in exactly the output rows that
    attend it; a NaN/inf prompt key is refused at compression (ValueError naming ``keys``), since the low-rank
    SVD mixes every token and head of a sequence.
    """

    def __new__(cls, model=None, config: Optional[ShadowKVConfig] = None):
        if cls is ShadowKVCache and model is not None and _is_thrifty_model(model):
            cls = ThriftyModelShadowKVCache
        return super().__new__(cls)

    def __init__(self, model, config: Optional[ShadowKVConfig] = None):
        config = ShadowKVConfig() if config is None else config
        num_layers, kv_heads, head_dim = _model_shape(model)
        self.engine = ShadowKVEngine(config, num_layers, kv_heads, head_dim, self._rope_table_fn(model))
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

    def load_prompt(self, keys_values, lengths: Optional[torch.Tensor] = None) -> None:
        """Fills the cache from a prompt already run densely: per layer the post-RoPE keys and values
        (B, H, T, D), token t of sequence b at index t (what a transformers ``DynamicCache`` holds), ``lengths``
        (B,) when prompts differ. Lets several configurations share one prefill."""
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
        if self._decide(T):
            for i, (k, v) in enumerate(keys_values):
                self._dense_append(i, k, v)
            return
        for i, (k, v) in enumerate(keys_values):
            self.engine.prefill(i, k, v, lengths)

    def fork(self, model, config: ShadowKVConfig) -> "ShadowKVCache":
        """A new cache over this cache's compressed prompt with another ``sparse_budget`` / ``max_generated``
        (the compression, which does not depend on them, is done once: a sweep over budgets shares it). Only
        before this cache decodes; the compression settings (rank, chunk_size, outlier_chunks, local_chunks,
        host_values, selector) must match. The prompt state is shared read-only: each cache decodes on its own
        (the reference path appends into new tensors, the kernel path into its own buffers)."""
        import dataclasses

        if not isinstance(config, ShadowKVConfig):
            raise TypeError(f"config: expected a ShadowKVConfig, got {type(config).__name__}")
        if self._dense is not False:
            raise ValueError("fork: this cache holds no compressed prompt (none yet, or a dense one)")
        if any(self.engine.generated(i) for i in range(self.engine.num_layers)):
            raise ValueError("fork: this cache has already decoded; fork it before its first decode step")
        shared = ("rank", "chunk_size", "outlier_chunks", "local_chunks", "host_values", "selector")
        diff = [f"{f} ({getattr(self.config, f)!r} vs {getattr(config, f)!r})" for f in shared
                if getattr(config, f) != getattr(self.config, f)]
        if diff:
            raise ValueError(f"config: a fork shares the compressed prompt, so these must match: {', '.join(diff)}")
        new = type(self)(model, config)
        new._dense, new._prompt_width = False, self._prompt_width
        new.engine.states = [dataclasses.replace(st) for st in self.engine.states]
        new.engine.cos, new.engine.sin, new.engine.backend = self.engine.cos, self.engine.sin, self.engine.backend
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
        rotary = _find_rotary(model)

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
                    m.__dict__[_PREVIOUS] = previous
        if not getattr(model, ROUTES_SHADOWKV_ATTR, False):
            model.set_attn_implementation(ATTN_NAME)

    def _update_hf(self, layer: "ShadowKVLayer", k, v):
        idx = layer.layer_idx
        if self._dense_k[idx] is not None or self._decide(k.shape[2]):
            return self._dense_append(idx, k, v)
        self._modules[idx].__dict__[_PENDING] = self
        return k, v

    def _compress_hf(self, layer: int, k, v, mask, position_ids) -> None:
        B, _, T, _ = k.shape
        valid = _valid_keys(mask, B, T, k.device)
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
        self.engine.prefill(layer, k.gather(2, idx), v.gather(2, idx), lengths)


class ThriftyModelShadowKVCache(ShadowKVCache):
    """The same cache through thrifty's reference model seam ``update(layer, k_pre_rope, v, positions, rope)``
    (pre-RoPE keys: no un-rotation needed). Equal-length prompts (the reference model has no padding)."""

    def _rope_table_fn(self, model):
        rope = model.model.rotary

        def table(n: int, device: torch.device):
            return rope._cos_sin(torch.arange(n, device=device))

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
            self.engine.prefill(layer_idx, k_post, v, lengths, k_pre=k)
            return k_post, v
        self._dispatch[layer_idx].pending = (self, layer_idx)
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
        cache, layer = pending
        return cache.engine.decode(layer, q, k, v, scale)


# ----------------------------------------------------------------------------------------------- helpers

def _model_shape(model) -> tuple[int, int, int]:
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


def _find_rotary(model):
    for name, m in model.named_modules():
        if name.endswith("rotary_emb"):
            return m
    raise ValueError("model: no rotary embedding module (…rotary_emb) found; ShadowKV needs RoPE to un-rotate keys")


def _valid_keys(mask, B: int, T: int, device) -> torch.Tensor:
    """(B, T) bool: which prompt keys are real. The mask is SDPA's (B, 1, Q, T) (True = attend; its last query
    row sees every real key) or None (no padding)."""
    if mask is None:
        return torch.ones(B, T, dtype=torch.bool, device=device)
    last = mask[:, 0, -1, -T:]
    return last if last.dtype == torch.bool else last == 0
