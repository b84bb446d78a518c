"""``ShadowKVEngine``: the per-layer ShadowKV state of one batch and its two operations, compress a prompt and
decode one token, through the Triton kernels (``decode.py``) or the reference (``reference.py``). Knows no model:
``cache.py`` drives it from a transformers model or from thrifty's reference model."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .._checks import check_impl
from ..triton_utils import kernels_available
from . import reference as ref
from .config import ShadowKVConfig


class ShadowKVEngine:
    """Per-layer ShadowKV state of one batch, and the two operations a model needs: compress a prompt, decode
    one token. ``impl``: ``"auto"`` (Triton kernels on CUDA where they apply, the reference elsewhere),
    ``"reference"`` or ``"triton"`` (forced: CUDA, or the CPU under ``TRITON_INTERPRET=1``); checked when set.
    ``stats`` counts which path ran."""

    def __init__(self, config: ShadowKVConfig, num_layers: int, kv_heads: int, head_dim: int,
                 cos_sin: Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]], *, impl: str = "auto"):
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
        self.impl = impl
        self.stats = {"reference_steps": 0, "kernel_steps": 0}

    def compressed(self, layer: int) -> bool:
        return self.states[layer] is not None

    def generated(self, layer: int) -> int:
        return self.n_generated[layer]

    def prefill(self, layer: int, k_post: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                k_pre: Optional[torch.Tensor] = None, window_q: Optional[torch.Tensor] = None) -> None:
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
                                                 host_device=host, k_pre=k_pre, window_q=window_q)

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

    @property
    def impl(self) -> str:
        return self._impl

    @impl.setter
    def impl(self, value: str) -> None:
        self._impl = check_impl(value)

    def _use_kernels(self, device: torch.device) -> bool:
        if self.impl == "reference":
            return False
        why = self.kernels_support()
        if self.impl == "triton":
            if why:
                raise ValueError(f"impl: 'triton' cannot run this cache: {why}")
            if not kernels_available(device):
                raise ValueError(f"impl: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU), got {device}")
            return True
        return device.type == "cuda" and why is None  # unsupported shapes run the (exact, slower) reference

    def host_bytes_per_sequence(self) -> int:
        return sum(st.values.bytes_per_sequence() for st in self.states if st is not None)
