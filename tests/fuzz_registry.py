"""The fuzz suite's registry: what a technique declares so that ``tests/test_fuzz.py`` fuzzes it.

Adding a technique is a new file ``tests/fuzz_specs_<technique>.py`` (found automatically) with a list ``SPECS``
of the three kinds below, e.g. for a quantizer ``quantize(x, bits=2)`` with a float64 reference ``ref``::

    import torch
    from hypothesis import strategies as st
    from fuzz_registry import ArgSpec, NumericSpec, tensors, assert_matches
    from thrifty.bitnet import quantize, reference as ref

    SPECS = [
        ArgSpec("bitnet.quantize", quantize, valid=lambda: dict(x=torch.randn(4, 8), bits=2),
                bad={"bits": [0, 3, 2.0, None], "x": [torch.zeros(4, dtype=torch.int64), [1.0]]}),
        NumericSpec("bitnet.quantize", inputs=st.fixed_dictionaries({"x": tensors((3, 5))}),
                    run=lambda a: quantize(**a), check=lambda a, out: assert_matches(out, ref.quantize(a["x"].double()))),
    ]

* :class:`ArgSpec`: every bad value must raise ValueError/TypeError whose message names the argument.
* :class:`NumericSpec`: random valid inputs (special values, odd shapes and strides included, as the spec's
  strategy draws them) must give what ``check`` asserts: the float64 / bit-exact reference, NaN where NaN goes in.
* :class:`FileSpec`: what ``write`` writes, ``read`` returns unchanged; after truncation, flipped bytes or
  appended garbage, ``read`` raises ValueError or returns the same content (never other content, never
  another exception).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
from hypothesis import strategies as st

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class ArgSpec:
    """``call(**valid())`` works; ``call(**{**valid(), arg: bad})`` raises a clear error for every bad value."""

    name: str
    call: Callable[..., Any]
    valid: Callable[[], dict]
    bad: dict  # argument name -> list of bad values
    mention: dict = field(default_factory=dict)  # argument -> text the message must hold (default: its name)


@dataclass
class NumericSpec:
    """``check(inputs, run(inputs))`` holds for every ``inputs`` drawn from the strategy."""

    name: str
    inputs: st.SearchStrategy
    run: Callable[[dict], Any]
    check: Callable[[dict, Any], None]
    max_examples: Optional[int] = None  # fewer for slow paths (the Triton interpreter); None: the profile's


@dataclass
class FileSpec:
    """Round trip and damage: ``read(write(obj))`` is ``obj``; a damaged file is refused or read unchanged."""

    name: str
    objects: st.SearchStrategy
    write: Callable[[Any, Any], None]  # write(obj, path)
    read: Callable[[Any], Any]  # read(path)
    same: Callable[[Any, Any], bool]
    errors: tuple = (ValueError,)  # what a damaged file may raise
    max_examples: Optional[int] = None
    # the files under ``path`` the damage test may change (default: all). Leave out only files that are
    # hand-editable by design (no checksum), e.g. a HF config.json, and say so.
    targets: Optional[Callable[[Any], list]] = None


# ------------------------------------------------------------------------------------------------- strategies
def special_values(dtype: torch.dtype) -> list:
    """NaN, ±inf, ±0, the smallest subnormal and normal, the largest finite value of ``dtype``."""
    info = torch.finfo(dtype)
    return [math.nan, math.inf, -math.inf, -0.0, 0.0, info.smallest_normal * info.eps, info.smallest_normal,
            -info.tiny, info.max, -info.max]


@st.composite
def tensors(draw, shape, dtype=torch.float32, *, specials: bool = True, scale: float = 1.0,
            strided: bool = True, allowed_specials: Optional[list] = None):
    """A float tensor of ``shape`` (a tuple or a strategy of tuples): N(0, scale) values, with special values at
    random places when ``specials``, and a non-contiguous view of the same values when ``strided`` draws so."""
    if isinstance(shape, st.SearchStrategy):
        shape = draw(shape)
    dtype = draw(dtype) if isinstance(dtype, st.SearchStrategy) else dtype
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    n = x.numel()
    if specials and n and draw(st.booleans()):
        pool = allowed_specials if allowed_specials is not None else special_values(dtype)
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, n - 1))
            x.view(-1)[i] = draw(st.sampled_from(pool))
    if strided and x.ndim >= 2 and draw(st.booleans()):
        # the same values, laid out transposed in memory: a non-contiguous view
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    return x


def raw_bits(dtype: torch.dtype, shape) -> st.SearchStrategy:
    """A tensor of ``dtype`` from arbitrary bit patterns (every NaN payload, subnormal, ±0, ±inf)."""
    itype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty((), dtype=dtype).element_size()]
    bits = torch.iinfo(itype).bits
    n = math.prod(shape)
    return st.lists(st.integers(0, 2**bits - 1), min_size=n, max_size=n).map(
        lambda v: torch.tensor(np.array(v, dtype=f"<u{bits // 8}").view(f"<i{bits // 8}") if bits > 8
                               else np.array(v, dtype=np.uint8)).view(dtype).reshape(shape))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of two tensors (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def assert_matches(out: torch.Tensor, ref: torch.Tensor, *, rtol: float, atol: float, where=None) -> None:
    """``out`` matches the float64 ``ref``: NaN exactly where ``ref`` is NaN, the same infinities, finite values
    within ``atol + rtol·|ref|`` (only at ``where``, a bool mask, when given)."""
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    if where is not None:
        out, ref = out[where], ref[where]
    assert torch.equal(out.isnan(), ref.isnan()), "NaN where the reference has none, or a NaN lost"
    inf = ref.isinf()
    assert torch.equal(out[inf], ref[inf]) and not out[~inf & ~ref.isnan()].isinf().any(), "infinities differ"
    fin = ref.isfinite()
    err = (out[fin] - ref[fin]).abs()
    tol = atol + rtol * ref[fin].abs()
    assert bool((err <= tol).all()), f"max error {float((err - tol).max()):.3g} over the tolerance"
