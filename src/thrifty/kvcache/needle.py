"""Passkey retrieval (RULER-style "needle in a haystack") to compare dense attention, ShadowKV and the
Quest-style baseline at the same budget: a random number is hidden at a chosen depth of real filler text and
the model is asked for it at the end; the answer counts when the greedy continuation starts with the number.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .._checks import check_positive_int, check_range

INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n"
QUESTION = "\nWhat is the pass key? The pass key is"


def needle_text(key: int) -> str:
    return f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n"


@dataclass
class PasskeyTask:
    input_ids: torch.Tensor  # (1, length)
    key: int
    length: int
    depth: float


def make_passkey_task(encode: Callable[[str], list], filler: Sequence[int], length: int, depth: float,
                      rng: random.Random) -> PasskeyTask:
    """A prompt of exactly ``length`` tokens: intro, filler tokens (taken from a random offset of ``filler``) with
    the needle inserted at ``depth`` (0 = start, 1 = end of the filler), the question."""
    check_positive_int("length", length)
    check_range("depth", depth, 0.0, 1.0)
    key = rng.randint(10000, 99999)
    head, needle, tail = encode(INTRO), encode(needle_text(key)), encode(QUESTION)
    n_fill = length - len(head) - len(needle) - len(tail)
    if n_fill < 1:
        raise ValueError(f"length: expected more than {length - n_fill} tokens for the prompt frame, got {length}")
    if len(filler) < n_fill:
        raise ValueError(f"filler: expected at least {n_fill} tokens, got {len(filler)}")
    start = rng.randrange(0, len(filler) - n_fill + 1)
    fill = [int(t) for t in filler[start:start + n_fill]]
    cut = round(depth * n_fill)
    ids = head + fill[:cut] + needle + fill[cut:] + tail
    return PasskeyTask(torch.tensor([ids]), key, length, depth)


@torch.no_grad()
def answer_is_correct(model, task: PasskeyTask, decode: Callable[[list], str], cache=None,
                      max_new_tokens: int = 8) -> bool:
    """Greedy decoding of a transformers model (with ``cache`` as ``past_key_values`` when given)."""
    kw = {} if cache is None else {"past_key_values": cache}
    ids = task.input_ids.to(model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, **kw)
    text = decode(out[0, ids.shape[1]:].tolist())
    digits = "".join(ch for ch in text.strip().split(" ")[0] if ch.isdigit()) if text.strip() else ""
    return digits == str(task.key)


def evaluate_passkey(model, encode, decode, filler: Sequence[int], lengths: Sequence[int],
                     depths: Sequence[float], samples: int, methods: dict, *, seed: int = 0,
                     progress: Optional[Callable] = None) -> list[dict]:
    """Accuracy per (method, length, depth). ``methods``: name -> a ShadowKVConfig, or None for dense. Every
    method sees the same prompts. Returns rows ``{method, length, depth, accuracy, n}``."""
    from .cache import ShadowKVCache

    check_positive_int("samples", samples)
    rng = random.Random(seed)
    tasks = [make_passkey_task(encode, filler, n, d, rng) for n in lengths for d in depths for _ in range(samples)]
    hits = {(m, t.length, t.depth): 0 for m in methods for t in tasks}
    work = [(m, t) for t in tasks for m in methods]
    for name, task in (progress(work) if progress else work):
        config = methods[name]
        cache = None if config is None else ShadowKVCache(model, config)
        hits[(name, task.length, task.depth)] += answer_is_correct(model, task, decode, cache)
    return [{"method": m, "length": n, "depth": d, "accuracy": h / samples, "n": samples}
            for (m, n, d), h in hits.items()]
