"""A readable Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU, tied or untied embeddings).

Parameter names follow HF transformers' ``LlamaForCausalLM`` so a HF safetensors checkpoint loads as is.
Five seams are explicit, so the techniques of thrifty slot in without copying the model:

* ``attention``: ``fn(q, k, v, *, causal, scale) -> out`` on (B, H, T, Dh) queries and (B, Hkv, S, Dh) keys and
  values (grouped-query: H is a multiple of Hkv). Default :func:`sdpa_attention`.
* ``linear``: ``factory(in_features, out_features, *, name) -> nn.Module`` builds every projection inside the
  blocks (q/k/v/o, gate/up/down). Default :func:`default_linear` (``nn.Linear`` without bias).
* ``activation``: ``fn(gate) -> tensor``, the GLU gate activation of every MLP (``mlp.act_fn``, HF's name).
  Default ``F.silu`` (SwiGLU); BitNet uses ReLU².
* ``loss``: ``fn(hidden (B, T, D), classifier_weight (V, D), labels (B, T)) -> scalar`` with labels already
  aligned to the hidden positions and ``-100`` ignored; a fused linear cross-entropy never needs the logits.
  Default :func:`logits_cross_entropy`.
* KV cache: ``forward(..., cache=...)`` takes any object with ``update(layer_idx, k, v, positions, rope)``
  receiving **pre-RoPE** keys (so a cache may store them low-rank, as ShadowKV does) and returning the
  post-RoPE keys and the values of every cached position. Default :class:`KVCache`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import check_bool, check_positive_int, check_range, check_tensor, check_token_ids
from ..layers import KEY_MASK_ATTR, RMSNorm, fused_inference  # noqa: F401 (RMSNorm importable from here too)


@dataclass
class LlamaConfig:
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: Optional[int] = None
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            check_positive_int(name, getattr(self, name))
        check_bool("tie_word_embeddings", self.tie_word_embeddings)
        check_range("rope_theta", self.rope_theta, 0.0, float("inf"), lo_open=True)
        check_range("rms_norm_eps", self.rms_norm_eps, 0.0, 1.0, lo_open=True)
        if self.head_dim is not None:
            check_positive_int("head_dim", self.head_dim)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size: expected a multiple of num_attention_heads ({self.num_attention_heads}) "
                    f"when head_dim is not given, got {self.hidden_size}")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim % 2:
            raise ValueError(f"head_dim: expected an even number (RoPE rotates pairs), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads: expected a divisor of num_attention_heads ({self.num_attention_heads}), "
                f"got {self.num_key_value_heads}")

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        """From a HF ``config.json`` dict (transformers 4.x ``rope_theta`` or 5.x ``rope_parameters``)."""
        rope = hf.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
            raise ValueError(f"config: only default RoPE is supported, got {rope or hf.get('rope_scaling')}")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError("config: attention_bias/mlp_bias are not supported by the reference model")
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in hf.items() if k in names}
        kwargs["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        return cls(**kwargs)

    def to_hf(self) -> dict:
        d = asdict(self)
        d.pop("rope_theta")
        d.update(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                 attention_bias=False, mlp_bias=False)
        return d

    def num_parameters(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = d * self.head_dim * (self.num_attention_heads * 2 + self.num_key_value_heads * 2)
        block = attn + 3 * d * f + 2 * d
        return self.num_hidden_layers * block + v * d * (1 if self.tie_word_embeddings else 2) + d


# ----------------------------------------------------------------------------------------------- default seams

def sdpa_attention(q, k, v, *, causal: bool, scale: float):
    """torch SDPA with grouped-query heads; ``causal`` with fewer queries than keys means the queries are last.
    Keys from a static cache in graph mode carry a mask of the slots written (``layers.KEY_MASK_ATTR``); on CUDA
    at inference that one query row goes to ``thrifty.kv``'s split-K decode kernel over the masked buffer
    (:func:`_masked_decode_fits`)."""
    key_mask = getattr(k, KEY_MASK_ATTR, None)
    if key_mask is not None and _masked_decode_fits(q, k, v, key_mask):
        from ..kv.decode_kernel import masked_decode_attention

        valid = key_mask.reshape(1, 1, -1).expand(k.shape[0], k.shape[1], -1)
        return masked_decode_attention(q, k, v, valid, scale)
    if q.shape[1] != k.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    if key_mask is not None:  # one query row over a static buffer: the mask alone says which keys exist
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=scale)
    tq, tk = q.shape[2], k.shape[2]
    if causal and tq > 1 and tq != tk:
        # queries sit at the end of the key sequence (chunked prefill with a cache): explicit bottom-right mask
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal and tq > 1, scale=scale)


sdpa_attention.reads_key_mask = True


def _masked_decode_fits(q, k, v, key_mask) -> bool:
    """A graph-mode decode step the split-K kernel takes: one query row, CUDA without autograd, 16-bit or fp32 of
    one dtype, head_dim 64 or 128, contiguous buffer rows, one mask for the batch. Why not SDPA there: with a
    boolean mask it runs ~4 launches per layer (the mask converted and expanded, then the attention: ~10 µs at a
    few hundred slots, bitnet NOTES "Decode: the masked attention"); the kernel takes the mask as it is, 2
    launches."""
    return (q.shape[2] == 1 and fused_inference(q) and q.dtype == k.dtype == v.dtype
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and q.shape[-1] in (64, 128)
            and k.shape[-1] == q.shape[-1] and q.shape[1] % k.shape[1] == 0 and k.stride(-1) == 1
            and v.stride() == k.stride() and key_mask.dtype == torch.bool and key_mask.numel() == k.shape[2])


def default_linear(in_features: int, out_features: int, *, name: str) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=False)


def logits_cross_entropy(hidden, weight, labels):
    """The plain loss: materialize the logits, fp32 cross-entropy, mean over non-ignored tokens."""
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100)


def _capturing() -> bool:
    """True while a CUDA graph is being captured (thrifty.train's ``cuda_graph`` step): a host sync such as
    ``int(tensor)`` is illegal then, so the checks that read tensor values are skipped and the caller checks the
    values on the host (the Trainer checks each batch's ids before copying it into the graph's input buffer)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _version(t: torch.Tensor):
    """The tensor's in-place modification counter (None for inference-mode tensors, which keep none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _is_dtensor(x) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(x, DTensor)


# ----------------------------------------------------------------------------------------------- building blocks

class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE in the rotate-half layout HF uses; cos/sin come from a table built once per
    device and grown on demand, so the 30 layers of a forward share one gather instead of 30 trig evaluations."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self._table: Optional[tuple] = None
        # (positions, its version, capturing?, cos, sin): every layer of one forward reuses it. The version and
        # the capture flag matter when one positions tensor serves several forwards (a CUDA-graph decode step
        # advances its positions in place): a stale entry, or one computed outside the graph being recorded,
        # would freeze the rotation at the first position.
        self._last: Optional[tuple] = None

    def cos_sin(self, positions):
        """fp32 (cos, sin) at integer ``positions`` (T,) or (B, T): (T, Dh) or (B, T, Dh), what ``forward`` rotates
        by (the fused kernels of a cache that rotates keys itself read them too)."""
        key = (positions, _version(positions), _capturing())
        if self._last is not None and self._last[0] is positions and self._last[1:3] == key[1:]:
            return self._last[3], self._last[4]
        if key[2]:
            self._last = (*key, *self._direct_cos_sin(positions))
            return self._last[3], self._last[4]
        length = int(positions.max()) + 1 if positions.numel() else 1
        table = self._table
        if table is None or table[0].shape[0] < length or table[0].device != positions.device:
            size = max(length, 2 * table[0].shape[0] if table is not None else 4096)
            freqs = torch.arange(size, device=positions.device, dtype=torch.float32)[:, None] * \
                self.inv_freq.to(positions.device)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._table = table = (emb.cos(), emb.sin())
        self._last = (*key, table[0][positions], table[1][positions])
        return self._last[3], self._last[4]

    def _direct_cos_sin(self, positions):
        """cos/sin computed at ``positions`` instead of gathered from the table: the table's length needs the
        largest position on the host (a sync, illegal in a CUDA graph capture), and a graph must not read a table a
        later call may regrow and free. The same fp32 products and trig as the table rows, so the same values."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, x, positions):
        """Rotates x: (B, H, T, Dh) at integer positions (T,) or (B, T)."""
        cos, sin = self.cos_sin(positions)
        if fused_inference(x):
            from ..fused_layers import rope  # inference on the GPU: one launch instead of ~8 (no autograd)

            return rope(x, cos, sin)
        if cos.ndim == 3:  # (B, T, Dh): broadcast over heads
            cos, sin = cos[:, None], sin[:, None]
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int, linear: Callable, attention: Callable):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = linear(d, self.n_heads * hd, name=f"layers.{layer_idx}.self_attn.q_proj")
        self.k_proj = linear(d, self.n_kv * hd, name=f"layers.{layer_idx}.self_attn.k_proj")
        self.v_proj = linear(d, self.n_kv * hd, name=f"layers.{layer_idx}.self_attn.v_proj")
        self.o_proj = linear(self.n_heads * hd, d, name=f"layers.{layer_idx}.self_attn.o_proj")
        self.attention = attention

    def forward(self, x, positions, rope: RotaryEmbedding, cache=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        update_with_query = getattr(cache, "update_with_query", None)
        if update_with_query is not None:  # a cache that rotates the query with its keys (one launch for both)
            q, k, v = update_with_query(self.layer_idx, q, k, v, positions, rope)
        else:
            q = rope(q, positions)
            if cache is None:
                k = rope(k, positions)
            else:  # the cache gets pre-RoPE keys and decides how to store them
                k, v = cache.update(self.layer_idx, k, v, positions, rope)
        out = self.attention(q, k, v, causal=True, scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int, linear: Callable, activation: Callable = F.silu):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.act_fn = activation  # the GLU's gate activation (HF's name): SiLU for SwiGLU, ReLU² for BitNet
        self.gate_proj = linear(d, f, name=f"layers.{layer_idx}.mlp.gate_proj")
        self.up_proj = linear(d, f, name=f"layers.{layer_idx}.mlp.up_proj")
        self.down_proj = linear(f, d, name=f"layers.{layer_idx}.mlp.down_proj")

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        kind = glu_kind(self.act_fn)
        if kind is not None:
            # a down projection that quantizes its input (packed BitNet) may make its codes in the GLU's launch
            take = getattr(self.down_proj, "glu_input", None)
            h = take(gate, up, kind) if take is not None else None
            if h is not None:
                return self.down_proj(h)
            if fused_inference(gate):
                from ..fused_layers import glu  # inference on the GPU: activation and product in one launch

                return self.down_proj(glu(gate, up, kind))
        return self.down_proj(self.act_fn(gate) * up)


def glu_kind(activation) -> Optional[str]:
    """The fused GLU kernel's name for an activation seam: "silu" for F.silu, a function's ``glu_kind`` attribute
    (BitNet's ReLU² says "relu2"), else None (the seam runs as written)."""
    if activation is F.silu:
        return "silu"
    return getattr(activation, "glu_kind", None)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int, linear: Callable, attention: Callable,
                 activation: Callable = F.silu):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, linear, attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, layer_idx, linear, activation)

    def forward(self, x, positions, rope, cache=None, *, pending=None, defer: bool = False):
        """The block's output ``x + mlp(...)``. ``pending``: an update still to be added to ``x`` (the previous
        block's MLP output), added in this block's first norm's launch; ``defer``: return ``(x, mlp output)``
        instead of their sum, for the next block (or the final norm) to add. ``LlamaModel`` defers on the GPU at
        inference, where the adds fuse into the norms: one launch fewer per block."""
        x, h = _add_and_norm(self.input_layernorm, x, pending)
        attn = self.self_attn(h, positions, rope, cache)
        x, h = _add_and_norm(self.post_attention_layernorm, x, attn)
        out = self.mlp(h)
        return (x, out) if defer else x + out


def _add_and_norm(norm, x, residual):
    """(x + residual, norm(x + residual)); the add fused into the norm's launch where it can be; no add when
    ``residual`` is None."""
    if residual is None:
        return x, norm(x)
    if isinstance(norm, RMSNorm):
        return norm.add_and_norm(x, residual)
    x = x + residual  # a norm swapped in by the user
    return x, norm(x)


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, linear: Callable, attention: Callable, activation: Callable = F.silu):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, linear, attention, activation)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(self, input_ids, positions, cache=None):
        x = self.embed_tokens(input_ids)
        defer = fused_inference(x)  # each block's last add goes into the next norm's launch (fused_layers)
        pending = None
        for layer in self.layers:
            if defer:
                x, pending = layer(x, positions, self.rotary, cache, pending=pending, defer=True)
            else:
                x = layer(x, positions, self.rotary, cache)
        return _add_and_norm(self.norm, x, pending)[1]


class KVCache:
    """Default cache: post-RoPE keys and values concatenated per layer (grows with each call)."""

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, layer_idx, k, v, positions, rope):
        k = rope(k, positions)
        if layer_idx in self.keys and self.keys[layer_idx].shape[0] != k.shape[0]:
            raise ValueError(f"input_ids: batch {k.shape[0]} does not match the cache's batch "
                             f"{self.keys[layer_idx].shape[0]}; use a new cache for a new batch")
        if layer_idx in self.keys:
            k = torch.cat((self.keys[layer_idx], k), dim=2)
            v = torch.cat((self.values[layer_idx], v), dim=2)
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v

    def __len__(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0


# ----------------------------------------------------------------------------------------------- the LM
def _check_positions(positions, B: int, T: int) -> None:
    check_tensor("positions", positions, ndim=(1, 2), integer=True)
    if positions.shape[-1] != T or (positions.ndim == 2 and positions.shape[0] != B):
        raise ValueError(f"positions: expected shape ({T},) or ({B}, {T}) like input_ids, got {tuple(positions.shape)}")
    if not _capturing() and int(positions.min()) < 0:  # a negative index would wrap around the RoPE table
        raise ValueError(f"positions: expected positions >= 0, got min {int(positions.min())}")



class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig, *, linear: Callable = default_linear,
                 attention: Callable = sdpa_attention, loss: Callable = logits_cross_entropy,
                 activation: Callable = F.silu):
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config: expected a LlamaConfig, got {type(config).__name__}")
        self.config = config
        self.model = LlamaModel(config, linear, attention, activation)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.loss_fn = loss

    # seams that can be swapped after construction too
    def set_attention(self, fn: Callable) -> None:
        for layer in self.model.layers:
            layer.self_attn.attention = fn

    def set_loss(self, fn: Callable) -> None:
        self.loss_fn = fn

    def init_weights(self, std: float = 0.02, seed: Optional[int] = None) -> "LlamaForCausalLM":
        """Fresh weights for pre-training: N(0, std), output projections scaled by 1/sqrt(2·layers)."""
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        out_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        for name, p in self.named_parameters():
            if p.ndim == 1:
                nn.init.ones_(p)
            else:
                s = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g, device="cpu") * s)  # CPU generator: same init on any device
        return self

    def forward(self, input_ids, labels=None, *, positions=None, cache=None, logits_to_keep: int = 0):
        """Returns the loss when ``labels`` (aligned with ``input_ids``: predict ``labels[t]`` at position t,
        -100 ignored) are given, else the logits of the last ``logits_to_keep`` positions (0 = all)."""
        check_tensor("input_ids", input_ids, ndim=2, integer=True)
        B, T = input_ids.shape
        if B == 0 or T == 0:
            raise ValueError(f"input_ids: expected at least one sequence of at least one token, got shape {(B, T)}")
        if not _capturing():  # under capture the Trainer has checked the batch on the host
            check_token_ids("input_ids", input_ids, self.config.vocab_size)
        check_positive_int("logits_to_keep", logits_to_keep, allow_zero=True)
        if positions is None:
            start = len(cache) if cache is not None else 0
            positions = torch.arange(start, start + T, device=input_ids.device)
        else:
            _check_positions(positions, B, T)
        hidden = self.model(input_ids, positions, cache)
        if labels is not None:
            check_tensor("labels", labels, ndim=2, integer=True)
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels: expected shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
            if _is_dtensor(self.lm_head.weight):  # lm_head sharded as its own FSDP2 unit (or tensor-parallel)
                from ..parallel import run_with_gathered_head
                return run_with_gathered_head(self.lm_head, self._seam_loss, hidden, labels)
            return self._seam_loss(self.lm_head, hidden, labels)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self.lm_head(hidden)

    def _seam_loss(self, head, hidden, labels):
        weight = head.weight
        device_type = hidden.device.type
        if torch.is_autocast_enabled(device_type):
            # the loss seam sees what the lm_head Linear would see under autocast, so a fused linear-CE
            # runs its matmuls in bf16 like F.linear does, not in fp32
            dtype = torch.get_autocast_dtype(device_type)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
        return self.loss_fn(hidden, weight, labels)

    # --------------------------------------------------------------------------------------- checkpoints

    @classmethod
    def from_packed(cls, path, *, device="cpu", impl: str = "auto") -> "LlamaForCausalLM":
        """Loads a packed BitNet export (``thrifty.bitnet.export`` of a reference model): the model is built from
        the file's own config and recipe, its ternary layers as :class:`thrifty.bitnet.PackedBitLinear` shells (no
        full-precision weight is ever allocated for them), then filled by ``thrifty.bitnet.load`` with every
        check first. ``impl``: the packed layers' kernels ("auto", "triton", "reference")."""
        from ..bitnet import load, mlp_activation, packed_factory, read_header

        header = read_header(path)  # a missing, unreadable or tampered file is refused here (ValueError)
        if header["model_config"] is None:
            raise ValueError(f"path: {path} was exported from a model other than thrifty's reference model (no "
                             f"model_config in its header): build that model and call thrifty.bitnet.load(path, model)")
        with torch.device(device):
            model = cls(LlamaConfig(**header["model_config"]), linear=packed_factory(header, impl=impl),
                        activation=mlp_activation(header["recipe"]))
        return load(path, model).eval()

    @classmethod
    def from_pretrained(cls, path, *, dtype: torch.dtype = torch.float32, device="cpu", **seams):
        """Loads a HF Llama-family checkpoint folder (config.json + *.safetensors).

        Every file is read and checked (parseable, no tensor twice, names and shapes matching the config,
        floating-point weights) before the model is filled; errors are ValueError naming the file."""
        from .._io import read_json, read_safetensors

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"path: expected a folder with config.json, got {path}")
        hf = read_json(path / "config.json", "model config")
        if not isinstance(hf, dict):
            raise ValueError(f"{path / 'config.json'}: corrupted model config (not a JSON object)")
        try:
            config = LlamaConfig.from_hf(hf)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path / 'config.json'}: {err}") from None
        files = sorted(f for f in path.glob("*.safetensors") if f.name != "optimizer.safetensors")  # Trainer's
        if not files:
            raise ValueError(f"path: no .safetensors files in {path}")
        state, source = {}, {}
        for f in files:
            for name, t in read_safetensors(f).items():
                if name in state:
                    raise ValueError(f"{f}: tensor {name!r} is also in {source[name]}")
                state[name], source[name] = t, f
        with torch.device(device):  # a new model: nothing the caller holds is touched before the checks pass
            model = cls(config, **seams)
            if "thrifty_bitnet" in hf:  # a BitNet checkpoint: rebuild its BitLinears (and sub-norms) first
                from ..bitnet.recipes import from_checkpoint_record

                try:
                    from_checkpoint_record(model, hf["thrifty_bitnet"])
                except (TypeError, ValueError) as err:
                    raise ValueError(f"{path / 'config.json'}: {err}") from None
        expected = dict(model.state_dict())
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
            expected.pop("lm_head.weight", None)
        missing = [n for n in expected if n not in state]
        unexpected = [n for n in state if n not in expected]
        if missing or unexpected:
            raise ValueError(f"checkpoint {path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, t in state.items():
            if t.shape != expected[name].shape or not t.is_floating_point():
                raise ValueError(f"{source[name]}: tensor {name!r} is {t.dtype} {tuple(t.shape)}, the config in "
                                 f"{path / 'config.json'} expects a float tensor of shape "
                                 f"{tuple(expected[name].shape)}")
        model.load_state_dict(state, strict=False)
        return model.to(dtype)

    def save_pretrained(self, path) -> Path:
        """Writes config.json + model.safetensors in HF layout (loadable by transformers too). A BitNet model
        (thrifty.bitnet) also records its recipe in config.json (``thrifty_bitnet``), which
        :meth:`from_pretrained` uses to rebuild the BitLinear layers."""
        from safetensors.torch import save_file

        from .._io import atomic_path, crc_metadata
        from ..bitnet.recipes import checkpoint_record

        hf = self.config.to_hf()
        bitnet = checkpoint_record(self)  # before writing anything: a model no recipe describes is refused
        if bitnet is not None:
            hf["thrifty_bitnet"] = bitnet
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        with atomic_path(path / "model.safetensors") as tmp:
            save_file(state, str(tmp), metadata={"format": "pt", **crc_metadata(state)})
        with atomic_path(path / "config.json") as tmp:
            tmp.write_text(json.dumps(hf, indent=1))
        return path
