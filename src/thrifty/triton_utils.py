"""Helpers every thrifty Triton kernel uses, so that one kernel source runs on the GPU and, at small sizes,
under the Triton interpreter on the CPU (``TRITON_INTERPRET=1``, how CI checks kernels).

Interpreter pitfall handled here: a ``tl.dot`` on bfloat16 operands returns garbage in the interpreter
(numpy has no bfloat16), while fp32/fp16/int8/fp8 are exact. Kernels call :func:`mma` instead of
``tl.dot``; under the interpreter it upcasts bfloat16 operands to float32, which is exact (every bf16 value
is an fp32 value) and matches what the tensor cores compute (bf16 products, fp32 accumulation).

The interpreter is chosen when ``triton.jit`` runs, i.e. when a kernel module is imported: set
``TRITON_INTERPRET=1`` before importing thrifty's kernels (``tests/conftest.py`` does so on CPU machines).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a hard dependency, but keep imports cheap to diagnose
    HAVE_TRITON = False


LOG2E = 1.4426950408889634  # kernels run their softmax in base 2: exp(x) = 2^(x·log2 e)


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_SM_COUNTS: dict = {}  # what sm_count was passed -> its count


def sm_count(device: torch.device | str | int | None) -> int:
    """Streaming multiprocessors of ``device`` (a CUDA device, its index, or None/a CPU device), for the launch
    grids sized in waves. The CPU/interpreter gets 132, the H100 SXM's count, so that the interpreter exercises
    the splits the GPU would take. ``torch.device("cuda")`` without an index means the current device.

    Cheap on hot paths: after the first call with a given argument it is one dict lookup, cheaper
    than the ``device.type`` test alone that the inline versions made before ``get_device_properties`` (which
    torch caches per device, but behind a lazy-init check and a C call)."""
    n = _SM_COUNTS.get(device)
    if n is not None:
        return n
    index = device
    if isinstance(device, (str, torch.device)):
        d = torch.device(device)
        index = d.index if d.type == "cuda" else None
        if d.type == "cuda" and index is None and torch.cuda.is_available():
            return sm_count(torch.cuda.current_device())  # the current device: resolved per call, not cached
    if index is None or not torch.cuda.is_available():
        n = 132  # the H100's count: the interpreter exercises the GPU's splits
    else:
        n = torch.cuda.get_device_properties(index).multi_processor_count
    _SM_COUNTS[device] = n
    return n


_CAPABILITY: dict = {}  # CUDA device index -> (major, minor): kernel routes read it per call


def capability(device: torch.device) -> tuple:
    """(major, minor) of a CUDA device (the current one when it has no index); one dict lookup after the first."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def kernels_available(device: torch.device | str) -> bool:
    """True when a Triton kernel can run on tensors of ``device``: CUDA, or any device under the interpreter."""
    if not HAVE_TRITON:
        return False
    device = torch.device(device)
    return device.type == "cuda" or (interpreting() and device.type == "cpu")


if HAVE_TRITON:
    if interpreting():

        @triton.jit
        def mma(a, b, acc):
            """``acc + a @ b`` with fp32 accumulation; bf16 upcast because the interpreter's bf16 dot is wrong."""
            if a.dtype == tl.bfloat16:
                a = a.to(tl.float32)
            if b.dtype == tl.bfloat16:
                b = b.to(tl.float32)
            return tl.dot(a, b, acc)

    else:

        @triton.jit
        def mma(a, b, acc):
            """``acc + a @ b`` with fp32 accumulation on the tensor cores."""
            return tl.dot(a, b, acc)

    @triton.jit
    def finite_or_zero(x):
        """NaN and ±inf → 0: kernels that promise "NaN in -> NaN out" per row compute every row as if the bad
        elements were zeros (so they reach no statistic, scale or other row) and mark the rows that see one."""
        return tl.where(tl.abs(x) < float("inf"), x, 0.0)


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ in plain Python: ``triton.cdiv`` is a JITFunction, and calling one from the host goes through
    Triton's binder (~15 µs each; five per attention call were a quarter of the host path)."""
    return -(-a // b)


def launch_with(launcher, sig, grid, *args, **kw):
    """``launcher(grid, ...)``, or its :meth:`FastLauncher.keyed` launch when the caller has a signature of
    the call (see ``attention.sage.sage_forward_triton``)."""
    if sig is None:
        return launcher(grid, *args, **kw)
    return launcher.keyed(sig, grid, *args, **kw)


class FastLauncher:
    """Launches a ``@triton.jit`` kernel with less host overhead than ``kernel[grid](...)``.

    Triton's launch path binds every argument, computes its specialization and looks the compiled kernel
    up on each call (~30 µs for a 40-argument kernel, measured on the H100 box): at short sequences that is
    longer than the attention itself. Here the first call with a given specialization key goes through
    Triton (which compiles and launches) and keeps the compiled kernel; later calls with the same key launch
    it directly. The key holds what Triton specializes on: tensor dtypes and 16-byte alignment, integers'
    ==1 / divisible-by-16 / 32-bit range, every constexpr and the launch options. Runtime arguments must
    come before the constexprs in the kernel's signature, constexprs are passed by keyword. Under the
    interpreter, with launch hooks set (profilers), or with THRIFTY_FAST_LAUNCH=0, Triton's own path runs.
    """

    def __init__(self, fn):
        self.fn = fn
        self.cache: dict = {}
        self.names = list(fn.arg_names)
        self.interpreted = interpreting()  # fixed when ``fn`` was jitted (at import), like the kernel itself

    @staticmethod
    def _spec(a):
        """What Triton specializes an argument on. Exact type checks first: this runs ~20 times per launch."""
        t = type(a)
        if t is int:
            return (a == 1, a % 16 == 0, -(2 ** 31) <= a < 2 ** 31)
        if t is torch.Tensor or isinstance(a, torch.Tensor):
            return (a.dtype, a.data_ptr() % 16 == 0)
        if t is bool:
            return ("b", a)
        return (t,)

    def __call__(self, grid, *args, num_warps: int, num_stages: int | None, launch_pdl: bool = False,
                 **constexprs):
        if self.interpreted or not _direct_launch_allowed():
            return self.fn[grid](*args, **constexprs, **_options(num_warps, num_stages, launch_pdl))
        driver = _DRIVER or _load_driver()
        device = driver.active.get_current_device()
        key = (device, num_warps, num_stages, launch_pdl, tuple(constexprs.items()), tuple(map(self._spec, args)))
        hit = self.cache.get(key)
        if hit is None:
            kernel = self.fn[grid](*args, **constexprs, **_options(num_warps, num_stages, launch_pdl))
            if len(self.cache) < 256:  # the constexprs, in signature order, follow the runtime arguments
                self.cache[key] = (kernel, tuple(constexprs[n] for n in self.names[len(args):]))
            return kernel
        kernel, tail = hit
        grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        kernel.run(*grid3, driver.active.get_current_stream(device), kernel.function, kernel.packed_metadata,
                   None, None, None, *args, *tail)
        return kernel


    def keyed(self, sig, grid, *args, num_warps: int, num_stages: int | None, **constexprs):
        """Like a call, with the caller's ``sig`` standing in for the per-argument specialization key (about
        1 µs per argument, 60 per attention call). ``sig`` must determine everything Triton specializes on:
        callers build it from shapes, strides, dtypes and the 16-byte alignment of the tensors they did not
        allocate themselves (fresh allocations from PyTorch's caching allocator are always aligned), plus the
        flags that select constexprs. The first call with a ``sig`` goes through :meth:`__call__`. The only way to
        launch a kernel taking TMA descriptors fast (``_spec`` sees a descriptor's type only, not its block shape
        and layout, so the ``sig`` must determine them)."""
        if self.interpreted or not _direct_launch_allowed():
            return self.fn[grid](*args, **constexprs, **_options(num_warps, num_stages))
        driver = _DRIVER or _load_driver()
        device = driver.active.get_current_device()
        hit = self.cache.get(("sig", device, sig))
        if hit is None:
            kernel = self(grid, *args, num_warps=num_warps, num_stages=num_stages, **constexprs)
            if len(self.cache) < 256:
                self.cache[("sig", device, sig)] = (kernel, tuple(constexprs[n] for n in self.names[len(args):]))
            return kernel
        kernel, tail = hit
        grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        kernel.run(*grid3, driver.active.get_current_stream(device), kernel.function, kernel.packed_metadata,
                   None, None, None, *args, *tail)
        return kernel


def _options(num_warps: int, num_stages: int | None, launch_pdl: bool = False) -> dict:
    """Launch options; ``num_stages=None`` leaves Triton's default (Gluon kernels pipeline by hand).
    ``launch_pdl``: programmatic dependent launch (sm_90): the kernel may start before the one ahead of it in the
    stream has finished, and must wait for it (``gdc_wait``) before reading what it wrote."""
    opts = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps, num_stages=num_stages)
    if launch_pdl:
        opts["launch_pdl"] = True
    return opts


_DRIVER = None  # triton.runtime.driver.driver, looked up once: an import statement per launch costs ~2 µs


def _load_driver():
    global _DRIVER
    from triton.runtime.driver import driver
    _DRIVER = driver
    return driver


def fast_launch_enabled() -> bool:
    """FastLauncher's direct launches: off under the interpreter, with Triton launch hooks
    set (profilers expect them to run) or with THRIFTY_FAST_LAUNCH=0."""
    return not interpreting() and _direct_launch_allowed()


# os.environ.get of a variable that is not set costs ~6 µs (a KeyError raised and caught inside the Mapping):
# more than a whole launch. The bytes dict behind os.environ (POSIX) answers the same question in 0.1 µs and
# sees every change made through os.environ (monkeypatch.setenv included).
_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None


def _fast_launch_switched_off() -> bool:
    if _ENV_BYTES is not None:
        return _ENV_BYTES.get(b"THRIFTY_FAST_LAUNCH") == b"0"
    return os.environ.get("THRIFTY_FAST_LAUNCH", "1") == "0"


def _direct_launch_allowed() -> bool:
    """No THRIFTY_FAST_LAUNCH=0 and no Triton launch hook (the per-launch part of the check)."""
    if _fast_launch_switched_off():
        return False
    from triton import knobs

    return not (_hook_set(knobs.runtime.launch_enter_hook) or _hook_set(knobs.runtime.launch_exit_hook))


def _hook_set(hook) -> bool:
    """Triton 3.6 keeps its launch hooks in a ``HookChain`` that is never None, empty by default (comparing
    it with None, as thrifty first did, turned every fast launch off on the GPU box without a sign)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True
