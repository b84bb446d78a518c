"""Per-layer 4/8-bit plans for quantized attention on the reference model: :func:`calibrate` scores each layer's
4-bit attention against its exact attention on real inputs, :func:`plan_from_scores` turns scores into bits,
:func:`save_plan` / :func:`load_plan` keep a plan as JSON and :func:`apply_plan` puts it on a model."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Iterable, Optional

import torch

from .._checks import check_choice, check_number, check_range
from .reference import accuracy_metrics
from .sage import SageConfig, sage_attention
from .seam import sage_options, sage_seam

PLAN_FORMAT = "thrifty.sage_plan/1"


def _attention_layers(model):
    try:
        return [layer.self_attn for layer in model.model.layers]
    except AttributeError:
        raise TypeError("model: expected thrifty's reference LlamaForCausalLM (model.model.layers[i].self_attn)") from None


@torch.no_grad()
def calibrate(model, batches: Iterable, *, threshold: float = 0.99, low_bits: int = 4,
              return_scores: bool = False, impl: str = "auto", config: Optional[SageConfig] = None):
    """Per-layer plan {layer index: bits}: 4 where the layer's 4-bit attention scores at least ``threshold``
    on every batch, else 8. Score = cos_sim·(1 − relative L1) of the 4-bit output against the layer's
    full-precision attention, on the layer's real inputs (the model runs in full precision meanwhile).

    ``batches``: input-id tensors (B, T) (or tuples whose first item is one). ``return_scores``: return
    ``(plan, {layer: worst score})``. ``impl`` and ``config`` are :func:`sage_attention`'s (the config's
    ``qk_bits`` replaced by ``low_bits``).
    """
    check_range("threshold", threshold, 0.0, 1.0)
    check_choice("low_bits", low_bits, (4, 8))
    options = sage_options(impl, config)
    options["config"] = dataclasses.replace(options["config"], qk_bits=low_bits)
    attns = _attention_layers(model)
    worst = [1.0] * len(attns)
    originals = [a.attention for a in attns]

    def recorder(i, original):
        def fn(q, k, v, *, causal, scale):
            exact = original(q, k, v, causal=causal, scale=scale)
            quant = sage_attention(q, k, v, causal=causal, sm_scale=scale, **options)
            score = accuracy_metrics(quant, exact)["score"]
            if math.isnan(score):  # min() would skip a NaN and keep the layer's 1.0: a silent "4 bits is fine"
                raise ValueError(f"batches: layer {i}'s attention is NaN on this batch (NaN weights or inputs); "
                                 "cannot calibrate")
            worst[i] = min(worst[i], score)
            return exact
        return fn

    try:
        for i, a in enumerate(attns):
            a.attention = recorder(i, originals[i])
        n = 0
        for batch in batches:
            ids = batch[0] if isinstance(batch, (tuple, list)) else batch
            model(ids.to(next(model.parameters()).device))
            n += 1
        if n == 0:
            raise ValueError("batches: expected at least one batch")
    finally:
        for a, original in zip(attns, originals):
            a.attention = original
    plan = plan_from_scores(dict(enumerate(worst)), threshold, low_bits=low_bits)
    return (plan, dict(enumerate(worst))) if return_scores else plan


def plan_from_scores(scores: dict, threshold: float, *, low_bits: int = 4) -> dict:
    """{layer: bits}: ``low_bits`` where the layer's calibration score reaches ``threshold``, else 8. Lets one
    :func:`calibrate` run (``return_scores=True``) give the plans of several thresholds."""
    check_range("threshold", threshold, 0.0, 1.0)
    check_choice("low_bits", low_bits, (4, 8))
    if not isinstance(scores, dict):
        raise TypeError(f"scores: expected a dict {{layer: score}}, got {type(scores).__name__}")
    for i, s in scores.items():
        check_number(f"scores[{i!r}]", s, finite=False)
    return {i: (low_bits if s >= threshold else 8) for i, s in scores.items()}


def save_plan(plan: dict, path, *, scores: Optional[dict] = None, **meta) -> Path:
    """Writes ``plan`` as JSON: {"format", "layers": {"0": 8, ...}, "scores"?, "meta"?}."""
    check_plan(plan)
    doc = {"format": PLAN_FORMAT, "layers": {str(i): int(b) for i, b in sorted(plan.items())}}
    if scores:
        doc["scores"] = {str(i): float(s) for i, s in sorted(scores.items())}
    if meta:
        doc["meta"] = meta
    from .._io import atomic_path, check_output_path

    path = check_output_path("path", path)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def load_plan(path) -> dict:
    """Reads a plan written by :func:`save_plan`: {layer index: bits}."""
    from .._io import read_json

    doc = read_json(path, "sage plan")
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise ValueError(f"{path}: not a thrifty sage plan (expected format {PLAN_FORMAT!r})")
    layers = doc.get("layers")
    if not isinstance(layers, dict) or not all(isinstance(i, str) and i.isdigit() and type(b) is int
                                               for i, b in layers.items()):
        raise ValueError(f"{path}: corrupted plan (expected \"layers\": {{\"0\": 4 or 8, ...}})")
    plan = {int(i): b for i, b in layers.items()}
    try:
        check_plan(plan)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return plan


def check_plan(plan):
    """TypeError/ValueError naming ``plan`` unless it is a {layer index: 4 or 8} dict."""
    if not isinstance(plan, dict):
        raise TypeError(f"plan: expected a dict {{layer: bits}}, got {type(plan).__name__}")
    for i, b in plan.items():
        if not isinstance(i, int) or b not in (4, 8):
            raise ValueError(f"plan: expected int layer -> 4 or 8, got {i!r} -> {b!r}")


def apply_plan(model, plan: dict, *, impl: str = "auto", config: Optional[SageConfig] = None) -> None:
    """Sets each layer's attention to sage attention with the plan's bits (layers not in the plan: 8); ``impl``
    and ``config`` are :func:`sage_attention`'s (the config's ``qk_bits`` replaced per layer)."""
    check_plan(plan)
    config = sage_options(impl, config)["config"]
    attns = _attention_layers(model)
    bad = [i for i in plan if not 0 <= i < len(attns)]
    if bad:
        raise ValueError(f"plan: layers {bad} do not exist (model has {len(attns)})")
    for i, a in enumerate(attns):
        a.attention = sage_seam(impl=impl, config=dataclasses.replace(config, qk_bits=plan.get(i, 8)))


__all__ = ["calibrate", "plan_from_scores", "save_plan", "load_plan", "apply_plan", "PLAN_FORMAT"]
