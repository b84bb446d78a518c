"""transformers integration: give a ``*ForCausalLM`` instance a forward that computes the training loss with
thrifty's linear cross-entropy instead of materialising the logits.

In transformers 5.17 the ``loss_function`` hook receives logits that were already computed, so (like apple CCE
and Liger) the only way to skip them is to replace the model's ``forward``. Only this instance is patched.
Works for models whose forward is ``self.model(...)`` -> hidden states -> ``self.lm_head`` (Llama, Mistral,
Qwen2, SmolLM2, ...). An FSDP2-sharded ``lm_head`` works: sharded with its final norm
(thrifty.parallel.shard_model, transformers' own FSDP plan) its weight is already gathered when the loss runs;
sharded alone, the loss runs inside its all-gather (loss.gathered_head.run_with_gathered_head).
"""

from __future__ import annotations

import types

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import _spec
from .cce import check_config, linear_cross_entropy

_LOSS_OPTIONS = {"ignore_index", "softcap", "label_smoothing", "z_loss", "impl", "config"}  # shift, reduction: set here


def _classifier_loss(head, hidden, targets, **kw):
    return linear_cross_entropy(hidden, head.weight, targets, bias=getattr(head, "bias", None), **kw)


def _head_loss(head, hidden, targets, **kw):
    """The loss on ``head``'s weight; an FSDP2 head whose forward did not run is all-gathered around it."""
    if type(head.weight).__name__ == "DTensor":
        from .gathered_head import run_with_gathered_head
        return run_with_gathered_head(head, _classifier_loss, hidden, targets, **kw)
    return _classifier_loss(head, hidden, targets, **kw)


def patch_causal_lm(model, **loss_kwargs):
    """Replaces ``model.forward`` (this instance only); returns the model.

    The new forward takes the stock arguments plus ``skip_logits`` (default: ``model.training`` and labels
    given), ``num_items_in_batch`` (loss = sum / num_items_in_batch, as the HF Trainer expects for gradient
    accumulation) and ``shift_labels`` (already shifted labels). With logits skipped it returns
    ``logits=None``; otherwise it behaves like the stock forward. ``loss_kwargs`` go to
    :func:`thrifty.loss.linear_cross_entropy`: ``ignore_index``, ``softcap``, ``label_smoothing``, ``z_loss``,
    ``impl`` and ``config`` (a :class:`thrifty.loss.CCEKernelConfig`). Patching an already patched model
    replaces the options.
    """
    if not (hasattr(model, "model") and hasattr(model, "lm_head")):
        raise TypeError(f"model: expected a *ForCausalLM with .model and .lm_head, got {type(model).__name__}")
    unknown = sorted(set(loss_kwargs) - _LOSS_OPTIONS)
    if unknown:
        raise TypeError(f"loss_kwargs: unknown linear_cross_entropy option(s) {unknown}; expected some of "
                        f"{sorted(_LOSS_OPTIONS)} (kernel options go in config=thrifty.loss.CCEKernelConfig(...))")
    opts = {"ignore_index": -100, "reduction": "mean", "softcap": None, "shift": True, "label_smoothing": 0.0,
            "z_loss": 0.0}
    opts.update({k: v for k, v in loss_kwargs.items() if k in opts})
    _spec.validate_options(**opts)  # checked now, not at the first training step
    check_config(loss_kwargs.get("config"))
    # Patching again replaces the options; the stock forward stays the one from before the first patch (else
    # the logits path would call the previous patch, which skips the logits when training with labels).
    stock_forward = model.__dict__.get("_thrifty_stock_forward") or model.forward
    model._thrifty_stock_forward = stock_forward

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, skip_logits=None,
                num_items_in_batch=None, shift_labels=None, **kwargs):
        has_labels = labels is not None or shift_labels is not None
        if skip_logits is None:
            skip_logits = self.training and has_labels
        if not skip_logits:
            if shift_labels is not None:
                kwargs["shift_labels"] = shift_labels
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            return stock_forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                                 use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
        if not has_labels:
            raise ValueError("skip_logits=True needs labels (or shift_labels): without them there is nothing to return")
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             **kwargs)
        hidden = outputs.last_hidden_state
        # the HF loss: labels shifted left by one (ignore_index appended), or given pre-shifted
        targets, shift = (shift_labels, False) if shift_labels is not None else (labels, True)
        kw = dict(ignore_index=-100, shift=shift)
        kw.update(loss_kwargs)
        if num_items_in_batch is not None:
            if not torch.is_tensor(num_items_in_batch) and not num_items_in_batch > 0:
                raise ValueError(f"num_items_in_batch: expected a count > 0, got {num_items_in_batch!r}")
            kw["reduction"] = "sum"
        loss = _head_loss(self.lm_head, hidden, targets.to(hidden.device), **kw)
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)

    model.forward = types.MethodType(forward, model)
    return model
