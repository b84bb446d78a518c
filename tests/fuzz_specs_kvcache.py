"""Fuzz specs of ShadowKV (thrifty.kvcache): every ShadowKVConfig field, ShadowKVCache / engine / load_prompt bad
arguments and degenerate sizes, and the decode (reference path, and the Triton path under the interpreter at
small sizes) against float64 dense attention when the budget covers every chunk and the rank is full, on random
ragged batches with NaN in queries, values and generated tokens. The NaN contract (kvcache NOTES.md): a NaN query
head, prompt value or generated key/value makes NaN exactly the output rows that attend it; a non-finite prompt
key is refused (ValueError naming ``keys``), since the SVD mixes all heads and tokens of a sequence.
See tests/fuzz_registry.py for what each kind asserts."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from hypothesis import strategies as st

from fuzz_registry import ArgSpec, NumericSpec, assert_matches
from thrifty.kvcache import ShadowKVCache, ShadowKVConfig, ShadowKVEngine
from thrifty.models import LlamaForCausalLM
from thrifty.models.llama import LlamaConfig

NAN, INF = math.nan, math.inf


def _rope(T: int, device, D: int):
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    emb = torch.arange(T, dtype=torch.float64)[:, None] * inv
    emb = torch.cat((emb, emb), -1)
    return emb.cos().float().to(device), emb.sin().float().to(device)


# ------------------------------------------------------------------------------------------------ config
_INT_BAD = [0, -1, 16.0, True, NAN, INF, None, "16"]
CONFIG_ARGS = ArgSpec(
    "kvcache.ShadowKVConfig", ShadowKVConfig, valid=dict,
    bad={"rank": _INT_BAD, "chunk_size": _INT_BAD,
         "sparse_budget": _INT_BAD + [2047, 4], "outlier_chunks": [-1, 1.0, True, NAN, INF, None],
         "local_chunks": [-1, 2.5, False, NAN, None], "min_prompt_len": _INT_BAD,
         "max_generated": _INT_BAD, "host_values": ["int4", None, 8, ["fp8"]],
         "selector": ["h2o", None, 1]},
)


def _tiny_model():
    cfg = LlamaConfig(vocab_size=31, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg)


_MODEL = _tiny_model()
_SMALL = dict(rank=8, chunk_size=2, sparse_budget=4, outlier_chunks=1, local_chunks=1, min_prompt_len=4)

CACHE_ARGS = ArgSpec(
    "kvcache.ShadowKVCache", ShadowKVCache, valid=lambda: dict(model=_MODEL, config=ShadowKVConfig(**_SMALL)),
    bad={"model": [None, object(), nn.Linear(2, 2), "model"], "config": ["cfg", {"rank": 8}, 8]})
CACHE_RANK_ARGS = ArgSpec(  # rank above kv_heads*head_dim = 2*8 of the model: named when the cache is built
    "kvcache.ShadowKVCache.rank", ShadowKVCache, valid=lambda: dict(model=_MODEL, config=ShadowKVConfig(**_SMALL)),
    bad={"config": [ShadowKVConfig(**{**_SMALL, "rank": 17})]}, mention={"config": "rank"})


def _prompt(B=1, H=2, T=6, D=8, nan_key=False):
    k, v = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    if nan_key:
        k[0, 1, T - 1, 0] = NAN
    return [(k, v)]


LOAD_ARGS = ArgSpec(
    "kvcache.ShadowKVCache.load_prompt",
    lambda keys_values: ShadowKVCache(_MODEL, ShadowKVConfig(**_SMALL)).load_prompt(keys_values),
    valid=lambda: dict(keys_values=_prompt()),
    bad={"keys_values": [_prompt(nan_key=True), _prompt(H=3), _prompt(D=4), _prompt() * 2, [],
                         [(torch.ones(1, 2, 6, 8, dtype=torch.int64), torch.ones(1, 2, 6, 8))],
                         [(torch.randn(2, 6, 8), torch.randn(2, 6, 8))]]},
    mention={"keys_values": "keys"})  # "keys_values" or, for a NaN key, "keys"


def _engine(impl="reference", **kw):
    eng = ShadowKVEngine(ShadowKVConfig(**{**_SMALL, **kw}), 1, 2, 8, lambda T, dev: _rope(T, dev, 8), impl=impl)
    return eng


def _prefill(k_post, v, lengths):
    _engine().prefill(0, k_post, v, lengths)


PREFILL_ARGS = ArgSpec(
    "kvcache.ShadowKVEngine.prefill", _prefill,
    valid=lambda: dict(k_post=torch.randn(1, 2, 6, 8), v=torch.randn(1, 2, 6, 8), lengths=torch.tensor([6])),
    bad={"k_post": [torch.randn(0, 2, 6, 8), torch.randn(1, 2, 0, 8)]})

# ------------------------------------------------------------------------------------------------ decode
@st.composite
def decode_inputs(draw, head_dims=(2, 4, 8), max_len=30, max_batch=2, dtypes=(torch.float32, torch.bfloat16),
                  nans=True, selectors=("shadowkv", "shadowkv", "quest")):
    B, H, G = draw(st.integers(1, max_batch)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    D = draw(st.sampled_from(head_dims))
    lengths = draw(st.lists(st.integers(0, max_len), min_size=B, max_size=B).filter(lambda L: max(L) > 0))
    T = max(lengths) + draw(st.integers(0, 3))  # padding rows past the longest prompt too
    c = draw(st.sampled_from([1, 2, 4]))
    chunks = -(-T // c)
    cfg = dict(rank=H * D, chunk_size=c, sparse_budget=c * max(chunks, 1), outlier_chunks=draw(st.integers(0, 2)),
               local_chunks=draw(st.integers(0, 2)), min_prompt_len=1, max_generated=4,
               host_values=draw(st.sampled_from(["native", "native", "fp8"])) if not nans else "native",
               selector=draw(st.sampled_from(selectors)))
    dtype = draw(st.sampled_from(dtypes))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    k = torch.randn(B, H, T, D, generator=g).to(dtype)
    v = torch.randn(B, H, T, D, generator=g).to(dtype)
    for b, n in enumerate(lengths):  # padding holds garbage, NaN included: it must never be read
        k[b, :, n:], v[b, :, n:] = NAN, NAN
    steps = draw(st.integers(1, 3))
    qs = torch.randn(steps, B, H * G, 1, D, generator=g).to(dtype)
    ks = torch.randn(steps, B, H, 1, D, generator=g).to(dtype)
    vs = torch.randn(steps, B, H, 1, D, generator=g).to(dtype)
    if nans:
        for _ in range(draw(st.integers(0, 2))):
            which = draw(st.sampled_from(["q", "v", "k_new", "v_new", "subnormal", "-0"]))
            b = draw(st.integers(0, B - 1))
            if which == "q":
                qs[draw(st.integers(0, steps - 1)), b, draw(st.integers(0, H * G - 1)), 0, 0] = NAN
            elif which == "v" and lengths[b]:
                v[b, draw(st.integers(0, H - 1)), draw(st.integers(0, lengths[b] - 1)), 0] = NAN
            elif which in ("k_new", "v_new"):
                (ks if which == "k_new" else vs)[draw(st.integers(0, steps - 1)), b, draw(st.integers(0, H - 1))] = NAN
            elif lengths[b]:
                k[b, 0, lengths[b] - 1, 0] = 1e-40 if which == "subnormal" else -0.0
    return dict(k=k, v=v, lengths=torch.tensor(lengths), qs=qs, ks=ks, vs=vs, config=cfg,
                scale=draw(st.sampled_from([1.0 / math.sqrt(D), 0.3])), H=H, D=D)


def _decode(a, impl="reference"):
    eng = ShadowKVEngine(ShadowKVConfig(**a["config"]), 1, a["H"], a["D"], lambda T, dev: _rope(T, dev, a["D"]),
                         impl=impl)
    eng.prefill(0, a["k"], a["v"], a["lengths"])
    outs = [eng.decode(0, q, kn, vn, a["scale"]) for q, kn, vn in zip(a["qs"], a["ks"], a["vs"])]
    assert eng.stats["kernel_steps" if impl == "triton" else "reference_steps"] == len(outs)
    return torch.stack(outs)


def _dense64(a):
    """Float64 attention of each step's query over the prompt and the tokens generated so far."""
    k, v, L = a["k"].double(), a["v"].double(), a["lengths"]
    steps, B, Hq, _, D = a["qs"].shape
    H = k.shape[1]
    out = torch.zeros(steps, B, Hq, 1, D, dtype=torch.float64)
    for s in range(steps):
        for b in range(B):
            keys = torch.cat((k[b, :, :L[b]], a["ks"][: s + 1, b, :, 0].double().transpose(0, 1)), 1)
            vals = torch.cat((v[b, :, :L[b]], a["vs"][: s + 1, b, :, 0].double().transpose(0, 1)), 1)
            keys, vals = keys.repeat_interleave(Hq // H, 0), vals.repeat_interleave(Hq // H, 0)  # (Hq, N, D)
            p = (torch.einsum("hd,hnd->hn", a["qs"][s, b, :, 0].double(), keys) * a["scale"]).softmax(-1)
            out[s, b, :, 0] = torch.einsum("hn,hnd->hd", p, vals)
    return out


def _check_decode(a, out):
    ref = _dense64(a)
    assert out.shape == ref.shape and out.dtype == a["qs"].dtype
    if a["qs"].dtype == torch.float32:
        tol = 1e-4 if a["config"]["host_values"] == "native" else 0.1  # fp8 values: e4m3 has a 3-bit mantissa
    else:
        tol = 0.06  # bf16 low-rank factors and values
    assert_matches(out, ref, rtol=tol, atol=tol)


DECODE_REFERENCE = NumericSpec("kvcache.decode.reference", decode_inputs(), _decode, _check_decode,
                               max_examples=25)
DECODE_FP8 = NumericSpec("kvcache.decode.reference.fp8", decode_inputs(nans=False, dtypes=(torch.float32,)),
                         _decode, _check_decode, max_examples=8)
DECODE_TRITON = NumericSpec(
    "kvcache.decode.triton",
    decode_inputs(head_dims=(32,), max_len=12, max_batch=1, dtypes=(torch.float32,), selectors=("shadowkv",)),
    lambda a: _decode(a, "triton"), _check_decode, max_examples=4)

SPECS = [CONFIG_ARGS, CACHE_ARGS, CACHE_RANK_ARGS, LOAD_ARGS, PREFILL_ARGS, DECODE_REFERENCE, DECODE_FP8,
         DECODE_TRITON]
