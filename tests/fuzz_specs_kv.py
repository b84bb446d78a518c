"""Fuzz specs of decoding over the quantized KV cache (thrifty.kv.decode_attention, QuantizedKV):
bad arguments, and random shapes / dtypes / cache bits / special values against float64 attention over the
dequantized cache, with the NaN rule of reference.nonfinite_rows. See tests/fuzz_registry.py."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from fuzz_registry import FLOAT_DTYPES, ArgSpec, NumericSpec, assert_matches, special_values, tensors
from thrifty.attention import exact_attention
from thrifty.kv import QuantizedKV, decode_attention, quantize_kv_cache

NAN, INF = math.nan, math.inf


def _cache(B=1, Hkv=2, L=6, D=8):
    return quantize_kv_cache(torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D))


DECODE_ARGS = ArgSpec(
    "kv.decode_attention", decode_attention, valid=lambda: dict(q=torch.randn(1, 4, 2, 8), cache=_cache()),
    bad={"q": [torch.zeros(1, 4, 1, 8, dtype=torch.int64), torch.randn(1, 4, 1, 8).double(), torch.randn(4, 1, 8),
               torch.randn(1, 0, 1, 8), torch.randn(1, 4, 0, 8), torch.randn(1, 4, 17, 8), torch.randn(1, 3, 1, 8),
               torch.randn(2, 4, 1, 8), torch.randn(1, 4, 1, 16), torch.randn(1, 4, 7, 8), [[1.0]]],
         "cache": [(torch.randn(1, 2, 6, 8),) * 2, None, QuantizedKV.empty(1, 2, 4, 8)],
         "sm_scale": [NAN, INF, -INF, -1.0, 0.0, "0.1"], "impl": ["cuda"], "causal": ["yes", None]})

CACHE_ARGS = ArgSpec(
    "kv.quantize_kv_cache", quantize_kv_cache,
    valid=lambda: dict(k=torch.randn(1, 2, 3, 8), v=torch.randn(1, 2, 3, 8)),
    bad={"k": [torch.randn(0, 2, 3, 8), torch.randn(1, 0, 3, 8), torch.randn(1, 2, 3, 0), torch.randn(2, 3, 8),
               torch.zeros(1, 2, 3, 8, dtype=torch.int8)],
         "v": [torch.randn(1, 2, 4, 8), torch.randn(1, 2, 3, 4)], "bits": [5, 8.0, None], "capacity": [0, -1, 2.5]},
    mention={"v": "v", "capacity": "capacity"})

CACHE_EMPTY_ARGS = ArgSpec(
    "kv.QuantizedKV.empty", QuantizedKV.empty, valid=lambda: dict(batch=1, kv_heads=2, capacity=4, head_dim=8),
    bad={"batch": [0, -1, 1.5], "kv_heads": [0], "capacity": [0, True], "head_dim": [0, "8"], "bits": [2, 16]})


def _zero(x):
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype))


@st.composite
def decode_inputs(draw, head_dims=(8, 16), max_len=20):
    B, hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    sq = draw(st.integers(1, 4))
    L = draw(st.integers(sq, max_len))
    D = draw(st.sampled_from(head_dims))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    # ±max is left out: scores of such inputs overflow fp32 (documented, as for sage_attention)
    pool = [x for x in special_values(dtype) if abs(x) != torch.finfo(dtype).max]
    mk = lambda h, s, strided: tensors((B, h, s, D), dtype, allowed_specials=pool, strided=strided)  # noqa: E731
    q, k, v = draw(mk(hkv * group, sq, True)), draw(mk(hkv, L, False)), draw(mk(hkv, L, False))
    return dict(q=q, k=k, v=v, causal=draw(st.booleans()), bits=draw(st.sampled_from([8, 4, 3])))


def _run(a, impl):
    cache = quantize_kv_cache(a["k"], a["v"], bits=a["bits"])
    return decode_attention(a["q"], cache, causal=a["causal"], impl=impl)


def _check_decode(a, out):
    q, k, v, causal = a["q"], a["k"], a["v"], a["causal"]
    assert out.shape == q.shape and out.dtype == q.dtype
    B, H, Sq, _ = q.shape
    L, g = k.shape[2], H // k.shape[1]
    sees = torch.arange(L)[None, :] <= torch.arange(Sq)[:, None] + (L - Sq) if causal else torch.ones(Sq, L).bool()
    bad_tok = (~torch.isfinite(k) | ~torch.isfinite(v)).any(-1).repeat_interleave(g, dim=1)
    bad = (~torch.isfinite(q)).any(-1) | (sees & bad_tok[:, :, None, :]).any(-1)
    assert out[bad].isnan().all(), "a row that sees NaN/inf is not NaN"
    assert out[~bad].isfinite().all(), "NaN/inf in a row that sees none"
    kd, vd = quantize_kv_cache(_zero(k), _zero(v), bits=a["bits"]).dequantize(torch.float64)
    ref = exact_attention(_zero(q).double(), kd, vd, causal=causal, dtype=torch.float64)
    vmax = float(vd.abs().max())
    # output rounding in q's dtype (bf16: 2^-8) and, in the kernel, q and p·v_scale through fp16 (2^-11)
    tol = (2e-3 if q.dtype == torch.float32 else 1e-2) * vmax + 1e-6
    assert_matches(out, ref, rtol=0.0, atol=tol, where=~bad)
    if a["bits"] == 8:  # against the unquantized K/V too: a loose bound that catches zeros and garbage
        exact = exact_attention(_zero(q).double(), _zero(k).double(), _zero(v).double(), causal=causal)
        assert_matches(out, exact, rtol=0.0, atol=0.05 * float(_zero(v).abs().max()) + 1e-6, where=~bad)


DECODE_REFERENCE = NumericSpec("kv.decode.reference", decode_inputs(), lambda a: _run(a, "reference"),
                               _check_decode)
DECODE_KERNEL = NumericSpec("kv.decode.triton", decode_inputs(head_dims=(64,), max_len=40),
                            lambda a: _run(a, "triton"), _check_decode, max_examples=8)

SPECS = [DECODE_ARGS, CACHE_ARGS, CACHE_EMPTY_ARGS, DECODE_REFERENCE, DECODE_KERNEL]


def _fields(B=1, H=2, C=4, D=8):
    return dict(k=torch.zeros(B, H, C, D, dtype=torch.uint8), k_scale=torch.ones(B, H, C),
                v=torch.zeros(B, H, C, D, dtype=torch.uint8), v_scale=torch.ones(B, H, C), length=2, bits=8)


QUANTIZED_KV_FIELDS = ArgSpec(  # the cache dataclass: every field validated at construction
    "kv.QuantizedKV", QuantizedKV, valid=_fields,
    bad={"k": [torch.zeros(1, 2, 4, 8), torch.zeros(2, 4, 8, dtype=torch.uint8), torch.zeros(1, 0, 4, 8, dtype=torch.uint8),
               torch.zeros(1, 2, 8, 4, dtype=torch.uint8).transpose(-1, -2)],
         "v": [torch.zeros(1, 2, 5, 8, dtype=torch.uint8)], "k_scale": [torch.ones(1, 2, 4).double(), torch.ones(1, 2, 5)],
         "v_scale": [torch.ones(1, 2)], "length": [-1, 5, 1.0, None], "bits": [2, 8.0, True]},
    mention={"v": "v", "v_scale": "v_scale", "k_scale": "k_scale"})


def _hf_model():
    from types import SimpleNamespace

    from transformers import LlamaConfig
    return SimpleNamespace(config=LlamaConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1))


def _kv_cache(**kw):
    from thrifty.kv import thrifty_kv_cache
    return thrifty_kv_cache(**kw)


HF_CACHE_ARGS = ArgSpec("kv.thrifty_kv_cache", _kv_cache, valid=lambda: dict(model=_hf_model()),
                        bad={"bits": [5, 8.0, None, "8"], "model": [3, None]})

SPECS += [QUANTIZED_KV_FIELDS, HF_CACHE_ARGS]
