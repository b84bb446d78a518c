"""What a sharded training step communicates, and how much of it the GPU waits for.

* :class:`CollectiveCounter`: a dispatch mode that records every c10d collective a step issues (FSDP2's
  all-gathers and reduce-scatters, the trainer's all-reduces): op, count, dtype, and the bytes of the full
  (unsharded) tensor and of this rank's share. Works on gloo (CPU), so the bytes per step of every recipe are
  measured without a GPU.
* :func:`kernel_overlap`: from a profiler trace's GPU kernels, NCCL kernel time, compute time, the NCCL time
  no compute kernel overlaps ("exposed"), the GPU's idle time inside the step, and the host syncs
  (``cuda*Synchronize`` calls) -- the numbers that say whether a recipe's scaling loss is bytes, exposure or a
  host that cannot run ahead of the GPU.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
KIND = {"allgather": "all_gather", "reduce_scatter": "reduce_scatter", "allreduce": "all_reduce",
        "all_reduce": "all_reduce", "all_gather": "all_gather", "broadcast": "broadcast", "barrier": "barrier"}


def _kind(op_name: str) -> str:
    base = op_name.split(".")[1] if "." in op_name else op_name
    for key, kind in KIND.items():
        if key in base:
            return kind
    return base


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as c: step()`` then ``c.summary()``: per collective kind, the calls, dtypes,
    ``full_bytes`` (the unsharded tensor: an all-gather's output, a reduce-scatter's input, an all-reduce's
    tensor) and ``rank_bytes`` (this rank's share: the all-gather input, the reduce-scatter output).
    ``calls`` lists (kind, dtype, full_bytes) in issue order."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str, int]] = []
        self._rank_bytes: dict = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVE_NAMESPACES:
            kind = _kind(str(func))
            first, second = _tensors(args[0] if args else []), _tensors(args[1] if len(args) > 1 else [])
            if kind == "all_gather" and second:  # (output, input)
                full, share = _bytes(first), _bytes(second)
            elif kind == "reduce_scatter" and second:  # (output, input)
                full, share = _bytes(second), _bytes(first)
            else:
                full = share = _bytes(first)
            dtype = str(first[0].dtype) if first else "-"
            self.calls.append((kind, dtype, full))
            self._rank_bytes[(kind, dtype)] += share
        return func(*args, **kwargs)

    def summary(self) -> dict:
        out: dict = {}
        for kind, dtype, full in self.calls:
            row = out.setdefault(kind, {"calls": 0, "full_bytes": 0, "rank_bytes": 0, "dtypes": {}})
            row["calls"] += 1
            row["full_bytes"] += full
            row["dtypes"][dtype] = row["dtypes"].get(dtype, 0) + full
        for (kind, _), share in self._rank_bytes.items():
            out[kind]["rank_bytes"] += share
        return out


# --------------------------------------------------------------------------------------- trace arithmetic

def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(u: list, v: list) -> float:
    """Total length of the overlap of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(u) and j < len(v):
        a, b = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        if a < b:
            total += b - a
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return total


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def kernel_overlap(events: list[dict]) -> dict:
    """Chrome-trace events (``ph == "X"``, times in µs) of one step -> milliseconds: ``gpu_span`` (first kernel
    start to last kernel end), ``nccl`` / ``compute`` (union of NCCL / other kernels), ``nccl_exposed`` (NCCL
    time with no compute kernel running), ``overlap``, ``gpu_idle`` (span with no kernel at all), and
    ``host_syncs`` (count of cuda*Synchronize runtime calls), ``kernels``."""
    nccl, compute, syncs = [], [], 0
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat == "cuda_runtime" and name in SYNC_CALLS:
            syncs += 1
        if cat != "kernel":
            continue
        iv = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        (nccl if "nccl" in name.lower() else compute).append(iv)
    n, c = _union(nccl), _union(compute)
    every = _union(n + c)
    span = (every[-1][1] - every[0][0]) if every else 0.0
    overlap = _intersection(n, c)
    ms = 1e-3
    return {"gpu_span_ms": span * ms, "nccl_ms": _length(n) * ms, "compute_ms": _length(c) * ms,
            "overlap_ms": overlap * ms, "nccl_exposed_ms": (_length(n) - overlap) * ms,
            "gpu_idle_ms": (span - _length(every)) * ms, "host_syncs": syncs,
            "kernels": len(nccl) + len(compute), "nccl_kernels": len(nccl)}


def trace_summary(path) -> dict:
    """:func:`kernel_overlap` of a chrome trace file written by ``torch.profiler`` (``export_chrome_trace``)."""
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return kernel_overlap(events)
