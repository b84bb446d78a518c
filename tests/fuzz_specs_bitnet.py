"""Fuzz specs of BitNet (thrifty.bitnet): the activation quantizers against float64 formulas written here
independently of ``thrifty.bitnet.reference`` (special values, all-zero and empty rows, odd sizes, three dtypes),
the fused Triton quantizer bit for bit against the reference (interpreter, small sizes), and the bad arguments of
BitLinear, BitNetConfig, convert, set_strength, TwoStageSchedule and build_for_pretraining.
See tests/fuzz_registry.py for what each kind asserts."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from hypothesis import strategies as st

from fuzz_registry import FLOAT_DTYPES, ArgSpec, NumericSpec, assert_matches, special_values, tensors
from thrifty.bitnet import (BitLinear, BitNetConfig, TwoStageSchedule, build_for_pretraining, convert,
                            linear_factory, mlp_activation, set_strength)
from thrifty.bitnet import reference as R
from thrifty.bitnet.quant_kernel import quantize_rows

NAN, INF = math.nan, math.inf
EPS = 1e-5
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


# --------------------------------------------------------------------------------- float64 formulas (the spec)
def _round_clip(u, lo, hi):
    return torch.round(u).clamp(lo, hi)


def _nearest_e2m1(u):
    """Nearest E2M1 magnitude (ties to the even mantissa: the grid value whose index is even), sign kept."""
    a = u.abs().clamp(max=6.0)
    d = (a[..., None] - E2M1).abs()
    best = d.min(-1, keepdim=True).values
    cand = (d == best)
    # two candidates only at an exact tie: take the one with the even mantissa (0, 1, 2, 4 / 0.5→0, 1.5→2 ...)
    even = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0], dtype=torch.bool)  # 0, 1, 2, 4 have mantissa 0
    pick = torch.where(cand.sum(-1, keepdim=True) > 1, cand & even, cand)
    mag = (pick.double() * E2M1).sum(-1) / pick.sum(-1).clamp_min(1)
    return torch.copysign(mag, u)


def _keep_topk(x, ratio):
    """Exactly ceil(ratio·D) (at least 1) entries of largest |x| per row, ties in index order."""
    D = x.shape[-1]
    k = max(1, math.ceil(ratio * D - 1e-9))
    order = torch.sort(-x.abs().nan_to_num(nan=INF), dim=-1, stable=True).indices[..., :k]
    mask = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, order, True)
    return torch.where(mask, x, torch.zeros_like(x))


def quantize64(x, kind, *, beta_scale=1.0, topk_ratio=0.5, nudge=0.0):
    """The quantizer in float64; ``nudge`` scales the pre-rounding value by (1 + nudge) to find what a rounding
    tie may legitimately round to in fp32."""
    x = x.double()
    if kind == "topk_int8":
        x, kind = _keep_topk(x, topk_ratio), "int8"
    if kind == "int8":
        g = x.abs().amax(-1, keepdim=True)
        y = _round_clip(x * 127.0 / (g + EPS) * (1 + nudge), -128, 127) * g / 127.0
    elif kind == "int4":
        b = x.abs().mean(-1, keepdim=True) * beta_scale
        y = _round_clip(x * math.sqrt(7) / (b + EPS) * (1 + nudge), -8, 7) * b / math.sqrt(7)
    else:  # fp4
        g = x.abs().amax(-1, keepdim=True)
        y = _nearest_e2m1(x * 6.0 / (g + EPS) * (1 + nudge)) * g / 6.0
    bad = (~torch.isfinite(x)).any(-1, keepdim=True)
    return torch.where(bad, torch.full_like(y, NAN), y)


def _check_quantizer(a, out):
    x = a["x"]
    assert out.shape == x.shape and out.dtype == x.dtype
    kw = dict(beta_scale=a["beta_scale"], topk_ratio=a["topk_ratio"])
    if x.shape[-1] == 0:
        return
    bad = (~torch.isfinite(x)).any(-1, keepdim=True).expand_as(x)
    assert out[bad].isnan().all(), "a token holding NaN/inf is not all NaN"
    assert out[~bad].isfinite().all(), "NaN/inf in a finite token"
    rtol = {torch.float32: 2e-6, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[x.dtype]
    # fp32 arithmetic may land either side of a rounding tie: the value of one of the three nudged formulas
    ok = torch.zeros_like(x, dtype=torch.bool)
    for nudge in (0.0, -2e-6, 2e-6):
        ref = quantize64(x, a["kind"], nudge=nudge, **kw)
        ok |= ((out.double() - ref).abs() <= rtol * ref.abs() + 1e-30) | bad
    assert bool(ok.all()), f"{a['kind']}: {int((~ok).sum())} values differ from the float64 formula"


_KIND_FN = {"int8": lambda x, bs, r: R.quantize_int8(x), "int4": lambda x, bs, r: R.quantize_int4(x, bs),
            "fp4": lambda x, bs, r: R.quantize_fp4(x), "topk_int8": lambda x, bs, r: R.quantize_topk_int8(x, r)}


@st.composite
def quantizer_inputs(draw, kinds=("int8", "int4", "fp4", "topk_int8"), max_d=40, dtypes=FLOAT_DTYPES):
    kind = draw(st.sampled_from(kinds))
    dtype = draw(st.sampled_from(dtypes))
    shape = (draw(st.integers(0, 4)), draw(st.sampled_from([0, 1, 2, 3, 7, 16, 33, max_d])))
    # ±max of fp32 is left out (documented in thrifty.bitnet.reference): INT4's mean|x| overflows, and the fp32
    # rescale q·(γ/127) of a token holding it may round past the largest float to ±inf
    pool = [v for v in special_values(dtype) if not (dtype == torch.float32 and abs(v) == torch.finfo(dtype).max)]
    x = draw(tensors(shape, dtype, allowed_specials=pool, scale=draw(st.sampled_from([1.0, 1e-3, 100.0]))))
    if x.numel() and draw(st.integers(0, 4)) == 0:
        x[draw(st.integers(0, x.shape[0] - 1))] = 0.0  # an all-zero token
    if x.numel() and draw(st.integers(0, 4)) == 0:  # ties: repeated magnitudes (TopK's index order)
        x = x.abs().clamp(max=1.0).round() * torch.sign(x)
    return dict(x=x, kind=kind, beta_scale=draw(st.sampled_from([1.0, 2.0, 0.5])),
                topk_ratio=draw(st.sampled_from([0.5, 0.25, 0.01, 1.0, 0.3])))


QUANTIZERS = NumericSpec(
    "bitnet.quantizers", quantizer_inputs(),
    lambda a: _KIND_FN[a["kind"]](a["x"], a["beta_scale"], a["topk_ratio"]), _check_quantizer, max_examples=60)


def _check_fused(a, out):
    """fp32 INT8/TopK: bit for bit the reference. INT4 sums the mean in another order, so a code may move at an
    exact half: checked against the tie-tolerant float64 formula. bf16: the interpreter's fp32→bf16 store
    truncates (the GPU rounds to nearest), so one bf16 ulp (see loss/NOTES.md)."""
    ref = R.quantize_activation(a["x"], a["kind"], beta_scale=a["beta_scale"], topk_ratio=a["topk_ratio"])
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if a["x"].dtype == torch.bfloat16:
        assert_matches(out, ref, rtol=2 ** -7, atol=0.0)
    elif a["kind"] == "int4":
        _check_quantizer(a, out)
    else:
        assert_matches(out, ref, rtol=0.0, atol=0.0)  # NaN rows included


FUSED = NumericSpec(
    "bitnet.quantize_rows.triton",
    quantizer_inputs(kinds=("int8", "int4", "topk_int8"), max_d=24, dtypes=(torch.float32, torch.bfloat16)),
    lambda a: quantize_rows(a["x"], a["kind"], beta_scale=a["beta_scale"], topk_ratio=a["topk_ratio"]),
    _check_fused, max_examples=10)


def _check_weight(a, out):
    w = a["w"].double()
    alpha = w.abs().mean()
    ref = alpha * _round_clip(w / (alpha + EPS), -1, 1)
    if not torch.isfinite(w).all():
        assert out.isnan().all(), "a weight with NaN/inf does not quantize to NaN"
        return
    ok = torch.zeros_like(w, dtype=torch.bool)
    for nudge in (0.0, -2e-6, 2e-6):
        r = alpha * _round_clip(w / (alpha + EPS) * (1 + nudge), -1, 1)
        ok |= (out.double() - r).abs() <= 2e-6 * r.abs() + 1e-30
    assert bool(ok.all()) and out.shape == ref.shape


WEIGHT = NumericSpec(
    "bitnet.quantize_weight_ternary",
    st.fixed_dictionaries({"w": tensors(st.tuples(st.integers(1, 5), st.integers(1, 9)),
                                        allowed_specials=[NAN, INF, -0.0, 1e-45, 1e-38])}),
    lambda a: R.quantize_weight_ternary(a["w"]), _check_weight)


def _bitlinear_rows(a):
    m = BitLinear(a["x"].shape[-1], 3, activation=a["activation"], sub_norm=a["sub_norm"])
    return m(a["x"])


def _check_bitlinear_rows(a, out):
    bad = (~torch.isfinite(a["x"])).any(-1)
    assert out.shape == (*a["x"].shape[:-1], 3)
    assert out[bad].isnan().all() and out[~bad].isfinite().all(), "NaN rows of BitLinear do not follow the input"


BITLINEAR_ROWS = NumericSpec(
    "bitnet.BitLinear.nan_rows",
    st.fixed_dictionaries({"x": tensors(st.tuples(st.integers(0, 3), st.integers(1, 9)),
                                        allowed_specials=[NAN, INF, -INF, -0.0, 1e-45]),
                           "activation": st.sampled_from(["int8", "int4", "fp4", "topk_int8"]),
                           "sub_norm": st.booleans()}),
    _bitlinear_rows, _check_bitlinear_rows, max_examples=15)


# ------------------------------------------------------------------------------------------------ arguments
def _int_args():
    return [0, -1, 2.0, True, None, "4"]


BITLINEAR_ARGS = ArgSpec(
    "bitnet.BitLinear", BitLinear, valid=lambda: dict(in_features=5, out_features=6),
    bad={"in_features": _int_args(), "out_features": _int_args(),
         "activation": ["int2", None, 8], "bias": ["yes", 1, None], "sub_norm": ["yes", 0, None],
         "norm_eps": [NAN, INF, 0.0, -1e-5, "1e-5", None], "weight_splits": [[2, 2], [3, 3.0], [6, 0], 3, "ab"],
         "beta_scale": [NAN, INF, 0.0, -1.0, None], "topk_ratio": [NAN, 0.0, 1.5, None],
         "strength": [NAN, -0.1, 1.1, None], "fused": ["yes", 1, None]})

_LAYER = BitLinear(5, 6)
BITLINEAR_FORWARD_ARGS = ArgSpec(
    "bitnet.BitLinear.forward", lambda x: _LAYER(x), valid=lambda: dict(x=torch.randn(2, 5)),
    bad={"x": [torch.randn(2, 4), torch.ones(2, 5, dtype=torch.int64), [[1.0] * 5], torch.randn(())]})

CONFIG_ARGS = ArgSpec(
    "bitnet.BitNetConfig", BitNetConfig, valid=dict,
    bad={"recipe": ["b2", None, 1, ["a4.8"]], "sub_norm": [1, "yes", None], "fused": [1, None],
         "topk_ratio": [NAN, INF, 0.0, 1.01, "0.5", True], "strength": [NAN, INF, -0.1, 1.1, None],
         "norm_eps": [NAN, INF, 0.0, 2.0], "exclude": ["lm_head", None, 3, (1,)]})

CONVERT_ARGS = ArgSpec(
    "bitnet.convert", convert, valid=lambda: dict(model=nn.Sequential(nn.Linear(4, 4)), recipe_or_config="b1.58"),
    bad={"model": [None, "model", torch.randn(3)], "recipe_or_config": ["b2", 3, None]},
    mention={"recipe_or_config": "recipe"})

FACTORY_ARGS = ArgSpec(
    "bitnet.linear_factory", lambda recipe: (linear_factory(recipe), mlp_activation(recipe)),
    valid=lambda: dict(recipe="a4.8"), bad={"recipe": ["a5", None, 4.8]})

STRENGTH_ARGS = ArgSpec(
    "bitnet.set_strength", set_strength, valid=lambda: dict(model=nn.Linear(2, 2), strength=0.5),
    bad={"strength": [NAN, INF, -0.1, 1.5, "1", None]})

SCHEDULE_ARGS = ArgSpec(
    "bitnet.TwoStageSchedule", TwoStageSchedule, valid=dict,
    bad={"stage1_share": [NAN, INF, 0.0, -0.1, 1.5, "0.9", None], "stage1_recipe": ["fp", "x", None],
         "stage2_recipe": ["fp", None], "stage2_lr_ratio": [NAN, INF, 0.0, 1.5], "bitnet": ["a4.8", None]})

BUILD_ARGS = ArgSpec(
    "bitnet.build_for_pretraining", build_for_pretraining,
    valid=lambda: dict(model=nn.Sequential(nn.Linear(4, 4)), recipe="a4.8"),
    bad={"recipe": ["a5", None], "stage1_share": [NAN, 0.0, 2.0]})

ACTIVATION_ARGS = ArgSpec(
    "bitnet.reference.quantize_activation", R.quantize_activation,
    valid=lambda: dict(x=torch.randn(2, 5), kind="int8"), bad={"kind": ["int2", None]}, mention={"kind": "activation"})

KERNEL_ARGS = ArgSpec(
    "bitnet.quantize_rows", quantize_rows, valid=lambda: dict(x=torch.randn(2, 5), kind="int8"),
    bad={"kind": ["fp4", "int2", None]})

SPECS = [QUANTIZERS, FUSED, WEIGHT, BITLINEAR_ROWS, BITLINEAR_ARGS, BITLINEAR_FORWARD_ARGS, CONFIG_ARGS,
         CONVERT_ARGS, FACTORY_ARGS, STRENGTH_ARGS, SCHEDULE_ARGS, BUILD_ARGS, ACTIVATION_ARGS, KERNEL_ARGS]
