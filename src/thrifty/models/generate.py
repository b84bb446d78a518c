"""Greedy / sampled generation with the reference model's KV-cache seam."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .._checks import check_positive_int, check_range, check_tensor
from .llama import KVCache, LlamaForCausalLM

CACHE_FACTORY_ATTR = "thrifty_cache_factory"  # on a model: the cache generate builds when given none


@torch.no_grad()
def generate(model: LlamaForCausalLM, input_ids: torch.Tensor, max_new_tokens: int, *,
             temperature: float = 0.0, eos_token_id: Optional[int] = None,
             cache_factory: Optional[Callable[[], object]] = None, generator: Optional[torch.Generator] = None):
    """Prefills ``input_ids`` (B, T) once, then decodes one token at a time through the cache.
    ``cache_factory``: default the model's ``thrifty_cache_factory`` (set by ``thrifty.optimize`` with a
    ``kv_cache``), else a plain :class:`KVCache`. ``temperature=0`` is greedy. Returns (B, T + new) token ids; stops early when every row hit ``eos_token_id``."""
    check_tensor("input_ids", input_ids, ndim=2, integer=True)
    check_positive_int("max_new_tokens", max_new_tokens)
    check_range("temperature", temperature, 0.0, 100.0)
    if eos_token_id is not None:
        check_positive_int("eos_token_id", eos_token_id, allow_zero=True)
    if cache_factory is None:
        cache_factory = model.__dict__.get(CACHE_FACTORY_ATTR, KVCache)
    cache = cache_factory()
    logits = model(input_ids, cache=cache, logits_to_keep=1)
    out = [input_ids]
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        last = logits[:, -1].float()
        if temperature == 0:
            nxt = last.argmax(-1, keepdim=True)
        else:
            probs = torch.softmax(last / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
        out.append(nxt)
        if eos_token_id is not None:
            done |= nxt.squeeze(1) == eos_token_id
            if bool(done.all()):
                break
        logits = model(nxt, cache=cache)
    return torch.cat(out, dim=1)
