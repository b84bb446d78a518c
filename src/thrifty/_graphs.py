"""Recording CUDA graphs: the one recipe that ``generate(..., cuda_graph=True)``, the Trainer's graphed step and
``thrifty.bench.capture_graph`` share."""
from __future__ import annotations

import contextlib
import gc
from typing import Callable, Optional

import torch


@contextlib.contextmanager
def gc_paused():
    """Python's automatic cyclic garbage collection paused, and restored afterwards.

    A collection that starts during a capture can destroy an unreachable CUDA graph (one held in a reference
    cycle, e.g. by a closure or a class made at run time). The driver refuses to destroy a graph while a stream is
    capturing, which invalidates the capture in progress ("operation failed due to a previous error during
    capture"); PyTorch then leaves its CUDA RNG in graph mode, and every later random draw in the process fails."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def capture(fn: Callable[[], object], warmup: int = 2, *, repeat: int = 1,
            stream: Optional[torch.cuda.Stream] = None) -> tuple:
    """``(graph, out)``: ``fn()`` called ``warmup`` times eagerly on a side stream (Triton compiles, launcher
    caches, cuBLAS workspaces and lazily built buffers must exist before capture: a capture cannot compile, sync
    or allocate outside its pool), then captured ``repeat`` times, not run, with the garbage collector paused.
    ``out`` is the last captured call's return value (tensors in the graph's pool, written by every replay).
    ``stream``: the capture's stream (torch.cuda.graph's own by default); the warm-up runs on it when given."""
    side = stream if stream is not None else torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph, stream=stream):
        for _ in range(repeat):
            out = fn()
    return graph, out
