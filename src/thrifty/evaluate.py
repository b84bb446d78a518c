"""Validation perplexity of any model the package can load: thrifty's reference model, a transformers causal LM,
or a NeuZip checkpoint (used by ``thrifty eval`` and the NeuZip model benchmark)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F


def validation_perplexity(model, dataset, batch_size: int, seq_len: int, max_batches: int, device) -> dict:
    """Mean token loss and perplexity over the first ``max_batches`` validation windows (deterministic), for
    thrifty's LlamaForCausalLM (``labels=``) or any transformers causal LM (logits; labels already shifted)."""
    from .models import LlamaForCausalLM

    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for inputs, labels in dataset.iter_eval_batches(batch_size, seq_len, max_batches):
            inputs, labels = inputs.to(device), labels.to(device)
            if isinstance(model, LlamaForCausalLM):
                loss = model(inputs, labels=labels)
            else:
                logits = model(input_ids=inputs).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
            n = int((labels != -100).sum())
            total, tokens = total + float(loss) * n, tokens + n
    loss = total / max(tokens, 1)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_tokens": tokens}


def load_any_model(path: Path, device, dtype=None):
    """A NeuZip checkpoint (``save_compressed``), a HF/thrifty checkpoint folder (config.json + safetensors), or
    ``smollm2`` (the real pretrained model; Q4_1-dequantized, so its weight statistics are not a bf16 model's)."""
    from .models import LlamaForCausalLM
    from .neuzip.checkpoint import is_compressed_checkpoint, load_compressed

    if str(path) == "smollm2":
        from . import pretrained

        path = pretrained.ensure_converted()
    if is_compressed_checkpoint(path):
        return load_compressed(path, device=device)
    return LlamaForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, device=device)
