"""Benchmark harness: timing, peak memory, one result schema, a plot and a table.

Every benchmark in ``benchmarks/`` uses this module so that its numbers are taken the same way and land in
``benchmarks/results/<name>_<device>.json`` (plus a PNG beside it) with the same keys.

Timing on CUDA uses events around each call, after a warm-up, and reports the median; the caller passes
several input sets (or a factory) and the timer cycles through them so that a small working set does not sit
in L2 and flatter the result; ``flush_l2=True`` also overwrites L2 before every call. On CPU the same API
times with ``time.perf_counter`` so that everything here is testable without a GPU.

Instrumentation (benchmarks and tests; not thread-safe): :func:`count_launches` counts the launches of thrifty's
Triton launchers inside a block; :func:`stubbed_launches` takes the GPU out of them, so that the host side of a
call can be timed on a CPU.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from . import _graphs
from ._checks import check_choice, check_positive_int
from .paths import repo_root

SCHEMA_VERSION = 1
REQUIRED_KEYS = ("schema", "name", "device", "meta", "summary", "rows")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


# --------------------------------------------------------------------------------------------- device / env
def detect_device(device: Optional[torch.device | str] = None) -> str:
    """Short device tag for file names: "h100", "h200", another GPU's slug, or "cpu"."""
    dev = torch.device(device) if device is not None else None
    if (dev is not None and dev.type != "cuda") or not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(dev).lower()  # e.g. "nvidia h100 80gb hbm3"
    tokens = re.split(r"[^a-z0-9]+", name)
    for tag in ("h200", "h100", "h800", "h20", "a100", "l40s", "b200", "gb200"):
        if tag in tokens:
            return tag
    return re.sub(r"[^a-z0-9]+", "_", name.replace("nvidia", "")).strip("_") or "cuda"


def git_commit() -> Optional[str]:
    """``$THRIFTY_COMMIT`` when set (explicit wins), else HEAD of the checkout (``-dirty`` appended when tracked
    files differ).

    The tree copied to the GPU box has no ``.git`` of its own (a stale one was seen there once, which named the
    wrong commit), so ``benchmarks/run_on_gpu.sh`` is given the commit.
    """
    if os.environ.get("THRIFTY_COMMIT"):
        return os.environ["THRIFTY_COMMIT"]
    root = repo_root()
    if root is not None and (root / ".git").exists():
        try:
            sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                 timeout=10, check=True).stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return sha + ("-dirty" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return None


def _version(module: str) -> Optional[str]:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or broken install: record the absence, never fail a benchmark
        return None


def env_info(device: Optional[str] = None) -> dict:
    """What produced a result: versions, GPU, date, commit."""
    info = {
        "device": device or detect_device(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "cuda": torch.version.cuda,
        "gpu": None,
        "host": platform.node(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_sms"] = p.multi_processor_count
        info["gpu_mem_gib"] = round(p.total_memory / 2**30, 1)
        info["gpu_l2_mib"] = round(getattr(p, "L2_cache_size", 0) / 2**20, 1)
    return info


# --------------------------------------------------------------------------------------------------- timing
@dataclass
class Timing:
    """Per-call times in milliseconds; ``median_ms`` is the headline."""

    times_ms: list = field(repr=False)
    backend: str  # "cuda-events", "cuda-events, gpu-only" or "perf_counter"

    @property
    def reps(self) -> int:
        return len(self.times_ms)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def min_ms(self) -> float:
        return min(self.times_ms)

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.times_ms)

    @property
    def spread_pct(self) -> float:
        """(p90 - p10) / median, in percent: how noisy the median is."""
        q = statistics.quantiles(self.times_ms, n=10) if self.reps >= 2 else [self.median_ms] * 9
        return 100.0 * (q[-1] - q[0]) / self.median_ms if self.median_ms > 0 else 0.0

    def rate(self, amount: float, unit: float = 1e12) -> float:
        """``amount`` (flops, bytes, ...) per second of the median call, divided by ``unit`` (1e12: T/s)."""
        return amount / (self.median_ms * 1e-3) / unit

    def __repr__(self) -> str:
        return f"Timing(median={self.median_ms:.4g} ms, reps={self.reps}, spread={self.spread_pct:.1f}%)"


def _as_args(item) -> tuple:
    return item if isinstance(item, tuple) else (item,)


def _input_sets(inputs, n_inputs: int) -> list:
    if inputs is None:
        return [()]
    if callable(inputs):
        return [_as_args(inputs()) for _ in range(n_inputs)]
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
        raise TypeError(f"inputs: expected a list of argument tuples, a factory or None, got {type(inputs).__name__}")
    if len(inputs) == 0:
        raise ValueError("inputs: expected at least one input set, got an empty list")
    return [_as_args(x) for x in inputs]


_L2_BUFFERS: dict = {}


def _l2_flusher(device: torch.device) -> Callable[[], None]:
    """Writes a buffer twice the size of L2, evicting whatever the last call left there."""
    if device not in _L2_BUFFERS:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 * 2**20
        _L2_BUFFERS[device] = torch.empty(2 * l2, dtype=torch.uint8, device=device)
    buf = _L2_BUFFERS[device]
    return lambda: buf.fill_(1)


def time_fn(
    fn: Callable,
    inputs=None,
    *,
    n_inputs: int = 4,
    warmup: int = 3,
    reps: int = 50,
    min_reps: int = 3,
    budget_s: Optional[float] = None,
    flush_l2: bool = False,
    gpu_only: bool = False,
    device: Optional[torch.device | str] = None,
) -> Timing:
    """Times ``fn(*args)`` cycling over input sets; returns per-call times (median is the headline).

    inputs: a list of input sets (a tuple is unpacked as positional arguments, anything else is passed as the
        one argument), or a zero-argument factory called ``n_inputs`` times up front, or None (``fn()``).
    warmup: untimed calls first (compilation, autotuning, handle creation stay out of the numbers).
    reps: timed calls; with ``budget_s`` fewer are made (never under ``min_reps``) when the warm-up shows
        that ``reps`` calls would take longer than the budget (large problems).
    flush_l2: on CUDA, overwrite L2 before each timed call (outside the timed region).
    gpu_only: on CUDA, keep the GPU busy (a spin kernel, about twice the host time of one call) before each
        timed call, so that the host's Python and launch overhead happens while the GPU spins and the events
        measure GPU time only. Without it a call whose host path is longer than its kernels is timed as host
        time (small problems); report both where that matters.
    device: where ``fn`` runs; default CUDA when available. Only CUDA uses events; others use perf_counter.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    check_positive_int("n_inputs", n_inputs)
    check_positive_int("warmup", warmup, allow_zero=True)
    check_positive_int("reps", reps)
    check_positive_int("min_reps", min_reps)
    for name, flag in (("flush_l2", flush_l2), ("gpu_only", gpu_only)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected True or False, got {flag!r}")
    if budget_s is not None and (isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or budget_s <= 0):
        raise ValueError(f"budget_s: expected a positive number of seconds or None, got {budget_s!r}")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: CUDA requested but torch.cuda.is_available() is False")
    sets = _input_sets(inputs, n_inputs)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda *a: None)

    t0 = time.perf_counter()
    for i in range(warmup):
        fn(*sets[i % len(sets)])
    sync()
    if budget_s is not None and warmup > 0:
        per_call = (time.perf_counter() - t0) / warmup
        reps = max(min(reps, int(budget_s / max(per_call, 1e-9))), min(min_reps, reps))

    flush = _l2_flusher(dev) if (flush_l2 and cuda) else None
    spin = _spin_cycles(fn, sets) if (gpu_only and cuda) else 0
    times = []
    if cuda:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for i, (start, end) in enumerate(ev):
            if flush is not None:
                flush()
            if spin:
                torch.cuda._sleep(spin)
            start.record()
            fn(*sets[i % len(sets)])
            end.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in ev]
        return Timing(times, "cuda-events, gpu-only" if spin else "cuda-events")
    else:
        for i in range(reps):
            args = sets[i % len(sets)]
            t = time.perf_counter()
            fn(*args)
            times.append((time.perf_counter() - t) * 1e3)
    return Timing(times, "cuda-events" if cuda else "perf_counter")


def capture_graph(fn: Callable[[], object], warmup: int = 2, *, repeat: int = 1) -> tuple:
    """``(graph, out)``: ``fn()`` captured ``repeat`` times in one ``torch.cuda.CUDAGraph``, after ``warmup`` eager
    calls on a side stream; ``out`` is the last captured call's return value (tensors in the graph's memory pool,
    which every ``graph.replay()`` overwrites). The capture does not run ``fn``: replay it.

    The warm-up is PyTorch's documented recipe (``torch.cuda.graphs``): Triton compiles, launcher caches,
    cuBLAS workspaces and lazily built buffers must exist before capture (a capture cannot compile, sync or
    allocate outside its pool), and the calls run on a side stream that waits for the current one (so they see
    its inputs) and that the current one then waits for, so that the capture's side stream starts from
    finished warm-up work; ``torch.cuda.graph`` itself synchronizes the device on entry. ``repeat > 1``
    captures ``repeat`` calls back to back (a kernel's time per call without the host's launch overhead)
    and warms up with single calls."""
    if not callable(fn):
        raise TypeError(f"capture_graph: fn must be callable, got {type(fn).__name__}")
    check_positive_int("capture_graph: warmup", warmup, allow_zero=True)
    check_positive_int("capture_graph: repeat", repeat)
    if not torch.cuda.is_available():
        raise RuntimeError("capture_graph: CUDA graphs need a CUDA device (torch.cuda.is_available() is False)")
    return _graphs.capture(fn, warmup, repeat=repeat)


def host_us_per_call(fn: Callable[[], object], *, calls: int = 1000, warmup: int = 50, repeats: int = 1,
                     device: Optional[torch.device | str] = None) -> float:
    """Host microseconds per call of ``fn``: ``calls`` back-to-back calls after ``warmup`` untimed ones, the best of
    ``repeats`` such runs (a shared machine's noise only adds). On CUDA the device is synchronized before each run
    and inside its window at the end, so queued GPU work counts only where the host would wait for it: give ``fn``
    tiny GPU work (or stubbed launches, :func:`stubbed_launches`) to read the host path alone."""
    if not callable(fn):
        raise TypeError(f"host_us_per_call: fn must be callable, got {type(fn).__name__}")
    check_positive_int("host_us_per_call: calls", calls)
    check_positive_int("host_us_per_call: warmup", warmup, allow_zero=True)
    check_positive_int("host_us_per_call: repeats", repeats)
    cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def _spin_cycles(fn, sets, clock_ghz: float = 2.0) -> int:
    """GPU clock cycles to spin before a timed call: twice the host time of enqueueing one call (measured here,
    the GPU idle), at least 20 µs and at most 5 ms."""
    torch.cuda.synchronize()
    host = []
    for i in range(3):
        t = time.perf_counter()
        fn(*sets[i % len(sets)])
        host.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    return int(min(max(2 * sorted(host)[1], 20e-6), 5e-3) * clock_ghz * 1e9)


def rows_from_tree(script: str | Path, src: str | Path, args: Sequence[str], mark: str, *,
                   timeout: float = 540) -> list:
    """The result rows of ``script`` run with another tree's thrifty, tagged ``tree="baseline"``: old and new code
    timed in one run on one box (boxes drift 5-15 % between runs). ``src`` is that tree's ``src/`` (first on
    PYTHONPATH, so it shadows this tree and an editable install); ``script`` must print its rows as one line
    ``mark + json.dumps(rows)`` when given ``args``. A failed run gives one row holding its stderr's tail."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (os.path.abspath(src), os.environ.get("PYTHONPATH", "")) if p))
    out = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True,
                         timeout=timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith(mark)]
    if out.returncode != 0 or not lines:
        return [{"tree": "baseline", "error": (out.stderr or out.stdout)[-800:]}]
    return [dict(r, tree="baseline") for r in json.loads(lines[-1][len(mark):])]


def peak_memory(fn: Callable, *args, device: Optional[torch.device | str] = None, **kwargs) -> Optional[int]:
    """Peak CUDA bytes allocated while ``fn(*args, **kwargs)`` runs, over the live baseline (its inputs and
    whatever else is already allocated). The output counts as it is allocated during the call.
    Returns None on CPU (the caching allocator statistics exist only for CUDA)."""
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    out = fn(*args, **kwargs)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    del out
    return peak - base


# ---------------------------------------------------------------------------------------- instrumentation
def _kernel_name(launcher) -> str:
    fn = launcher.fn
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", None) or type(fn).__name__


@contextlib.contextmanager
def count_launches(around: Optional[Callable[[str], contextlib.AbstractContextManager]] = None):
    """Counts the kernel launches thrifty makes through its Triton launchers (``triton_utils.FastLauncher``: the
    kernels with a hot host path) inside the block. Yields a ``collections.Counter`` {kernel name: launches},
    filled as they happen. ``around(name)``, when given, returns a context manager entered around each launch (a
    profiler's phase tag, an "inside a kernel" flag: ``benchmarks/bitnet_profile.py`` leaves the Triton
    interpreter's own tensor ops out of its aten op counts with it).

    The launchers keep their own paths (direct, Triton's, the interpreter's), so it counts on the GPU and under
    ``TRITON_INTERPRET=1`` alike; a ``keyed`` launch counts once. Kernels launched as ``kernel[grid](...)`` are not
    seen (on the GPU, Triton's ``knobs.runtime.launch_enter_hook`` sees those). Instrumentation for benchmarks
    and tests, not thread-safe: it replaces the launch methods of the class for the duration of the block."""
    from .triton_utils import FastLauncher

    if around is not None and not callable(around):
        raise TypeError(f"count_launches: around must be callable or None, got {type(around).__name__}")
    counts: collections.Counter = collections.Counter()
    real = {"__call__": FastLauncher.__call__, "keyed": FastLauncher.keyed}
    depth = [0]  # a keyed launch that misses its cache launches through __call__: counted once

    def counted(method):
        def launch(self, *args, **kwargs):
            if depth[0]:
                return method(self, *args, **kwargs)
            name = _kernel_name(self)
            counts[name] += 1
            depth[0] += 1
            try:
                if around is None:
                    return method(self, *args, **kwargs)
                with around(name):
                    return method(self, *args, **kwargs)
            finally:
                depth[0] -= 1
        return launch

    for attr, method in real.items():
        setattr(FastLauncher, attr, counted(method))
    try:
        yield counts
    finally:
        for attr, method in real.items():
            setattr(FastLauncher, attr, method)


class _NoOpKernel:
    """A "compiled kernel" whose launch does nothing (``stubbed_launches``)."""
    function = packed_metadata = None

    def run(self, *args):
        pass


class _StubJit:
    """Stands in for a launcher's ``@triton.jit`` function: ``fn[grid](*args, **kw)`` "compiles" to a no-op."""

    def __init__(self, fn):
        self.arg_names = fn.arg_names
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _NoOpKernel()


@contextlib.contextmanager
def stubbed_launches():
    """The host side of thrifty's kernel calls with the GPU taken out, to time it where there is none
    (``benchmarks/attention_e2e.py``'s host section on the CPU). Inside the block:

    * every ``FastLauncher`` of a loaded thrifty module takes its direct path (the one it takes on the GPU once a
      kernel is compiled: launch key, cache lookup, argument packing) on a stand-in driver, and the kernel it
      "compiles" is a no-op: nothing is computed, outputs stay uninitialized;
    * ``kernels_available`` answers True for every device, so the library's dispatch takes its kernel paths.

    What is left to time: the Python of a call (checks, routing, allocations, launch keys). Not in it: the C
    launcher, the CUDA allocator, the GPU. Import the modules whose kernels the calls reach before entering: a
    launcher made inside the block is not stubbed. Yields the number of launchers stubbed. Launchers (their
    caches too) and the patched names are restored on exit. Instrumentation for benchmarks, not thread-safe."""
    import sys
    import types

    from . import triton_utils as tu

    available = tu.kernels_available
    launchers, bindings = {}, []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "thrifty" or name.startswith("thrifty.")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, tu.FastLauncher):
                launchers[id(value)] = value
            elif value is available:  # a module's own binding of kernels_available (from ..triton_utils import)
                bindings.append((module, attr))
    driver = types.SimpleNamespace(active=types.SimpleNamespace(get_current_device=lambda: 0,
                                                                get_current_stream=lambda device: 0))
    saved = [(lz, lz.fn, lz.interpreted, dict(lz.cache)) for lz in launchers.values()]
    saved_globals = {"_DRIVER": tu._DRIVER, "_direct_launch_allowed": tu._direct_launch_allowed}
    try:
        tu._DRIVER, tu._direct_launch_allowed = driver, lambda: True
        for module, attr in bindings:
            setattr(module, attr, lambda device: True)
        for lz in launchers.values():
            lz.fn, lz.interpreted = _StubJit(lz.fn), False
            lz.cache.clear()
        yield len(launchers)
    finally:
        for lz, fn, interpreted, cache in saved:
            lz.fn, lz.interpreted = fn, interpreted
            lz.cache.clear()
            lz.cache.update(cache)
        for module, attr in bindings:
            setattr(module, attr, available)
        for attr, value in saved_globals.items():
            setattr(tu, attr, value)


# --------------------------------------------------------------------------------------------------- schema
class RandomTokens:
    """Stands in for a ``TokenDataset`` in step timings: uniform random ids (the time does not depend on the text,
    so no corpus has to travel to the GPU box)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def batch(self, batch_size, seq_len, generator=None):
        ids = torch.randint(0, self.vocab_size, (batch_size, seq_len + 1), generator=generator)
        return ids[:, :-1], ids[:, 1:]


def default_results_dir() -> Path:
    """``$THRIFTY_RESULTS``, else ``<checkout>/benchmarks/results``, else ``./benchmarks/results``."""
    env = os.environ.get("THRIFTY_RESULTS")
    if env:
        return Path(env)
    root = repo_root()
    return (root if root is not None else Path.cwd()) / "benchmarks" / "results"


def _jsonable(x):
    """Plain JSON: tensors and numpy scalars to Python numbers, NaN/inf to None, dtypes/paths to strings."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _jsonable(x.item() if x.numel() == 1 else x.tolist())
    if hasattr(x, "item") and hasattr(x, "dtype"):  # numpy scalar
        return _jsonable(x.item())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return str(x)


def _check_name(kind: str, value: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{kind}: expected a str, got {type(value).__name__}")
    if not _NAME_RE.match(value):
        raise ValueError(f"{kind}: expected letters, digits, '_', '-', '.' (used in a file name), got {value!r}")


def _check_rows(rows) -> list:
    if isinstance(rows, dict) or not isinstance(rows, (list, tuple)):
        raise TypeError(f"rows: expected a list of dicts, got {type(rows).__name__}")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise TypeError(f"rows[{i}]: expected a dict, got {type(r).__name__}")
    return list(rows)


def write_result(
    name: str,
    rows: Sequence[dict],
    summary: dict,
    *,
    device: Optional[str] = None,
    extra: Optional[dict] = None,
    results_dir: Optional[str | Path] = None,
    plot: Optional[dict] = None,
) -> Path:
    """Writes ``<results_dir>/<name>_<device>.json``; returns its path.

    rows: one dict per measurement (an error row carries an ``"error"`` string instead of numbers).
    summary: headline numbers, flat ``{key: number}`` with the unit in the key (``bf16_matmul_tflops``).
    device: tag in the file name; default ``detect_device()``.
    results_dir: default ``default_results_dir()``.
    extra: anything else worth keeping (settings, clocks, notes).
    plot: when given, ``plot_rows(rows, **plot)`` writes ``<name>_<device>.png`` beside the JSON.
    """
    _check_name("name", name)
    rows = _check_rows(rows)
    if not isinstance(summary, dict):
        raise TypeError(f"summary: expected a dict, got {type(summary).__name__}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra: expected a dict or None, got {type(extra).__name__}")
    device = device or detect_device()
    _check_name("device", device)
    out_dir = Path(results_dir) if results_dir is not None else default_results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema": SCHEMA_VERSION,
        "name": name,
        "device": device,
        "meta": env_info(device),
        "summary": summary,
        "rows": rows,
        "extra": extra or {},
    }
    path = out_dir / f"{name}_{device}.json"
    path.write_text(json.dumps(_jsonable(doc), indent=1) + "\n")
    if plot is not None:
        plot_rows(rows, path=path.with_suffix(".png"), **plot)
    return path


def read_result(path: str | Path) -> dict:
    """Loads a result file and checks that the schema's keys are there."""
    doc = json.loads(Path(path).read_text())
    missing = [k for k in REQUIRED_KEYS if k not in doc]
    if missing:
        raise ValueError(f"{path}: not a thrifty result, missing keys {missing}")
    return doc


# ------------------------------------------------------------------------------------------- table and plot
def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        a = abs(v)
        return f"{v:.3g}" if (a and (a < 1e-2 or a >= 1e6)) else (f"{v:.1f}" if a >= 100 else f"{v:.4g}")
    return str(v)


def format_table(rows: Sequence[dict], columns: Optional[Sequence[str]] = None, *, max_width: int = 60) -> str:
    """Aligned text table; ``columns`` default to every key in order of first appearance; cells longer than
    ``max_width`` characters (error messages) are cut."""
    rows = _check_rows(rows)
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    elif isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
        raise TypeError("columns: expected a list of column names (str)")
    check_positive_int("max_width", max_width)
    cut = lambda t: t if len(t) <= max_width else t[: max_width - 3] + "..."
    cells = [[cut(_fmt(r.get(c))) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[j]) for row in cells]) for j, c in enumerate(columns)]
    num = [all(_is_num(r.get(c)) for r in rows if r.get(c) is not None) for c in columns]
    line = lambda vals: "  ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(vals, widths, num)).rstrip()
    out = [line(list(columns)), line(["-" * w for w in widths])] + [line(row) for row in cells]
    return "\n".join(out)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def print_table(rows: Sequence[dict], columns: Optional[Sequence[str]] = None, *, max_width: int = 60) -> str:
    """Prints ``format_table(rows, columns)`` and returns it."""
    text = format_table(rows, columns, max_width=max_width)
    print(text, flush=True)
    return text


def plot_rows(
    rows: Sequence[dict],
    *,
    x: str,
    y: str,
    path: str | Path,
    hue: Optional[str] = None,
    title: Optional[str] = None,
    logy: bool = False,
    kind: str = "bar",
    ylabel: Optional[str] = None,
    annotate: bool = True,
) -> Path:
    """Grouped bars (``kind="bar"``) or lines (``"line"``) of ``y`` against ``x``, one series per ``hue`` value.

    Rows whose ``y`` is missing or not a number (error rows) are left out. x values keep their first-seen
    order (bars) or are sorted (lines, numeric x). Writes a PNG at ``path`` and returns it.
    """
    rows = _check_rows(rows)
    check_choice("kind", kind, ("bar", "line"))
    for arg, val in (("x", x), ("y", y)):
        if not isinstance(val, str):
            raise TypeError(f"{arg}: expected a column name (str), got {type(val).__name__}")
    good = [r for r in rows if _is_num(r.get(y)) and math.isfinite(r[y]) and x in r]
    if not good:
        raise ValueError(f"plot_rows: no row has both {x!r} and a numeric {y!r}")

    import matplotlib

    matplotlib.use("Agg")  # headless: the GPU box and CI have no display
    import matplotlib.pyplot as plt

    series = list(dict.fromkeys(r.get(hue) for r in good)) if hue else [None]
    xs = list(dict.fromkeys(r[x] for r in good))
    fig, ax = plt.subplots(figsize=(max(7.5, 0.9 * len(xs) * max(1, len(series)) ** 0.5 + 3), 4.5), dpi=120)
    if kind == "bar":
        width = 0.8 / len(series)
        for i, s in enumerate(series):
            pts = {r[x]: r[y] for r in good if not hue or r.get(hue) == s}
            pos = [j + (i - (len(series) - 1) / 2) * width for j, xv in enumerate(xs) if xv in pts]
            vals = [pts[xv] for xv in xs if xv in pts]
            bars = ax.bar(pos, vals, width, label=None if s is None else str(s))
            if annotate and len(xs) * len(series) <= 40:
                ax.bar_label(bars, fmt="%.0f" if max(vals) >= 100 else "%.3g", fontsize=7, rotation=90, padding=2)
        ax.set_xticks(range(len(xs)), [str(v) for v in xs], rotation=30 if len(xs) > 6 else 0, ha="right" if len(xs) > 6 else "center")
        ax.margins(y=0.15)
    else:
        for s in series:
            pts = sorted(((r[x], r[y]) for r in good if not hue or r.get(hue) == s), key=lambda p: p[0])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=None if s is None else str(s))
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel or y)
    if title:
        ax.set_title(title, fontsize=10)
    if hue:
        ax.legend(title=hue, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = [
    "Timing", "time_fn", "capture_graph", "peak_memory", "detect_device", "env_info", "git_commit", "default_results_dir",
    "write_result", "read_result", "format_table", "print_table", "plot_rows", "SCHEMA_VERSION", "REQUIRED_KEYS",
    "RandomTokens", "rows_from_tree", "count_launches", "stubbed_launches", "host_us_per_call",
]
