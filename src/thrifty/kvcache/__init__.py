"""ShadowKV (arXiv 2410.21465): long-context decoding with low-rank pre-RoPE keys on the device, values in host
memory, and a per-step selection of the chunks that matter.

``ShadowKVCache(model, ShadowKVConfig(...))`` is the one call: a transformers Llama-family model then decodes
with ``model.generate(input_ids, past_key_values=cache)``; thrifty's reference model uses the same cache through
its pre-RoPE seam. ``reference`` holds the algorithm in plain PyTorch (the spec of the kernels).

Modules: ``cache`` (the cache object, both model kinds), ``engine`` (per-layer state: compress, decode),
``hf`` (the transformers attention function and cache layer), ``config``, ``reference``, ``decode`` (the
kernel path: selection and fill kernels here, the attention over the buffer is the KV family's decode kernel,
``thrifty.kv``) and the ``*_kernel`` Triton modules, ``host`` (pinned host memory), ``needle`` (the retrieval
benchmark).
"""

from .cache import ShadowKVCache
from .config import ShadowKVConfig
from .engine import ShadowKVEngine
from .hf import ATTN_NAME, register_attention, shadowkv_attention

__all__ = ["ShadowKVCache", "ShadowKVConfig", "ShadowKVEngine", "ATTN_NAME", "register_attention",
           "shadowkv_attention"]
