"""transformers (5.x) integration: ``enable_hf(model)`` makes every attention layer of a HF model call
:func:`thrifty.attention.sage_attention`; ``disable_hf(model)`` restores the previous implementation.

transformers looks attention functions up by name in ``AttentionInterface``; the causal mask is built by the
function registered under the *same* name in ``AttentionMaskInterface`` and is silently skipped for names
missing there. We register SDPA's mask builder, which returns ``None`` when the mask is plain causal (no
padding): then the kernel runs causal. When a real mask comes (padding, packed sequences), or dropout is
asked for, the call falls back to transformers' exact SDPA attention: the kernel supports no arbitrary masks.
"""

from __future__ import annotations

from typing import Optional

from .api import _check_plan, check_sage_options, sage_attention

NAME = "thrifty_sage"
_OPTIONS: dict = {}  # the registry is global: the options of the last enable_hf call apply to every model


def hf_sage_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    """transformers attention signature: (B, H, S, D) inputs, returns ((B, S, H, D) output, None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None or (dropout > 0.0 and module.training):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    options = dict(_OPTIONS.get("options", {}))
    plan = _OPTIONS.get("plan")
    if plan is not None and getattr(module, "layer_idx", None) in plan:
        options["qk_bits"] = plan[module.layer_idx]
    out = sage_attention(query, key, value, causal=bool(causal) and query.shape[2] > 1, sm_scale=scaling,
                         **options)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Registers :data:`NAME` in transformers' AttentionInterface and AttentionMaskInterface."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, hf_sage_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def enable_hf(model, *, plan: Optional[dict] = None, **options) -> None:
    """Switches a transformers model to sage attention. ``plan``: {layer index: 4 or 8} (from
    :func:`~thrifty.attention.calibrate` on the same architecture); ``options``: sage_attention keywords."""
    if not hasattr(getattr(model, "config", None), "_attn_implementation"):
        raise TypeError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__} "
                        "(thrifty's own model takes model.set_attention(sage_seam(...)))")
    if plan is not None:
        _check_plan(plan)
    check_sage_options(options)
    register()
    _OPTIONS.clear()
    _OPTIONS.update(options=options, plan=plan)
    if not hasattr(model, "_thrifty_previous_attn"):
        model._thrifty_previous_attn = model.config._attn_implementation
    _set_implementation(model, NAME)


def disable_hf(model) -> None:
    """Restores the attention implementation the model had before :func:`enable_hf`."""
    previous = getattr(model, "_thrifty_previous_attn", None)
    if previous is None:
        return
    _set_implementation(model, previous)
    del model._thrifty_previous_attn


def _set_implementation(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older transformers: the layers read the config at call time
        model.config._attn_implementation = name
