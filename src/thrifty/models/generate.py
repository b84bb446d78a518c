"""Greedy / sampled generation with the reference model's KV-cache seam, eager or with each decode step replayed
as one CUDA graph (``cuda_graph=True``)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .._checks import check_bool, check_positive_int, check_range, check_tensor
from .llama import KVCache, LlamaForCausalLM

CACHE_FACTORY_ATTR = "thrifty_cache_factory"  # on a model: the cache generate builds when given none
EOS_CHECK_EVERY = 16  # graph decode reads "every row has ended" on the host once per this many steps


@torch.no_grad()
def generate(model: LlamaForCausalLM, input_ids: torch.Tensor, max_new_tokens: int, *,
             temperature: float = 0.0, eos_token_id: Optional[int] = None,
             cache_factory: Optional[Callable[[], object]] = None, generator: Optional[torch.Generator] = None,
             cuda_graph: bool = False):
    """Prefills ``input_ids`` (B, T) once, then decodes one token at a time through the cache.
    ``cache_factory``: default the model's ``thrifty_cache_factory`` (set by ``thrifty.optimize`` with a
    ``kv_cache``), else a plain :class:`KVCache`. ``temperature=0`` is greedy. Returns (B, T + new) token ids;
    stops early when every row hit ``eos_token_id``.

    ``cuda_graph=True`` (model and ids on one CUDA device): the decode step (every layer, the cache writes and
    the logits) is captured once as a CUDA graph over a :class:`~thrifty.kv.StaticKVCache` of T + max_new_tokens
    positions and replayed per token: no host work per token beyond the replay, the token choice and one
    "all ended?" read every ``EOS_CHECK_EVERY`` steps. The same tokens as eager decoding up to rounding (the
    attention reads a masked buffer of fixed length instead of the filled prefix). Needs attention seams that read
    a static cache's key mask (``sdpa_attention``, ``sage_seam``) and no ``cache_factory``."""
    check_tensor("input_ids", input_ids, ndim=2, integer=True)
    check_positive_int("max_new_tokens", max_new_tokens)
    check_range("temperature", temperature, 0.0, 100.0)
    check_bool("cuda_graph", cuda_graph)
    if eos_token_id is not None:
        check_positive_int("eos_token_id", eos_token_id, allow_zero=True)
    if cuda_graph:
        _check_graphable(model, input_ids, cache_factory)
        return _generate_static(model, input_ids, max_new_tokens, temperature, eos_token_id, generator, True)
    if cache_factory is None:
        cache_factory = model.__dict__.get(CACHE_FACTORY_ATTR, KVCache)
    cache = cache_factory()
    logits = model(input_ids, cache=cache, logits_to_keep=1)
    out = [input_ids]
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        nxt = _choose(logits[:, -1], temperature, generator)
        out.append(nxt)
        if eos_token_id is not None:
            done |= nxt.squeeze(1) == eos_token_id
            if bool(done.all()):
                break
        logits = model(nxt, cache=cache)
    return torch.cat(out, dim=1)


def _choose(last_logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    last = last_logits.float()
    if temperature == 0:
        return last.argmax(-1, keepdim=True)
    probs = torch.softmax(last / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


def _check_graphable(model, input_ids, cache_factory) -> None:
    if cache_factory is not None or CACHE_FACTORY_ATTR in model.__dict__:
        raise ValueError("cache_factory: cuda_graph=True decodes through its own StaticKVCache; drop the cache "
                         "factory (or the model's kv_cache option) or use cuda_graph=False")
    for layer in model.model.layers:  # before the device checks: a wrong seam is the answer on any machine
        fn = layer.self_attn.attention
        if not getattr(fn, "reads_key_mask", False):
            raise ValueError(f"cuda_graph: layer {layer.self_attn.layer_idx}'s attention "
                             f"{getattr(fn, '__name__', type(fn).__name__)} does not read a static cache's key "
                             "mask (reads_key_mask); use sdpa_attention or thrifty.attention.sage_seam")
    if not input_ids.is_cuda:
        raise ValueError(f"cuda_graph: needs the model and input_ids on a CUDA device, got {input_ids.device}")
    devices = {p.device for p in model.parameters()}
    if devices != {input_ids.device}:
        raise ValueError(f"cuda_graph: needs every parameter on {input_ids.device}, got {sorted(map(str, devices))}")


def _generate_static(model, input_ids, max_new_tokens, temperature, eos_token_id, generator, capture: bool):
    """Eager prefill into a StaticKVCache, then the decode step over fixed buffers: ``tok`` and ``pos`` are read
    by the step, ``logits`` written by it. ``capture``: record the step once as a CUDA graph and replay it (the
    CPU tests run the same step eagerly, ``capture=False``)."""
    from ..kv.static import StaticKVCache  # the KV family imports Triton: not with every `import thrifty.models`

    B, T = input_ids.shape
    cache = StaticKVCache(T + max_new_tokens)
    logits = model(input_ids, cache=cache, logits_to_keep=1)
    tok = _choose(logits[:, -1], temperature, generator)
    new = [tok]
    if max_new_tokens == 1 or _ended(new, eos_token_id):
        return torch.cat([input_ids, *new], dim=1)
    cache.graph_mode = True
    tok_buf = tok.clone()
    pos_buf = torch.full((1,), T, dtype=torch.long, device=input_ids.device)
    step = lambda: model(tok_buf, positions=pos_buf, cache=cache)  # noqa: E731
    if capture:
        out = _capture(step)
        replay = out[0].replay
        logits_buf = out[1]
    else:
        logits_buf = None
    for i in range(1, max_new_tokens):
        if capture:
            replay()
            logits = logits_buf
        else:
            logits = step()
        cache.advance(1)
        tok = _choose(logits[:, -1], temperature, generator)
        new.append(tok)
        tok_buf.copy_(tok)
        pos_buf.add_(1)
        if eos_token_id is not None and (i + 1) % EOS_CHECK_EVERY == 0 and _ended(new, eos_token_id):
            break
    return torch.cat([input_ids, *_until_all_ended(new, eos_token_id)], dim=1)


def _capture(step):
    """(graph, its logits buffer): two warm-up runs on a side stream (they write the same cache slot the first
    replay writes again, with the same token), then the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step()
    return graph, logits


def _ended(new: list, eos_token_id) -> bool:
    if eos_token_id is None:
        return False
    return bool((torch.cat(new, dim=1) == eos_token_id).any(dim=1).all())


def _until_all_ended(new: list, eos_token_id) -> list:
    """The new tokens up to the step at which every row has produced ``eos_token_id`` (as eager decoding stops)."""
    if eos_token_id is None:
        return new
    hit = (torch.cat(new, dim=1) == eos_token_id).cummax(dim=1).values.all(dim=0)
    if not bool(hit.any()):
        return new
    return new[: int(hit.int().argmax()) + 1]
