"""Greedy / sampled generation with the reference model's KV-cache seam, eager or with each decode step replayed
as one CUDA graph (``cuda_graph=True``)."""

from __future__ import annotations

from dataclasses import dataclass
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
    """One call of a fresh :class:`GraphedDecoder` sized for it, the arguments already checked by
    :func:`generate` (``capture=False``: the CPU tests run the recorded step eagerly)."""
    decoder = GraphedDecoder(model, input_ids.shape[0], input_ids.shape[1] + max_new_tokens, _capture=capture)
    return decoder._decode(input_ids, max_new_tokens, temperature, eos_token_id, generator)


@dataclass
class _DecodeState:
    """What a captured step reads and writes, kept across calls while the model stays the same."""
    model_key: tuple  # the model's fingerprint and the device: a change means a new state and a new capture
    cache: object  # the StaticKVCache
    tok: torch.Tensor  # the token fed to the step (B, 1)
    pos: torch.Tensor  # its position (1,)
    step: Optional[Callable] = None  # runs one decode step: the graph's replay (returns None) or the eager step
    logits: Optional[torch.Tensor] = None  # the graph's logits buffer (None without capture)


class GraphedDecoder:
    """Decoding whose step is captured once as a CUDA graph and replayed across calls (one CUDA device).

    ``generate(model, ids, n, cuda_graph=True)`` captures a graph per call: two warm-up steps and the recording,
    ~35 µs of Python per kernel launch of the model, which a 64-token call pays again each time (bitnet NOTES,
    "Decode of the whole 7B-shaped model"). A decoder keeps the graph, its :class:`~thrifty.kv.StaticKVCache`
    (``batch_size`` x ``capacity`` positions per layer) and the token/position buffers the graph reads; each
    :meth:`generate` prefills eagerly into the same buffers and replays. The first call, and the first after
    the model changed (a parameter or buffer moved or was replaced, a module or an attention seam swapped), captures.
    The buffers and the graph's memory stay held until :meth:`release` or until the decoder is dropped.
    """

    def __init__(self, model: LlamaForCausalLM, batch_size: int, capacity: int, *, _capture: bool = True):
        self.model = model
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.capacity = check_positive_int("capacity", capacity)
        self._graphed = _capture
        self.captures = 0  # graphs recorded so far (a test and a benchmark read it)
        self._state: Optional[_DecodeState] = None

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                 eos_token_id: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """As :func:`generate` with ``cuda_graph=True``; ``input_ids`` (batch_size, T) with T + max_new_tokens
        within the capacity."""
        check_tensor("input_ids", input_ids, ndim=2, integer=True)
        check_positive_int("max_new_tokens", max_new_tokens)
        check_range("temperature", temperature, 0.0, 100.0)
        if eos_token_id is not None:
            check_positive_int("eos_token_id", eos_token_id, allow_zero=True)
        B, T = input_ids.shape
        if B != self.batch_size:
            raise ValueError(f"input_ids: batch {B} does not match the decoder's batch_size {self.batch_size}")
        if T + max_new_tokens > self.capacity:
            raise ValueError(f"max_new_tokens: {T} prompt + {max_new_tokens} new tokens exceed the decoder's "
                             f"capacity {self.capacity}; build a decoder with a larger capacity")
        if self._graphed:
            _check_graphable(self.model, input_ids, None)
        return self._decode(input_ids, max_new_tokens, temperature, eos_token_id, generator)

    @torch.no_grad()
    def _decode(self, input_ids, max_new_tokens, temperature, eos_token_id, generator) -> torch.Tensor:
        state = self._state_for(input_ids)
        state.cache.reset()
        logits = self.model(input_ids, cache=state.cache, logits_to_keep=1)
        tok = _choose(logits[:, -1], temperature, generator)
        new = [tok]
        if max_new_tokens == 1 or _ended(new, eos_token_id):
            return torch.cat([input_ids, *new], dim=1)
        state.cache.graph_mode = True
        state.tok.copy_(tok)
        state.pos.fill_(input_ids.shape[1])
        step = self._recorded_step(state)
        for i in range(1, max_new_tokens):
            logits = step()
            if logits is None:  # a replay: the graph wrote its logits buffer
                logits = state.logits
            state.cache.advance(1)
            tok = _choose(logits[:, -1], temperature, generator)
            new.append(tok)
            state.tok.copy_(tok)
            state.pos.add_(1)
            if eos_token_id is not None and (i + 1) % EOS_CHECK_EVERY == 0 and _ended(new, eos_token_id):
                break
        return torch.cat([input_ids, *_until_all_ended(new, eos_token_id)], dim=1)

    def release(self) -> None:
        """Frees the graph and the K/V buffers (the next call builds them again)."""
        self._state = None

    def _fingerprint(self):
        tensors = (*self.model.parameters(), *self.model.buffers())
        return (tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in tensors), tuple(map(id, self.model.modules())),
                tuple(id(layer.self_attn.attention) for layer in self.model.model.layers))

    def _state_for(self, input_ids) -> _DecodeState:
        from ..kv.static import StaticKVCache  # the KV family imports Triton: not with every `import thrifty.models`

        key = (self._fingerprint(), input_ids.device)
        if self._state is None or self._state.model_key != key:
            self._state = _DecodeState(key, StaticKVCache(self.capacity), torch.zeros_like(input_ids[:, :1]),
                                       torch.zeros(1, dtype=torch.long, device=input_ids.device))
        return self._state

    def _recorded_step(self, state: _DecodeState) -> Callable:
        """The state's decode step: recorded once as a graph (its replay returns None) or, without capture, the
        eager step itself."""
        if state.step is None:
            step = lambda: self.model(state.tok, positions=state.pos, cache=state.cache)  # noqa: E731
            if self._graphed:
                graph, state.logits = _capture(step)
                state.step = lambda: graph.replay()
                self.captures += 1
            else:
                state.step = step
        return state.step


def _capture(step):
    """(graph, its logits buffer): two warm-up runs (they write the same cache slot the first replay writes again,
    with the same token), then the capture."""
    from .._graphs import capture

    return capture(step, warmup=2)


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
