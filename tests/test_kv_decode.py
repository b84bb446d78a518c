"""Decoding: the quantized KV cache, the split-K decode kernel (interpreter on CPU) against its reference and
float64, the routing of short queries (which path ran), transformers integration (per-model options, the
quantized cache in ``generate``), CUDA-graph capture (GPU)."""

import pytest
import torch

from thrifty.attention import SageConfig, accuracy_metrics, enable_hf, exact_attention, sage_attention
from thrifty.bench import capture_graph
from thrifty.kv import QuantizedKV, QuantizedKVCache, decode_attention, quantize_kv_cache, thrifty_kv_cache
from thrifty.kv.decode import decode_attention_reference
from thrifty.kv.quantized import bytes_per_token, pack_codes, quantize_per_token, unpack_codes
from thrifty.triton_utils import interpreting

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not (interpreting() or torch.cuda.is_available()),
                                   reason="needs CUDA or TRITON_INTERPRET=1")


def _qkv(B, H, Hkv, Sq, L, D, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Sq, D, generator=g) * 1.5
    k = torch.randn(B, Hkv, L, D, generator=g) * 1.5 + 3.0 * torch.randn(D, generator=g)  # outlier channels
    v = torch.randn(B, Hkv, L, D, generator=g)
    return [x.to(DEVICE, dtype) for x in (q, k, v)]


# --------------------------------------------------------------------------------------------- the cache
def test_cache_append_grows_and_round_trips():
    _, k, v = _qkv(2, 2, 2, 1, 21, 64)
    cache = QuantizedKV.empty(2, 2, 8, 64, device=DEVICE)
    for lo, hi in ((0, 5), (5, 6), (6, 21)):  # a prompt, one token, a chunk past the capacity
        cache.append(k[:, :, lo:hi], v[:, :, lo:hi])
    assert cache.length == 21 and cache.k.shape[2] >= 21 and cache.shape == (2, 2, 21, 64)
    kd, vd = cache.dequantize()
    codes, scale = quantize_per_token(k, 8)
    assert torch.equal(cache.k[:, :, :21], codes) and torch.equal(kd, (codes.float() - 127.5) * scale[..., None])
    assert accuracy_metrics(vd, v)["cos_sim"] > 0.9999 and cache.k.dtype == torch.uint8


@pytest.mark.parametrize("bits", [8, 4, 3])
@pytest.mark.parametrize("D", [8, 64, 72])
def test_packing_round_trips_every_code_in_every_channel(bits, D):
    top = (1 << bits) - 1
    codes = ((torch.arange(top + 1)[:, None] + torch.arange(D)[None, :]) % (top + 1)).to(torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (top + 1, D * bits // 8)  # exactly `bits` per value
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_packed_layout_by_hand():
    """Byte j of a w-bit field holds channels j, j + n, ... at shifts 0, w, ...; 3 bits = a 2-bit field then a
    1-bit field (the layout the decode kernel reads)."""
    assert pack_codes(torch.tensor([1, 2, 3, 4], dtype=torch.uint8), 4).tolist() == [0x31, 0x42]
    # low 2 bits 0,1,2,3,0,1,2,3 -> bytes 0|2<<2|0<<4|2<<6, 1|3<<2|1<<4|3<<6; bit 2: 0,0,0,0,1,1,1,1 -> 0xF0
    assert pack_codes(torch.arange(8, dtype=torch.uint8), 3).tolist() == [136, 221, 240]


@pytest.mark.parametrize("bits", [8, 4, 3])
def test_quantizer_is_the_unsigned_absmax_grid(bits):
    """Codes 0..2^bits − 1 spread evenly over [−absmax, absmax] of each token and head (no level at zero), so
    the error is at most half a step, absmax / (2^bits − 1), and every token uses an end of the range."""
    _, k, _ = _qkv(2, 3, 3, 1, 17, 64)
    top = (1 << bits) - 1
    codes, scale = quantize_per_token(k, bits)
    absmax = k.abs().amax(-1)
    assert codes.dtype == torch.uint8 and int(codes.max()) == top and int(codes.min()) == 0
    assert ((codes == 0) | (codes == top)).any(-1).all()
    grid = absmax[..., None] * (2 * codes.float() - top) / top  # the paper's levels, written independently
    torch.testing.assert_close((codes.float() - top / 2) * scale[..., None], grid, rtol=1e-6, atol=1e-6)
    assert ((grid - k).abs() <= absmax[..., None] / top * (1 + 1e-5)).all()


@pytest.mark.parametrize("splits", [1, 3])
def test_3bit_cache_keeps_the_first_token_at_4_bits(splits):
    """The first token (BOS / attention sink) at 4 bits, whichever way it is appended; the others at 3."""
    _, k, v = _qkv(1, 2, 2, 1, 12, 64)
    cache = QuantizedKV.empty(1, 2, 4, 64, bits=3)
    for chunk in torch.arange(12).chunk(splits):
        cache.append(k[:, :, chunk], v[:, :, chunk])
    kc, vc, zero = cache.codes()
    assert zero.tolist() == [7.5] + [3.5] * 11
    assert int(kc[:, :, 0].max()) == 15 and int(kc[:, :, 1:].max()) == 7
    kd, vd = cache.dequantize()
    for x, xd in ((k, kd), (v, vd)):
        step = 2 * x.abs().amax(-1, keepdim=True)
        err = (xd - x).abs()
        assert (err[:, :, :1] <= step[:, :, :1] / 15 / 2 * 1.001).all() and (err <= step / 7 / 2 * 1.001).all()
        assert err[:, :, :1].max() < err[:, :, 1:].max() / 1.5
    assert cache.k.shape[-1] == 64 * 3 // 8 and cache.k_sink.shape == (1, 2, 8)


def test_cache_bytes_are_bits_per_value_plus_scales():
    _, k, v = _qkv(2, 2, 2, 1, 30, 128)
    for bits, ratio in ((8, 0.516), (4, 0.266), (3, 0.203)):
        cache = quantize_kv_cache(k, v, bits=bits)
        assert bytes_per_token(128, bits) / bytes_per_token(128, None) == pytest.approx(ratio, abs=1e-3)
        held = sum(t[:, :, :30].numel() * t.element_size() for t in (cache.k, cache.v, cache.k_scale, cache.v_scale))
        sink = 0 if cache.k_sink is None else 2 * cache.k_sink.numel()
        assert cache.nbytes() == held + sink == 2 * 2 * 2 * 30 * bytes_per_token(128, bits) + sink


@pytest.mark.parametrize("make, err, match", [
    (lambda k, v: quantize_kv_cache(k, v, bits=5), ValueError, "bits"),
    (lambda k, v: quantize_kv_cache(k, v).append(k[:, :, :2, :32], v[:, :, :2, :32]), ValueError, "k, v"),
    (lambda k, v: QuantizedKV(k, k[..., 0], v, v[..., 0], 0), TypeError, "uint8"),
    (lambda k, v: QuantizedKV.empty(1, 2, 0, 64), ValueError, "capacity"),
    (lambda k, v: QuantizedKV.empty(1, 2, 4, 36, bits=3), ValueError, "head_dim"),
    (lambda k, v: QuantizedKV.empty(1, 2, 4, 7, bits=4), ValueError, "head_dim"),
    (lambda k, v: QuantizedKV(**{**QuantizedKV.empty(1, 2, 4, 64, bits=3).__dict__, "k_sink": None}), TypeError,
     "k_sink"),
    (lambda k, v: QuantizedKV(**{**QuantizedKV.empty(1, 2, 4, 64).__dict__,
                                 "k_sink": torch.zeros(1, 2, 8, dtype=torch.uint8)}), ValueError, "k_sink"),
    (lambda k, v: QuantizedKVCache(bits=2), ValueError, "bits"),
    (lambda k, v: QuantizedKVCache(reads_codes=1), TypeError, "reads_codes"),
])
def test_cache_bad_input(make, err, match):
    _, k, v = _qkv(1, 2, 2, 1, 4, 64)
    with pytest.raises(err, match=match):
        make(k, v)


# ------------------------------------------------------------------------------------- the decode kernel
CASES = [  # B, H, Hkv, Sq, L, D, causal
    (1, 4, 2, 1, 77, 64, True),      # GQA, one token, odd length
    (2, 8, 2, 3, 133, 128, True),    # speculative draft of 3, head_dim 128
    (1, 2, 2, 16, 40, 64, True),     # MHA, 16 rows: the largest decode call
    (1, 6, 3, 5, 29, 128, False),    # non-causal
]


@needs_kernels
@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.parametrize("B,H,Hkv,Sq,L,D,causal", CASES)
def test_decode_kernel_matches_reference_and_float64(monkeypatch, splits, B, H, Hkv, Sq, L, D, causal):
    from thrifty.kv import decode_kernel
    monkeypatch.setitem(decode_kernel._INTERPRET_CONFIG, "target_programs", splits * B * Hkv)
    q, k, v = _qkv(B, H, Hkv, Sq, L, D, seed=L)
    cache = quantize_kv_cache(k, v)
    n_split = decode_kernel.split_plan(L, B * Hkv, decode_kernel.decode_config())[1]
    assert (n_split == 1) == (splits == 1)  # one chunk, or several merged by the combine kernel
    out = decode_attention(q, cache, causal=causal, impl="triton")
    ref = decode_attention_reference(q, cache, causal=causal, dtype=torch.float64)
    # q and p·v_scale go through fp16 into the tensor cores: 2^-11 relative
    assert (out.double() - ref.double()).abs().max() < 2e-3
    exact = exact_attention(q, k, v, causal=causal)  # unquantized K/V, float64
    assert accuracy_metrics(out, exact)["cos_sim"] > 0.999


@needs_kernels
@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.parametrize("bits", [4, 3])
@pytest.mark.parametrize("B,H,Hkv,Sq,L,D,causal", CASES[:2])
def test_decode_kernel_reads_packed_low_bit_codes(monkeypatch, bits, splits, B, H, Hkv, Sq, L, D, causal):
    """The kernel unpacks 4- and 3-bit rows (and the 3-bit mode's 4-bit first token, which only split 0 sees)
    to the reference's values."""
    from thrifty.kv import decode_kernel
    monkeypatch.setitem(decode_kernel._INTERPRET_CONFIG, "target_programs", splits * B * Hkv)
    q, k, v = _qkv(B, H, Hkv, Sq, L, D, seed=L + bits)
    cache = quantize_kv_cache(k, v, bits=bits)
    out = decode_attention(q, cache, causal=causal, impl="triton")
    ref = decode_attention_reference(q, cache, causal=causal, dtype=torch.float64)
    assert (out.double() - ref.double()).abs().max() < 2e-3
    if bits == 3:  # the same cache read as if the first token had 3 bits gives a different answer
        cache.k_sink.zero_()
        wrong = decode_attention_reference(q, cache, causal=causal, dtype=torch.float64)
        assert (wrong - ref).abs().max() > 1e-2


@needs_kernels
def test_decode_kernel_bf16_strided_query_and_4bit_cache():
    q, k, v = _qkv(1, 4, 1, 2, 50, 64, dtype=torch.bfloat16)
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, S, H, D) memory, a (B, H, S, D) view
    cache = quantize_kv_cache(k, v, bits=4)
    out = decode_attention(q_view, cache, impl="triton")
    assert out.dtype == torch.bfloat16 and out.stride() == q_view.stride()
    ref = decode_attention_reference(q.float(), cache, dtype=torch.float64)
    assert (out.double() - ref).abs().max() < 2e-2  # bf16 output rounding


@needs_kernels
def test_decode_path_runs_the_kernel_only_where_asked(monkeypatch):
    from thrifty.kv import decode, decode_kernel
    calls = []
    real = decode_kernel.decode_forward_triton
    monkeypatch.setattr(decode_kernel, "decode_forward_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = _qkv(1, 2, 1, 1, 20, 64)
    cache = quantize_kv_cache(k, v)
    decode_attention(q, cache, impl="triton")
    assert calls == [1]
    expected = "triton" if q.is_cuda else "reference"  # the interpreter is never chosen implicitly
    assert decode.decode_path(q, "auto") == expected
    assert decode.decode_path(q[..., :32], "auto") == "reference"  # head_dim without a kernel


@pytest.mark.parametrize("q_shape, cache_len, err, match", [
    ((1, 4, 17, 64), 40, ValueError, "1..16 query rows"),
    ((1, 3, 1, 64), 40, ValueError, "multiple"),
    ((1, 4, 1, 32), 40, ValueError, "head_dim"),
    ((2, 4, 1, 64), 40, ValueError, "batch"),
    ((1, 4, 4, 64), 3, ValueError, "fewer than"),
])
def test_decode_bad_input(q_shape, cache_len, err, match):
    _, k, v = _qkv(1, 2, 2, 1, cache_len, 64)
    with pytest.raises(err, match=match):
        decode_attention(torch.randn(*q_shape, device=DEVICE), quantize_kv_cache(k, v))
    with pytest.raises(TypeError, match="QuantizedKV"):
        decode_attention(torch.randn(1, 4, 1, 64), (k, v))


# ------------------------------------------------------------------------------------------------- routing
def _spy(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def spy(*a, **kw):
        calls.append(name)
        return real(*a, **kw)
    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("sq", [1, 7, 16, 17])
def test_short_queries_go_to_sdpa(monkeypatch, sq):
    from thrifty.attention import sage
    sdpa, quantized = _spy(monkeypatch, sage, "_exact_sdpa"), _spy(monkeypatch, sage, "_forward")
    q, k, v = _qkv(1, 4, 2, sq, 40, 64)
    out = sage_attention(q, k, v, causal=True)
    assert (sdpa, quantized) == ((["_exact_sdpa"], []) if sq <= 16 else ([], ["_forward"]))
    exact = exact_attention(q, k, v, causal=True)
    assert (out - exact).abs().max() < 1e-5 if sq <= 16 else accuracy_metrics(out, exact)["cos_sim"] > 0.999


def test_explicit_impl_is_obeyed_for_short_queries(monkeypatch):
    from thrifty.attention import sage
    quantized = _spy(monkeypatch, sage, "_forward")
    q, k, v = _qkv(1, 4, 2, 2, 40, 64)
    sage_attention(q, k, v, causal=True, impl="reference")
    assert quantized == ["_forward"]


# ----------------------------------------------------------------------------------------- transformers
def _tiny_llama(seed=0, layers=2):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   attn_implementation="sdpa")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_two_models_keep_their_own_options(monkeypatch):
    from thrifty.attention import hf
    seen = []
    real = hf.sage_attention
    monkeypatch.setattr(hf, "sage_attention", lambda *a, **kw: seen.append(kw["config"].qk_bits) or real(*a, **kw))
    m8, m4 = _tiny_llama(0), _tiny_llama(1, layers=3)
    enable_hf(m8)
    enable_hf(m4, config=SageConfig(qk_bits=4), plan={2: 8})  # enabling the second model must not change the first
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        for model in (m8, m4, m8):
            model(ids)
    assert seen == [8, 8] + [4, 4, 8] + [8, 8]
    hf.disable_hf(m4)
    assert not any(hf.OPTIONS_ATTR in m.__dict__ for m in m4.modules())


def test_hf_decode_steps_take_sdpa_or_the_quantized_cache(monkeypatch):
    from thrifty.attention import hf
    from thrifty.kv import decode, decode_kernel
    model = _tiny_llama()
    ids = torch.randint(0, 128, (1, 30))
    gen = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, **gen)
        enable_hf(model)
        sdpa = _spy(monkeypatch, hf, "_sdpa")
        plain = model.generate(ids, **gen)  # stock DynamicCache: decode steps go to transformers' SDPA
        assert len(sdpa) == 3 * 2  # 3 decode steps × 2 layers; the prompt went to the prefill path
        sdpa.clear()
        if not torch.cuda.is_available():  # run the kernel itself (interpreter) for the decode steps
            monkeypatch.setattr(decode, "decode_path", lambda q, impl="auto": "triton")
        kernel = _spy(monkeypatch, decode_kernel, "decode_forward_triton")
        cache = thrifty_kv_cache(model)
        quant = model.generate(ids, past_key_values=cache, **gen)
    assert sdpa == [] and len(kernel) == 3 * 2 and cache.layers[0].kv.length == 33
    assert torch.equal(plain.sequences, ref.sequences) and torch.equal(quant.sequences, ref.sequences)
    for a, b in zip(quant.logits, ref.logits):
        assert accuracy_metrics(a, b)["cos_sim"] > 0.999


def test_quantized_cache_hands_out_full_kv_when_thrifty_attention_is_off():
    model = _tiny_llama()
    ids = torch.randint(0, 128, (1, 20))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=3, do_sample=False)
        out = model.generate(ids, max_new_tokens=3, do_sample=False, past_key_values=thrifty_kv_cache(model))
    assert torch.equal(out, ref)


def test_hf_3bit_cache_kernel_reads_what_the_cache_dequantizes(monkeypatch):
    """Decode steps through the kernel on the packed 3-bit cache give the logits of SDPA on its dequantized
    K/V (the same cache handed out dequantized when thrifty attention is off)."""
    from thrifty.kv import decode, decode_kernel
    model = _tiny_llama()
    ids = torch.randint(0, 128, (1, 12))  # ≤ 16 rows: the prompt goes to SDPA both ways, on unquantized K/V
    gen = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        dequantized = model.generate(ids, past_key_values=thrifty_kv_cache(model, bits=3), **gen)
        enable_hf(model)
        if not torch.cuda.is_available():
            monkeypatch.setattr(decode, "decode_path", lambda q, impl="auto": "triton")
        kernel = _spy(monkeypatch, decode_kernel, "decode_forward_triton")
        cache = thrifty_kv_cache(model, bits=3)
        packed = model.generate(ids, past_key_values=cache, **gen)
    assert len(kernel) == 3 * 2 and cache.layers[0].kv.bits == 3 and cache.layers[0].kv.length == 15
    assert torch.equal(packed.sequences, dequantized.sequences)
    for a, b in zip(packed.logits, dequantized.logits):
        assert (a - b).abs().max() < 1e-3 * b.abs().max()


# ---------------------------------------------------------------------------------------- reference model
def _tiny_reference():
    from thrifty.models import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).init_weights(seed=0).eval()


@pytest.mark.parametrize("bits", [8, 3])
def test_reference_model_cache_stores_post_rope_keys(bits):
    from thrifty.models.llama import KVCache
    model = _tiny_reference()
    ids = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(0))
    plain, quantized = KVCache(), QuantizedKVCache(bits)
    with torch.no_grad():
        model(ids, cache=plain)
        model(ids, cache=quantized)
    assert len(quantized) == 21
    kd, vd = quantized.layers[0].dequantize()  # layer 0 (the next layers' inputs already differ)
    for exact, got in ((plain.keys[0], kd), (plain.values[0], vd)):
        step = 2 * exact.abs().amax(-1, keepdim=True) / ((1 << bits) - 1)  # post-RoPE: within half a step
        step[:, :, :1] *= 0.5 if bits == 3 else 1.0  # the 3-bit mode's first token at 4 bits
        assert ((got - exact).abs() <= step / 2 * 1.001).all()


def test_reference_model_decodes_through_the_kernel_on_the_packed_cache(monkeypatch):
    from thrifty.attention import sage_seam
    from thrifty.kv import decode, decode_kernel
    from thrifty.models.generate import generate
    model = _tiny_reference()
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dequantized = generate(model, ids, 5, cache_factory=lambda: QuantizedKVCache(3))  # SDPA on dequantized K/V
        model.set_attention(sage_seam())
        if not torch.cuda.is_available():
            monkeypatch.setattr(decode, "decode_path", lambda q, impl="auto": "triton")
        kernel = _spy(monkeypatch, decode_kernel, "decode_forward_triton")
        packed = generate(model, ids, 5, cache_factory=lambda: QuantizedKVCache(3, reads_codes=True))
    assert len(kernel) == 6 * 2  # the 9-token prompt and 5 steps (generate runs one after the last token), 2 layers
    assert torch.equal(packed, dequantized)


# ------------------------------------------------------------------------------------------------ GPU only
@pytest.mark.cuda
@pytest.mark.parametrize("what", ["prefill", "decode", "short_query"])
def test_cuda_graph_replay_equals_eager(what):
    """The whole attention call (pre-pass, kernels, allocations, routing) captured in a CUDA graph."""
    q, k, v = _qkv(1, 8, 2, {"prefill": 300, "decode": 1, "short_query": 4}[what], 1000, 128, dtype=torch.bfloat16)
    cache = quantize_kv_cache(k, v)
    fn = {"prefill": lambda: sage_attention(q, k[:, :, :300], v[:, :, :300], causal=True),
          "decode": lambda: decode_attention(q, cache),
          "short_query": lambda: sage_attention(q, k, v, causal=True)}[what]
    eager = fn()  # compiles and warms the launch caches outside the capture
    graph, captured = capture_graph(fn, warmup=1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.cuda
def test_cuda_decode_kernel_real_sizes():
    q, k, v = _qkv(1, 32, 8, 1, 8191, 64, dtype=torch.bfloat16)
    cache = quantize_kv_cache(k, v)
    out = decode_attention(q, cache)
    ref = decode_attention_reference(q, cache, dtype=torch.float64)
    assert accuracy_metrics(out, ref)["cos_sim"] > 0.99999


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4, 3])
def test_append_kernel_matches_the_torch_quantizer(bits):
    """The fused append (one launch per tensor, what CUDA caches use) writes the reference's codes and scales."""
    from thrifty.kv.decode_kernel import append_triton
    _, k, v = _qkv(2, 2, 3, 1, 13, 64, dtype=torch.bfloat16)
    ref = quantize_kv_cache(k[:, :, :5], v[:, :, :5], bits=bits, capacity=20)
    ref._append_torch(k[:, :, 5:], v[:, :, 5:], 13)
    fused = quantize_kv_cache(k[:, :, :5], v[:, :, :5], bits=bits, capacity=20)
    append_triton(fused, k[:, :, 5:], v[:, :, 5:])
    from_start = QuantizedKV.empty(2, 3, 20, 64, bits=bits)  # the first token too (4 bits in the 3-bit mode)
    append_triton(from_start, k, v)
    for cache in (fused, from_start):
        for a, b in ((cache.k, ref.k), (cache.v, ref.v), (cache.k_scale, ref.k_scale), (cache.v_scale, ref.v_scale),
                     (cache.k_sink, ref.k_sink), (cache.v_sink, ref.v_sink)):
            assert (a is None and b is None) or torch.equal(a, b)


# ------------------------------------------------------------------------------ NaN in -> NaN out, edge sizes
def _rows_that_see(q, k, v, causal):
    """(B, H, Sq): rows whose query holds NaN/inf or that see a key/value token holding one (independent of
    reference.nonfinite_rows)."""
    B, H, Sq, _ = q.shape
    L, g = k.shape[2], H // k.shape[1]
    sees = torch.arange(L)[None, :] <= torch.arange(Sq)[:, None] + (L - Sq) if causal else torch.ones(Sq, L).bool()
    bad_tok = (~torch.isfinite(k) | ~torch.isfinite(v)).any(-1).repeat_interleave(g, dim=1)  # (B, H, L)
    return (~torch.isfinite(q)).any(-1) | (sees.to(q.device) & bad_tok[:, :, None, :]).any(-1)


def test_quantizer_marks_a_nonfinite_token_and_leaves_the_others_alone():
    _, k, _ = _qkv(1, 2, 2, 1, 6, 64)
    clean_codes, clean_scale = quantize_per_token(k)
    k[0, 0, 2, 5], k[0, 1, 4, 0] = float("nan"), float("-inf")
    codes, scale = quantize_per_token(k)
    bad = torch.zeros(1, 2, 6, dtype=torch.bool)
    bad[0, 0, 2] = bad[0, 1, 4] = True
    assert scale[bad].isnan().all() and torch.equal(scale[~bad], clean_scale[~bad])
    assert torch.equal(codes[~bad], clean_codes[~bad])
    zero_code = 128  # the code of 0.0: floor(127.5 + 0.5); a NaN never reaches the integer conversion (undefined)
    assert codes[0, 0, 2, 5] == zero_code and codes[0, 1, 4, 0] == zero_code
    kd, _ = quantize_kv_cache(k, k).dequantize()
    assert kd[bad].isnan().all() and kd[~bad].isfinite().all()


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=needs_kernels)])
@pytest.mark.parametrize("causal", [True, False])
def test_decode_nan_reaches_exactly_the_rows_that_see_it(monkeypatch, impl, causal):
    """A NaN key/value late in the cache, an inf value early in another head, a NaN query row: those rows are NaN,
    every other row equals attention with the bad values as zeros (once, this gave NaN or garbage elsewhere)."""
    from thrifty.kv import decode_kernel
    monkeypatch.setitem(decode_kernel._INTERPRET_CONFIG, "target_programs", 4)  # several splits
    q, k, v = _qkv(2, 4, 2, 3, 45, 64)
    k[0, 0, 43, 7] = float("nan")     # seen only by the last 2 query rows when causal
    v[0, 1, 44, 3] = float("nan")     # the last token: p = 0 for the other rows, and 0·NaN is NaN
    v[1, 1, 3, 0] = float("inf")      # seen by every row of heads 2, 3 of sequence 1
    q[1, 0, 1, 9] = float("-inf")
    cache = quantize_kv_cache(k, v)
    out = decode_attention(q, cache, causal=causal, impl=impl)
    bad = _rows_that_see(q, k, v, causal)
    assert bad.any() and (~bad).any()
    assert out[bad].isnan().all(), "a row that sees NaN/inf is not NaN"
    assert out[~bad].isfinite().all(), "NaN/inf leaked into a row that sees none"
    zero = lambda x: torch.where(torch.isfinite(x), x, 0.0)  # noqa: E731
    clean = quantize_kv_cache(zero(k), zero(v))
    ref = decode_attention_reference(zero(q), clean, causal=causal, dtype=torch.float64)
    assert (out[~bad].double() - ref[~bad]).abs().max() < 2e-3


@needs_kernels
def test_append_kernel_marks_nonfinite_tokens_like_the_torch_quantizer():
    from thrifty.kv.decode_kernel import append_triton
    _, k, v = _qkv(1, 2, 2, 1, 7, 64)
    k[0, 1, 3, 2], v[0, 0, 6, 63] = float("nan"), float("inf")
    ref = QuantizedKV.empty(1, 2, 8, 64)
    ref._append_torch(k, v, 7)
    fused = QuantizedKV.empty(1, 2, 8, 64)
    append_triton(fused, k, v)
    assert torch.equal(fused.k, ref.k) and torch.equal(fused.v, ref.v)
    for a, b in ((fused.k_scale, ref.k_scale), (fused.v_scale, ref.v_scale)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert ref.k_scale[0, 1, 3].isnan() and ref.v_scale[0, 0, 6].isnan()


@pytest.mark.parametrize("make, match", [
    (lambda: decode_attention(torch.randn(1, 0, 1, 64), quantize_kv_cache(torch.randn(1, 2, 4, 64),
                                                                           torch.randn(1, 2, 4, 64))), "q"),
    (lambda: decode_attention(torch.randn(1, 2, 1, 64), quantize_kv_cache(torch.randn(1, 2, 4, 64),
                                                                           torch.randn(1, 2, 4, 64)),
                              sm_scale=float("nan")), "sm_scale"),
    (lambda: decode_attention(torch.randn(1, 2, 1, 64), QuantizedKV.empty(1, 2, 4, 64)), "cache"),  # no tokens
    (lambda: quantize_kv_cache(torch.randn(0, 2, 4, 64), torch.randn(0, 2, 4, 64)), "k"),
    (lambda: quantize_kv_cache(torch.randn(1, 2, 4, 0), torch.randn(1, 2, 4, 0)), "k"),
    (lambda: QuantizedKV(*(torch.zeros(1, 0, 4, 8, dtype=torch.uint8), torch.ones(1, 0, 4)) * 2, 0), "k"),
])
def test_decode_degenerate_sizes_and_bad_scale_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()
