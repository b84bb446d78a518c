"""A check shared by the tests of captured (CUDA-graph) decoding."""

from __future__ import annotations

import torch


def assert_greedy_up_to_near_ties(model, out: torch.Tensor, prompt_len: int, rel_tol: float = 2e-2) -> None:
    """Every token ``out`` generated after its first ``prompt_len`` is one that the model's own forward over ``out``
    ranks first, within ``rel_tol`` of the logits' range. Token-for-token equality with eager decoding is not the
    contract: a graph's attention reads a masked fixed-length buffer, and one rounding flip of a near-tie changes
    every later token."""
    with torch.no_grad():
        logits = model(out[:, :-1]).float()[:, prompt_len - 1:]  # the prediction for each generated token
    chosen = logits.gather(-1, out[:, prompt_len:, None]).squeeze(-1)
    top = logits.max(-1).values
    tol = rel_tol * (logits.max() - logits.min()).item()
    assert bool((chosen >= top - tol).all()), (top - chosen).max().item()
