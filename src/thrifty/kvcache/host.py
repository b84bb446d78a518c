"""Pinned host memory for ShadowKV's values, sized from what the machine really has.

Two facts decide the design:

* The box's OOM killer ends the process without a Python error when pinned memory runs out (a benchmark that
  pinned "75% of MemAvailable" was killed about a minute in). So every pinned allocation is checked first
  against :func:`host_budget`: ``MemAvailable`` (read now, from ``/proc/meminfo``) minus a margin, and a
  request over it raises ``MemoryError`` naming the numbers.
* ``tensor.pin_memory()`` and ``torch.empty(..., pin_memory=True)`` go through PyTorch's caching host allocator,
  which rounds every request up to a power of two (``CachingHostAllocator.h``: ``PowerOf2Ceil``, unless
  ``pinned_max_round_threshold_mb`` is set): a 2.56 GB layer of values (bs 10 at 122K) pins 4 GiB. Here the
  memory is an ordinary (pageable, exact-size) tensor registered with ``cudaHostRegister`` (portable + mapped,
  so kernels read it through the same pointer), unregistered when the tensor is freed.

The margin is ``max(8 GiB, 5% of MemTotal)``. What it has to cover, besides the pinned values: this process's
own pageable memory that grows after the values are pinned (CUDA context, Triton compiles, graph capture,
Python objects: 2-4 GiB seen on the box), the page tables of the pinned range (8 bytes per 4 KiB page, 0.2%),
and what ``MemAvailable`` counts as reclaimable but is not instantly (page cache under writeback, other
tenants). 8 GiB covers the first two with room on a 128 GiB box; 5% scales it on larger hosts.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch

GiB = 1 << 30
MARGIN_FLOOR = 8 * GiB
MARGIN_FRACTION = 0.05
_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``MemTotal``, ``MemAvailable``, ...). Tests replace this function."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


@dataclass(frozen=True)
class HostBudget:
    """How much host memory may still be pinned: ``available - margin``, with the arithmetic for logs."""
    available: int
    total: int
    margin: int

    @property
    def budget(self) -> int:
        return max(self.available - self.margin, 0)

    def explain(self) -> str:
        return (f"MemAvailable {self.available / GiB:.1f} GiB - margin {self.margin / GiB:.1f} GiB "
                f"(max({MARGIN_FLOOR // GiB} GiB, {MARGIN_FRACTION:.0%} of MemTotal {self.total / GiB:.1f} GiB)) "
                f"= {self.budget / GiB:.1f} GiB pinnable")

    def check(self, nbytes: int, what: str) -> None:
        """Raises MemoryError (naming ``what`` and the numbers) when ``nbytes`` do not fit the budget."""
        if nbytes > self.budget:
            raise MemoryError(f"{what}: needs {nbytes / GiB:.2f} GiB of pinned host memory, more than the "
                              f"{self.budget / GiB:.2f} GiB this machine can pin safely ({self.explain()})")


def host_budget(margin: Optional[int] = None) -> HostBudget:
    """The budget measured now (``margin`` in bytes overrides the default rule)."""
    info = meminfo()
    if "MemAvailable" not in info or "MemTotal" not in info:
        raise MemoryError("host memory: /proc/meminfo has no MemAvailable/MemTotal; cannot size pinned memory")
    total = info["MemTotal"]
    if margin is None:
        margin = max(MARGIN_FLOOR, int(MARGIN_FRACTION * total))
    return HostBudget(available=info["MemAvailable"], total=total, margin=int(margin))


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - at interpreter exit the CUDA runtime may already be gone
        pass


def pinned_empty(shape, dtype: torch.dtype, *, what: str = "host values",
                 budget: Optional[HostBudget] = None, pin: Optional[bool] = None) -> torch.Tensor:
    """An uninitialised host tensor of exactly ``shape``/``dtype``, page-locked and mapped for the GPU when CUDA
    is present (``pin`` overrides), after checking the bytes against ``budget`` (default: measured now).
    Raises MemoryError naming ``what`` when it does not fit."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    (budget or host_budget()).check(nbytes, what)
    t = torch.empty(shape, dtype=dtype)
    if pin is None:
        pin = torch.cuda.is_available()
    if pin and nbytes:
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, _CUDA_HOST_REGISTER_PORTABLE_MAPPED))
        if err != 0:
            raise MemoryError(f"{what}: cudaHostRegister of {nbytes / GiB:.2f} GiB failed (cudaError {err})")
        weakref.finalize(t, _unregister, t.data_ptr())
    return t
