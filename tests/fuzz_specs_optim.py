"""Fuzz specs of the LOMO optimizer (thrifty.optim: LomoConfig, lomo on a plain model) and the 8-bit
optimizer-state quantizer against float64. See tests/fuzz_registry.py."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from fuzz_registry import ArgSpec, NumericSpec
from thrifty.optim import LomoConfig, lomo, state8

NAN, INF = math.nan, math.inf


def _model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


LOMO_CONFIG_ARGS = ArgSpec(
    "optim.LomoConfig", LomoConfig, valid=dict,
    bad={"optimizer": ["adam2", None], "lr": [NAN, INF, -INF, 0.0, -1.0, "1e-3", 11.0],
         "betas": [(NAN, 0.9), (0.9, INF), (0.9,), (1.0, 0.9), (0.9, -0.1), "ab", None],
         "eps": [NAN, INF, 0.0, -1e-8], "weight_decay": [NAN, INF, -1.0], "state_dtype": [torch.uint8, torch.float16, "int4", "fp32", None],
         "state_block": [0, -256, 100, 8, 8192, 256.0, NAN, True, None],  # torch.int8 is valid: 8-bit states
         "impl": ["cuda", "torch", 3, None]},  # "torch" was the old word for "reference"
    mention={"betas": "betas"})

LOMO_ARGS = ArgSpec(
    "optim.lomo", lomo, valid=lambda: dict(model=_model(), config=LomoConfig()),
    bad={"model": [3, None], "config": [3, 0, "adamw", dict(lr=1e-3)]})


# ------------------------------------------------------------------------------ 8-bit optimizer states
@st.composite
def _state8_inputs(draw):
    n = draw(st.integers(1, 700))
    block = draw(st.sampled_from([16, 64, 256]))
    signed = draw(st.booleans())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    spread = draw(st.sampled_from([0.0, 1.0, 6.0]))  # log-scale spread of magnitudes inside a block
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp(spread * torch.randn(n, generator=g,
                                                                                           dtype=torch.float64))
    x = x * 10.0 ** draw(st.integers(-20, 10))
    if not signed:
        x = x.abs()
    if draw(st.booleans()):  # exact zeros (an all-zero block when they run long)
        x[: draw(st.integers(0, n))] = 0.0
    return dict(x=x, block=block, signed=signed)


def _check_state8(a, y):
    """Against float64: relative error bound inside the code's range; below it, 0 or the smallest level
    (signed) / rounded up, never to 0 (unsigned)."""
    x, block, signed = a["x"], a["block"], a["signed"]
    y = y.double()
    n = x.numel()
    absmax = torch.cat([x, x.new_zeros(-n % block)]).view(-1, block).abs().amax(1).repeat_interleave(block)[:n]
    absmax32 = absmax.float().double()  # the stored scale
    low = state8.smallest_level(signed)
    inside = x.abs() >= low * absmax
    bound = state8.relative_error_bound(signed) + 1e-6
    assert ((y - x).abs()[inside] <= bound * x.abs()[inside]).all()
    assert (y[~inside].abs() <= low * absmax32[~inside] * (1 + bound)).all()
    assert ((y > 0) == (x > 0)).all() if not signed else (y * x >= 0).all()


STATE8_ROUND_TRIP = NumericSpec(
    "optim.state8.round_trip", _state8_inputs(),
    lambda a: state8.dequantize(*state8.quantize(a["x"], a["block"], a["signed"]), a["block"]), _check_state8)


SPECS = [LOMO_CONFIG_ARGS, LOMO_ARGS, STATE8_ROUND_TRIP]
