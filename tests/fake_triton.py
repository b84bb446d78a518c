"""Stand-ins for a ``@triton.jit`` function, its compiled kernel and Triton's driver: ``FastLauncher``'s host path
(Triton's own path and the direct keyed launch) exercised on the CPU. Shared by the launcher and harness tests."""

from __future__ import annotations

import types

from thrifty import triton_utils


class FakeKernel:
    """A compiled kernel: ``run`` records its arguments (grid, stream, metadata, kernel arguments)."""

    def __init__(self):
        self.runs = []
        self.function, self.packed_metadata = "fn", "meta"

    def run(self, *args):
        self.runs.append(args)


class FakeJit:
    """A @triton.jit function: ``fn[grid](*args, **kw)`` "compiles" (counted) and returns its one kernel."""
    __name__ = "_fake_kernel"

    def __init__(self, arg_names):
        self.arg_names = list(arg_names)
        self.compiles = 0
        self.kernel = FakeKernel()

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.compiles += 1
            return self.kernel
        return launch


def allow_direct_launches(monkeypatch, stream="stream") -> None:
    """FastLauncher's direct path on a CPU: a fake driver (device 0, ``stream``) and no environment veto."""
    monkeypatch.setattr(triton_utils, "_DRIVER", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda d: stream)))
    monkeypatch.setattr(triton_utils, "_direct_launch_allowed", lambda: True)
