"""Activation sparsity per projection, in the shape of the a4.8 paper's Table 2."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn

from .bitlinear import BitLinear
from .recipes import ROLES

TABLE_ROLES = ("qkv", "out", "up", "gate", "down")


@torch.no_grad()
def measure_sparsity(model: nn.Module, batches, *, max_batches: int = 8) -> dict:
    """Runs ``model`` on ``batches`` (an iterable of input-id tensors, or of (inputs, labels) pairs) and returns
    the share of exact zeros in each projection's quantized input, as the paper's Table 2 reports it:

    * ``qkv``, ``out``, ``gate``, ``down``: zeros of the quantized input of those projections (TopK and rounding
      to zero both count);
    * ``up``: the skippable share of the up projection — a product term is skipped when its input entry is zero
      or its gate output (``act_fn(gate)``, ReLU² zeros) is zero: per token ``1 − nz_in · nz_gate``, averaged
      over tokens; ``up_input`` and ``gate_output`` give the two parts;
    * ``overall``: the parameter-weighted mean over the projections, and ``activated_params`` /
      ``projection_params``: the projection weights a token uses / has (embeddings and LM head excluded).

    A full-precision ``nn.Linear`` counts the zeros of its raw input.
    """
    zeros, counts, params = defaultdict(float), defaultdict(float), defaultdict(int)
    gate_nonzero = {}  # MLP -> per-token nonzero share of its gate output, for the up projection's hook
    handles = []

    def quantized(module, x):
        return module.quantize_input(x) if isinstance(module, BitLinear) else x

    def count_hook(role):
        def hook(module, inputs, output):
            xq = quantized(module, inputs[0])
            zeros[role] += float((xq == 0).sum())
            counts[role] += xq.numel()
        return hook

    def gate_hook(mlp):
        def hook(module, inputs, output):
            count_hook("gate")(module, inputs, output)
            act = mlp.act_fn(output)
            gate_nonzero[mlp] = (act != 0).float().mean(-1).flatten()
            zeros["gate_output"] += float((act == 0).sum())
            counts["gate_output"] += act.numel()
        return hook

    def up_hook(mlp):
        def hook(module, inputs, output):
            xq = quantized(module, inputs[0])
            nz_in = (xq != 0).float().mean(-1).flatten()
            zeros["up_input"] += float((xq == 0).sum())
            counts["up_input"] += xq.numel()
            zeros["up"] += float((1.0 - nz_in * gate_nonzero.pop(mlp)).sum())
            counts["up"] += nz_in.numel()
        return hook

    for name, module in model.named_modules():
        role = ROLES.get(name.rsplit(".", 1)[-1])
        if role is None or not isinstance(module, (nn.Linear, BitLinear)):
            continue
        params[role] += module.weight.numel()
    for mlp in model.modules():
        if hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj") and hasattr(mlp, "act_fn"):
            handles.append(mlp.gate_proj.register_forward_hook(gate_hook(mlp)))
            handles.append(mlp.up_proj.register_forward_hook(up_hook(mlp)))
    for name, module in model.named_modules():
        role = ROLES.get(name.rsplit(".", 1)[-1])
        if role in ("qkv", "out", "down") and isinstance(module, (nn.Linear, BitLinear)):
            handles.append(module.register_forward_hook(count_hook(role)))
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        for i, batch in enumerate(batches):
            if i >= max_batches:
                break
            inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
            model(inputs.to(device))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if not counts:
        raise ValueError("model: found no q/k/v/o/gate/up/down projections to measure")
    result = {role: zeros[role] / counts[role] for role in counts}
    total = sum(params[r] for r in TABLE_ROLES)
    result["overall"] = sum(params[r] * result.get(r, 0.0) for r in TABLE_ROLES) / total
    result["projection_params"] = total
    result["activated_params"] = total * (1.0 - result["overall"])
    return result


def format_table(results: dict[str, dict]) -> str:
    """A Markdown table, one row per model: QKV / Out / Up / Gate / Down / overall in %, activated parameters."""
    lines = ["| model | QKV | Out | Up | Gate | Down | overall | activated params |", "|---" * 8 + "|"]
    for name, r in results.items():
        cells = " | ".join(f"{100 * r[k]:.1f}" for k in TABLE_ROLES + ("overall",))
        active, total = r["activated_params"] / 1e6, r["projection_params"] / 1e6
        lines.append(f"| {name} | {cells} | {active:.2f}M of {total:.2f}M |")
    return "\n".join(lines)
