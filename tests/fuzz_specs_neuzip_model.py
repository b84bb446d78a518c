"""Fuzz specs of NeuZip in models (thrifty.neuzip.compress_model, NeuZipConfig, LomoConfig, lomo,
save_compressed / load_compressed): bad arguments, damaged checkpoints refused before use (a ValueError
naming the file) or read unchanged, and the 8-bit optimizer-state quantizer against float64. See tests/fuzz_registry.py."""

from __future__ import annotations

import copy
import math

import torch
from hypothesis import strategies as st

from fuzz_registry import ArgSpec, FileSpec, NumericSpec
from thrifty.models import LlamaConfig, LlamaForCausalLM
from thrifty.neuzip import LomoConfig, NeuZipConfig, compress_model, load_compressed, lomo, save_compressed
from thrifty.neuzip import state8

NAN, INF = math.nan, math.inf


def _tiny(dtype=torch.float32, seed=0, layers=1):
    cfg = LlamaConfig(vocab_size=41, hidden_size=16, intermediate_size=24, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).init_weights(seed=seed).to(dtype)


_BASE = {dt: _tiny(dt) for dt in (torch.float32, torch.bfloat16)}  # copied per call: compress_model changes its model


def _model(dtype=torch.float32):
    return copy.deepcopy(_BASE[dtype])


_COMPRESSED = compress_model(_model())

COMPRESS_ARGS = ArgSpec(
    "neuzip.compress_model", compress_model, valid=lambda: dict(model=_model()),
    bad={"mode": ["lossy2", None, 3], "mantissa_bits": [2, 1.5, True, "3", -1, 8, 0], "steps": [32, 64.0, "64"],
         "config": [3, dict(mode="lossless")], "train": [3, "adamw", dict(lr=1e-3)],
         "model": [3, torch.nn.Linear(2, 2), _COMPRESSED, _model().to(torch.float64)]},
    mention={"model": "model"})

# lossy: mantissa_bits against the weights' dtype (bf16 only), and no training of rounded weights
COMPRESS_LOSSY_ARGS = ArgSpec(
    "neuzip.compress_model.lossy", compress_model,
    valid=lambda: dict(model=_model(torch.bfloat16), mode="lossy", mantissa_bits=3),
    bad={"mantissa_bits": [None, 2, 8, 3.0], "train": [LomoConfig()], "model": [_model(torch.float32)]},
    mention={"model": "mantissa_bits"})  # the message names the argument that asks for bf16

NEUZIP_CONFIG_ARGS = ArgSpec(
    "neuzip.NeuZipConfig", NeuZipConfig, valid=dict,
    bad={"mode": ["fast", None], "mantissa_bits": [3, NAN, 1.0, True], "steps": [0, 32, NAN, 64.0],
         "impl": ["cuda"]})

LOMO_CONFIG_ARGS = ArgSpec(
    "neuzip.LomoConfig", LomoConfig, valid=dict,
    bad={"optimizer": ["adam2", None], "lr": [NAN, INF, -INF, 0.0, -1.0, "1e-3", 11.0],
         "betas": [(NAN, 0.9), (0.9, INF), (0.9,), (1.0, 0.9), (0.9, -0.1), "ab", None],
         "eps": [NAN, INF, 0.0, -1e-8], "weight_decay": [NAN, INF, -1.0], "state_dtype": [torch.uint8, torch.float16, "int4", "fp32", None],
         "state_block": [0, -256, 100, 8, 8192, 256.0, NAN, True, None]},  # torch.int8 is valid: 8-bit states
    mention={"betas": "betas"})

LOMO_ARGS = ArgSpec(
    "neuzip.lomo", lomo, valid=lambda: dict(model=_model(), config=LomoConfig()),
    bad={"model": [3, None], "config": [3, 0, "adamw", dict(lr=1e-3)]})


# ---------------------------------------------------------------------------------------- checkpoints
def _checkpoint(draw_args):
    seed, lossy = draw_args
    model = _tiny(torch.bfloat16, seed=seed, layers=2)
    return compress_model(model, "lossy", 3) if lossy else compress_model(model)


def _write(args, path):
    save_compressed(_checkpoint(args), path)


def _same(args, model) -> bool:
    want = _checkpoint(args)
    a, b = want.neuzip.decoded_weights(), model.neuzip.decoded_weights()
    if a.keys() != b.keys() or model.neuzip.config != want.neuzip.config:
        return False
    same = lambda x, y: x.dtype == y.dtype and x.shape == y.shape and torch.equal(  # noqa: E731
        x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
    if not all(same(a[k], b[k]) for k in a):
        return False
    sa, sb = want.state_dict(), model.state_dict()
    return sa.keys() == sb.keys() and all(same(sa[k], sb[k]) for k in sa if "neuzip" not in k)


NEUZIP_CHECKPOINT = FileSpec("neuzip.save_compressed", st.tuples(st.integers(0, 3), st.booleans()), _write,
                             load_compressed, _same, max_examples=10)



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
    "neuzip.state8.round_trip", _state8_inputs(),
    lambda a: state8.dequantize(*state8.quantize(a["x"], a["block"], a["signed"]), a["block"]), _check_state8)

SPECS = [COMPRESS_ARGS, COMPRESS_LOSSY_ARGS, NEUZIP_CONFIG_ARGS, LOMO_CONFIG_ARGS, LOMO_ARGS, NEUZIP_CHECKPOINT,
         STATE8_ROUND_TRIP]
