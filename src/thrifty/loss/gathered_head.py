"""Running the classifier inside its FSDP2 all-gather: the loss seams of ``loss.hf`` and of the reference model
need the whole ``lm_head`` weight, and a head sharded as its own FSDP2 unit holds only a shard of it until its
forward runs. Lives here, under ``thrifty.parallel`` (which re-exports it), because the loss seam uses it and
``thrifty.parallel`` builds on the loss kernels."""

from __future__ import annotations

import types
from typing import Callable

import torch
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from torch.distributed.tensor import DTensor


def _head_call(self, fn, *args, **kwargs):
    return fn(self, *args, **kwargs)


def run_with_gathered_head(head: torch.nn.Module, fn: Callable, *args, **kwargs):
    """``fn(head, *args, **kwargs)`` with ``head``'s parameters all-gathered when ``head`` is an FSDP2 unit
    whose forward has not run (its weight is then a sharded DTensor, which no kernel can use); a plain call
    otherwise (a plain head, or the head of :func:`thrifty.parallel.shard_model`, already gathered with the final norm).

    The call goes through a method registered with ``register_fsdp_forward_method``, so FSDP2 runs its
    pre-forward all-gather (with the mixed-precision cast of the parameters and of float arguments), its
    post-forward reshard and, in backward, the re-gather and the reduce-scatter of the gradients -- exactly
    as for ``head(x)``. A head that is not an FSDP2 unit is called as is (a tensor-parallel classifier keeps
    its DTensor weight: give it to thrifty.parallel.vocab_parallel_cross_entropy).
    """
    if not (isinstance(head, FSDPModule) and isinstance(head.weight, DTensor)):
        return fn(head, *args, **kwargs)
    if "_thrifty_head_call" not in head.__dict__:
        head._thrifty_head_call = types.MethodType(_head_call, head)
        register_fsdp_forward_method(head, "_thrifty_head_call")
    return head._thrifty_head_call(fn, *args, **kwargs)
