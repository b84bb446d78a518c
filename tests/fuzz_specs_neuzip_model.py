"""Fuzz specs of NeuZip in models (thrifty.neuzip.compress_model, NeuZipConfig, save_compressed /
load_compressed): bad arguments, damaged checkpoints refused before use (a ValueError naming the file) or read
unchanged. LOMO and its 8-bit states: tests/fuzz_specs_optim.py. See tests/fuzz_registry.py."""

from __future__ import annotations

import copy
import math

import torch
from hypothesis import strategies as st

from fuzz_registry import ArgSpec, FileSpec
from thrifty.models import LlamaConfig, LlamaForCausalLM
from thrifty.neuzip import NeuZipConfig, compress_model, load_compressed, save_compressed
from thrifty.optim import LomoConfig

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
         "impl": ["cuda", "torch", 3, None]})

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


SPECS = [COMPRESS_ARGS, COMPRESS_LOSSY_ARGS, NEUZIP_CONFIG_ARGS, NEUZIP_CHECKPOINT]
