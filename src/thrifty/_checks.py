"""Input validation shared by every public entry point.

Each check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong value) with a
message that names the argument, what was expected and what came, so that bad input fails at the API
boundary and never deep inside a kernel.
"""

from __future__ import annotations

import math
import numbers
from typing import Iterable, Optional, Sequence, TypeVar

import torch


def check_tensor(
    name: str,
    x,
    *,
    ndim: Optional[int | Sequence[int]] = None,
    min_ndim: Optional[int] = None,
    dtypes: Optional[Iterable[torch.dtype]] = None,
    floating: bool = False,
    integer: bool = False,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Checks that ``x`` is a tensor with the given rank, dtype family and device; returns it."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.ndim not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{name}: expected {want} dimensions, got shape {tuple(x.shape)}")
    if min_ndim is not None and x.ndim < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimensions, got shape {tuple(x.shape)}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if integer and (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool):
        raise TypeError(f"{name}: expected an integer tensor, got dtype {x.dtype}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if x.dtype not in dtypes:
            raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {x.dtype}")
    if device is not None and x.device != torch.device(device):
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {x.device}")
    return x


def check_token_ids(name: str, ids, vocab_size: int) -> None:
    """ValueError unless every id is in [0, vocab_size): an out-of-range id would crash in a kernel. Host syncs
    for a CUDA tensor; none for a CPU batch (the Trainer's check before it copies a batch into a CUDA graph)."""
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name}: expected ids in [0, {vocab_size}), got min {lo} max {hi}")


def check_same_device(**tensors: Optional[torch.Tensor]) -> None:
    """Raises ValueError when the given tensors (None skipped) live on different devices."""
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {v.device for v in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{k} on {v.device}" for k, v in present.items())
        raise ValueError(f"expected all tensors on one device, got {where}")


def check_positive_int(name: str, value, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}: expected an int {bound}, got {value}")
    return value


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")


def check_number(name: str, value, *, finite: bool = True) -> float:
    """Checks that ``value`` is a real number (not a bool); NaN is always refused, and infinities too unless
    ``finite=False``. Returns it unchanged."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    if math.isnan(value):
        raise ValueError(f"{name}: expected a number, got NaN")
    if finite and math.isinf(value):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    return value


def check_finite(name: str, value) -> float:
    """Checks that ``value`` is a finite real number (NaN and ±inf refused by name); returns it."""
    return check_number(name, value, finite=True)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def check_device(name: str, value) -> torch.device:
    """Parses ``value`` as a torch device that exists here: a CUDA device needs a GPU and an index in range."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name}: expected a torch device (cpu, cuda or cuda:N), got {value!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}: {value} requested but no CUDA GPU is available here")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{name}: {value} requested but only {torch.cuda.device_count()} CUDA device(s) here")
    return device


def check_range(name: str, value, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False,
                finite: bool = True) -> float:
    """Checks ``lo <= value <= hi`` (``lo_open``/``hi_open``: strict). NaN never passes (it compares false with
    everything, so a plain ``<`` test would let it through); an infinity passes only with ``finite=False`` and
    a closed infinite bound."""
    check_number(name, value, finite=False)
    bad_lo = value <= lo if lo_open else value < lo
    bad_hi = value >= hi if hi_open else value > hi
    lb = "(" if lo_open else "["
    hb = ")" if hi_open else "]"
    if bad_lo or bad_hi:
        raise ValueError(f"{name}: expected a value in {lb}{lo}, {hi}{hb}, got {value}")
    if finite and math.isinf(value):
        raise ValueError(f"{name}: expected a finite value in {lb}{lo}, {hi}{hb}, got {value}")
    return value


# The one implementation-choice rule of every public entry point that picks kernels, named ``impl`` everywhere:
#   "auto":      the fastest kernels for the tensors' device (Triton on CUDA), the PyTorch reference elsewhere;
#   "triton":    the Triton kernels, forced: CUDA, or the CPU only under TRITON_INTERPRET=1; else a ValueError;
#   "reference": plain PyTorch (the spec the kernels are tested against), on any device.
# An entry point may offer more kernel names after these (attention's "gluon", the loss's naive "torch").
IMPLS = ("auto", "triton", "reference")

_Config = TypeVar("_Config")


def check_impl(value, extra: Sequence[str] = (), name: str = "impl") -> str:
    """Checks ``value`` against :data:`IMPLS` (plus the entry point's ``extra`` kernel names); returns it.
    TypeError for a non-string, ValueError for an unknown name, both naming ``impl``."""
    choices = IMPLS + tuple(extra)
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected one of {list(choices)}, got {type(value).__name__} {value!r}")
    check_choice(name, value, choices)
    return value


def check_config(config, cls: type[_Config], default: _Config, public_name: str,
                 lookalike: Optional[tuple[str, str]] = None) -> _Config:
    """``config`` if it is a ``cls``, ``default`` for None; else a TypeError naming ``config`` and what was expected
    (``public_name``: the class as users import it). ``lookalike``: (name of thrifty.optimize's config class of
    the same technique, what to do instead), added to the message when that class came. On hot paths: one
    isinstance check for a good config."""
    if isinstance(config, cls):
        return config
    if config is None:
        return default
    got = type(config).__name__
    hint = ""
    if lookalike is not None and got == lookalike[0]:
        hint = f"; thrifty.{lookalike[0]} is optimize()'s, {lookalike[1]}"
    raise TypeError(f"config: expected a {public_name} or None, got {got}{hint}")
