"""LOMO-style fused update: each parameter's gradient is applied the moment backward produces it, then freed.

``lomo(model, LomoConfig(...))`` works on any model. Plain parameters get a post-accumulate-grad hook (the
update runs when autograd has finished that parameter's gradient, tied weights after both uses; ``p.grad`` is
then set to None). Weights kept outside the parameters (NeuZip's compressed blocks) are updated by their
owner: ``lomo`` hands the optimizer to any object on the model with an ``attach_optimizer(optimizer)`` method,
and the owner calls ``optimizer.update(key, weight, grad)`` itself (NeuZip does it inside its linear's backward,
in the decoded block buffer, and re-encodes the block once its last weight is updated: :mod:`thrifty.neuzip.state`).
This package imports nothing of NeuZip. So at most one parameter's gradient exists at a time and no full
gradient set ever coexists with the weights.

Optimizer states (AdamW): ``exp_avg`` and ``exp_avg_sq`` per parameter, on the parameter's device, in
``state_dtype`` (float32 default: 8 B per parameter; bfloat16: 4 B; ``"int8"``: block-wise 8-bit codes,
:mod:`thrifty.optim.state8`, 2 B + 8 B per ``state_block`` values = 2.03 B at 256), never NeuZip-compressed.
The update math runs in float32 (8-bit states: dequantized, updated, requantized in the same pass) and is
rounded once to the weight's dtype. SGD keeps no state. There is no global gradient-norm
clipping (it needs every gradient before the first update; LOMO's paper runs a second backward for it) and no
gradient accumulation (each backward is a step).

The same function updates a compressed weight and a plain one, so lossless NeuZip training is bit-identical
to this optimizer on the uncompressed model (tested step by step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .._checks import check_choice, check_impl, check_range
from . import state8

OPTIMIZERS = ("sgd", "adamw")
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)  # torch.int8: 8-bit block-quantized states
CHUNK = 1 << 22  # elements per update pass (fp32 temporaries of 16 MB)


@dataclass
class LomoConfig:
    """The fused optimizer. ``weight_decay`` applies to parameters with >= 2 dimensions (matrices) only.
    ``state_dtype``: torch.float32, torch.bfloat16 or torch.int8 (also spelled "int8"): AdamW states as 8-bit
    codes with one float32 absmax per ``state_block`` values (:mod:`thrifty.optim.state8`).
    ``impl``: the AdamW update as one Triton launch per parameter (:mod:`thrifty.optim.lomo_kernel`; "auto"
    picks it for CUDA weights) or as torch ops ("reference"; "auto" on the CPU). SGD always runs torch ops."""

    optimizer: str = "adamw"
    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    state_dtype: torch.dtype = torch.float32
    state_block: int = 256
    impl: str = "auto"

    def __post_init__(self):
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_impl(self.impl)
        check_range("lr", self.lr, 0.0, 10.0, lo_open=True)
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2):
            raise ValueError(f"betas: expected a pair (beta1, beta2), got {self.betas!r}")
        for i, b in enumerate(self.betas):
            check_range(f"betas[{i}]", b, 0.0, 1.0, hi_open=True)
        self.betas = tuple(float(b) for b in self.betas)
        check_range("eps", self.eps, 0.0, 1.0, lo_open=True)
        check_range("weight_decay", self.weight_decay, 0.0, 10.0)
        if self.state_dtype == "int8":
            self.state_dtype = torch.int8
        if not isinstance(self.state_dtype, torch.dtype) or self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype: expected one of {list(STATE_DTYPES)} or 'int8', got {self.state_dtype!r}")
        state8.check_block("state_block", self.state_block)

    @property
    def eight_bit(self) -> bool:
        return self.state_dtype == torch.int8


class FusedOptimizer:
    """Per-parameter update ``update(key, weight, grad)``, in place on ``weight``; states keyed by name."""

    def __init__(self, config: LomoConfig):
        if not isinstance(config, LomoConfig):
            raise TypeError(f"config: expected a LomoConfig, got {type(config).__name__}")
        self.config = config
        self.lr = config.lr
        self.state: dict[str, dict] = {}
        self.updates = 0  # parameter updates so far (tests, logging)
        self._handles: list = []

    def set_lr(self, lr: float) -> None:
        """Learning rate for the next updates (a schedule calls this before each backward)."""
        self.lr = check_range("lr", lr, 0.0, 10.0)

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))

    @torch.no_grad()
    def update(self, key: str, weight: torch.Tensor, grad: torch.Tensor) -> None:
        """One step for one parameter, in place. Large tensors go in flat chunks of ``CHUNK`` elements, so the
        fp32 temporaries stay ~4 x 16 MB (an embedding's would be GBs); elementwise, so the bits are the same."""
        cfg = self.config
        decay = cfg.weight_decay if weight.dim() >= 2 else 0.0
        st = None
        if cfg.optimizer == "adamw":
            st = self.state.get(key)
            if st is None:
                st = self.state[key] = self._new_state(weight)
            st["step"] += 1
        if st is not None and self._kernel_for(weight):
            from .lomo_kernel import adamw_update

            adamw_update(weight, grad, st, lr=self.lr, betas=cfg.betas, eps=cfg.eps, decay=decay, step=st["step"],
                         state_block=cfg.state_block)
            self.updates += 1
            return
        flat_w, flat_g = weight.view(-1), grad.contiguous().view(-1)
        block = cfg.state_block
        chunk = max(block, CHUNK // block * block) if cfg.eight_bit else CHUNK  # whole 8-bit blocks per chunk
        for a in range(0, flat_w.numel(), chunk):
            b = a + chunk
            states = None
            if st is not None:
                states = [st[k].view(-1)[a:b] for k in ("exp_avg", "exp_avg_sq")]
                if cfg.eight_bit:
                    states += [st[k][a // block: -(-b // block)] for k in ("exp_avg_scale", "exp_avg_sq_scale")]
            self._update_chunk(flat_w[a:b], flat_g[a:b], decay, st and st["step"], states)
        self.updates += 1

    def _kernel_for(self, weight: torch.Tensor) -> bool:
        """True when this AdamW update runs as one Triton launch: impl "triton", or "auto" on CUDA with Triton
        installed (a non-contiguous weight, which the kernel cannot update in place, takes the torch path)."""
        from ..triton_utils import kernels_available

        impl = self.config.impl
        if impl == "reference" or not weight.is_contiguous():
            return False
        available = kernels_available(weight.device)
        if impl == "auto":
            return weight.is_cuda and available
        if not available:
            raise ValueError(f"impl: 'triton' needs CUDA weights (or TRITON_INTERPRET=1 on the CPU), got a "
                             f"weight on {weight.device}")
        return True

    def _new_state(self, weight: torch.Tensor) -> dict:
        cfg, dev, n = self.config, weight.device, weight.numel()
        if not cfg.eight_bit:
            zeros = lambda: torch.zeros(weight.shape, dtype=cfg.state_dtype, device=dev)  # noqa: E731
            return {"step": 0, "exp_avg": zeros(), "exp_avg_sq": zeros()}
        nb = state8.num_blocks(n, cfg.state_block)  # all-zero codes and scales decode to 0
        return {"step": 0, "exp_avg": torch.zeros(n, dtype=torch.int8, device=dev),
                "exp_avg_sq": torch.zeros(n, dtype=torch.uint8, device=dev),
                "exp_avg_scale": torch.zeros(nb, dtype=torch.float32, device=dev),
                "exp_avg_sq_scale": torch.zeros(nb, dtype=torch.float32, device=dev)}

    def _update_chunk(self, weight, grad, decay, step, states) -> None:
        """``states``: None (SGD), [exp_avg, exp_avg_sq] or, 8-bit, [m codes, v codes, m scales, v scales]."""
        cfg = self.config
        w = weight.float()  # the weight itself when it is float32
        g = grad.float()
        if decay:
            w.mul_(1.0 - self.lr * decay)
        if cfg.optimizer == "sgd":
            w.add_(g, alpha=-self.lr)
        else:
            b1, b2 = cfg.betas
            exp_avg, exp_avg_sq = states[0], states[1]
            if cfg.eight_bit:
                m = state8.dequantize(exp_avg, states[2], cfg.state_block)
                v = state8.dequantize(exp_avg_sq, states[3], cfg.state_block)
            else:
                m, v = exp_avg.float(), exp_avg_sq.float()
            m.lerp_(g, 1.0 - b1)
            v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            bc1 = 1.0 - b1 ** step
            bc2 = 1.0 - b2 ** step
            denom = (v.sqrt() / math.sqrt(bc2)).add_(cfg.eps)
            w.addcdiv_(m, denom, value=-self.lr / bc1)
            if cfg.eight_bit:
                state8.quantize_into(m, exp_avg, states[2], cfg.state_block, signed=True)
                state8.quantize_into(v, exp_avg_sq, states[3], cfg.state_block, signed=False)
            elif m.data_ptr() != exp_avg.data_ptr():
                exp_avg.copy_(m)
                exp_avg_sq.copy_(v)
        if w.data_ptr() != weight.data_ptr():
            weight.copy_(w)

    def remove(self) -> None:
        """Removes the hooks (the model trains no more through this optimizer)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


def lomo(model: torch.nn.Module, config: Optional[LomoConfig] = None) -> FusedOptimizer:
    """Attaches the fused optimizer to ``model`` (plain or NeuZip-compressed); returns it (``set_lr``,
    ``remove``). Every requires-grad parameter is updated in its post-accumulate-grad hook; an owner of weights
    that are not parameters (an attribute of ``model`` with ``attach_optimizer``, e.g. ``model.neuzip``) gets the
    optimizer first and may refuse it (NeuZip raises ValueError for lossy weights)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    opt = FusedOptimizer(LomoConfig() if config is None else config)
    for owner in _weight_owners(model):
        owner.attach_optimizer(opt)  # may raise (NeuZip: lossy weights)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue

        def hook(param, key=name):
            opt.update(key, param.data, param.grad)
            param.grad = None

        opt._handles.append(p.register_post_accumulate_grad_hook(hook))
    return opt


def _weight_owners(model: torch.nn.Module) -> list:
    """Plain (non-module, non-parameter) attributes of ``model`` that own weights outside its parameters: those
    with a callable ``attach_optimizer`` (NeuZip's ``model.neuzip``). Duck-typed, so this package needs no NeuZip."""
    return [v for k, v in vars(model).items() if not k.startswith("_") and callable(getattr(v, "attach_optimizer", None))]
