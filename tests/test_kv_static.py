"""StaticKVCache and generate(..., cuda_graph=True): the static cache gives the concatenating cache's results,
its graph-mode step (masked full buffer) gives eager decoding's tokens, refusals name their argument; marked
cuda, the captured graph itself (plain and packed BitNet models)."""

import pytest
import torch

from thrifty import bitnet
from thrifty.attention import sage_seam
from thrifty.kv import StaticKVCache
from thrifty.models import GraphedDecoder, KVCache, LlamaConfig, LlamaForCausalLM, generate
from thrifty.models.generate import _generate_static

from generation_checks import assert_greedy_up_to_near_ties


def tiny(seed=0, linear=None, activation=None, dtype=torch.float32):
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    kw = {} if linear is None else dict(linear=linear, activation=activation)
    return LlamaForCausalLM(cfg, **kw).init_weights(seed=seed).to(dtype).eval()


def ids(b=2, t=11, seed=0):
    return torch.randint(0, 97, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("t", [1, 11])
def test_static_cache_gives_the_concatenating_cache_logits(t):
    model, x = tiny(), ids(t=t)
    with torch.no_grad():
        plain, static = KVCache(), StaticKVCache(t + 4)
        for cache in (plain, static):
            model(x, cache=cache)
        step = ids(t=1, seed=1)
        a, b = model(step, cache=plain), model(step, cache=static)
    assert torch.allclose(a, b, atol=1e-6) and len(static) == t + 1
    assert static.keys[0].shape == (2, 2, t + 4, 16) and static.nbytes() == 2 * 2 * 2 * 2 * (t + 4) * 16 * 4


def test_graph_mode_steps_match_the_growing_cache_logits():
    """Step by step, one positions tensor advanced in place (as the graph's): the rotation follows it (a cache
    keyed on the tensor alone froze it at the first position, 1e-3 off from the second step)."""
    model, x, steps = tiny(), ids(), ids(t=5, seed=3)
    with torch.no_grad():
        plain, static = KVCache(), StaticKVCache(20)
        model(x, cache=plain)
        model(x, cache=static)
        static.graph_mode = True
        pos = torch.tensor([x.shape[1]])
        graphed = []
        for i in range(steps.shape[1]):  # no other forward in between, as in a replay loop
            graphed.append(model(steps[:, i: i + 1], positions=pos, cache=static))
            static.advance(1)
            pos.add_(1)
        for i in range(steps.shape[1]):
            assert torch.allclose(model(steps[:, i: i + 1], cache=plain), graphed[i], atol=1e-5), i


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_graph_mode_step_gives_eager_tokens(temperature):
    """The decode step that the graph records (masked full buffer, positions on the device), run eagerly on the
    CPU: the tokens of plain generate, greedy and sampled with the same generator."""
    model, x = tiny(), ids()
    g1, g2 = (torch.Generator().manual_seed(5) for _ in range(2))
    eager = generate(model, x, 9, temperature=temperature, generator=g1)
    static = _generate_static(model, x, 9, temperature, None, g2, capture=False)
    assert torch.equal(static, eager)


def test_graph_mode_step_reads_the_mask_through_sage_seam():
    model, x = tiny(), ids()
    model.set_attention(sage_seam(impl="reference"))
    eager = generate(model, x, 6)
    assert torch.equal(_generate_static(model, x, 6, 0.0, None, None, capture=False), eager)


def test_graph_mode_stops_where_eager_stops_at_eos():
    model, x = tiny(), ids(b=1)
    free = generate(model, x, 40)
    eos = int(free[0, x.shape[1] + 20])  # a token it produces on its own, late enough to pass a check point
    eager = generate(model, x, 40, eos_token_id=eos)
    assert eager.shape[1] < free.shape[1]
    assert torch.equal(_generate_static(model, x, 40, 0.0, eos, None, capture=False), eager)


def test_refusals_name_the_argument():
    model, x = tiny(), ids()
    with pytest.raises(ValueError, match="cuda_graph"):
        generate(model, x, 4, cuda_graph=True)  # CPU tensors
    with pytest.raises(TypeError, match="cuda_graph"):
        generate(model, x, 4, cuda_graph="yes")
    with pytest.raises(ValueError, match="cache_factory"):
        generate(model, x, 4, cuda_graph=True, cache_factory=KVCache)
    with pytest.raises(ValueError, match="capacity"):
        model(x, cache=StaticKVCache(5))
    cache = StaticKVCache(20)
    model(x, cache=cache)
    with pytest.raises(ValueError, match="input_ids"):
        model(ids(b=3, t=2), cache=cache)
    with pytest.raises(ValueError, match="capacity"):
        StaticKVCache(0)


def test_a_decoder_reused_across_calls_gives_eager_tokens_each_time():
    """One GraphedDecoder (its recorded step run eagerly on the CPU), three prompts of different lengths: each
    call's tokens are eager decoding's; the buffers are reused while the model stays, rebuilt once it changes."""
    model = tiny()
    decoder = GraphedDecoder(model, 2, 30, _capture=False)
    first_cache = None
    for t, n, seed in ((11, 9, 0), (4, 20, 1), (17, 6, 2)):
        x = ids(t=t, seed=seed)
        assert torch.equal(decoder.generate(x, n), generate(model, x, n)), (t, n)
        if first_cache is None:
            first_cache = decoder._state.cache
        assert decoder._state.cache is first_cache  # same buffers, so a captured graph stays valid
    model.to(torch.float64)  # every parameter moves: a graph over the old buffers would read freed memory
    x = ids(seed=3)
    assert torch.equal(decoder.generate(x, 5), generate(model, x, 5))
    assert decoder._state.cache is not first_cache
    decoder.release()
    assert decoder._state is None


def test_a_decoder_refuses_another_batch_or_too_long_a_call():
    decoder = GraphedDecoder(tiny(), 2, 16, _capture=False)
    with pytest.raises(ValueError, match="input_ids"):
        decoder.generate(ids(b=3), 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.generate(ids(t=11), 6)
    with pytest.raises(ValueError, match="capacity"):
        GraphedDecoder(tiny(), 2, 0)


def test_a_seam_without_the_mask_contract_is_refused():
    model = tiny()
    model.set_attention(lambda q, k, v, *, causal, scale: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    with pytest.raises(ValueError, match="reads_key_mask"):
        generate(model, ids(), 4, cuda_graph=True)


def test_update_with_query_is_rope_then_update_off_the_fast_path():
    """On the CPU (or with autograd) the static cache's query-and-keys entry point is the two plain calls."""
    model = tiny()
    rope = model.model.rotary
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 3, 16, generator=g), torch.randn(2, 2, 3, 16, generator=g), torch.randn(2, 2, 3, 16,
                                                                                                        generator=g)
    positions = torch.arange(3)
    fused, plain = StaticKVCache(8), StaticKVCache(8)
    got = fused.update_with_query(0, q, k, v, positions, rope)
    want = (rope(q, positions), *plain.update(0, k, v, positions, rope))
    assert fused.fused_updates == 0 and len(fused) == len(plain) == 3
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_static_cache_takes_the_one_launch_rope_and_write(dtype):
    """On CUDA the reference model's decode through a static cache rotates q and k and writes k/v in one launch
    per layer (counted), prefill and graph-mode steps alike, with the logits of the unfused calls bit for bit."""
    model = tiny(dtype=dtype).to("cuda")
    x = ids(t=9).to("cuda")
    fused = StaticKVCache(16)
    with torch.no_grad():
        got = [model(x, cache=fused)]
        step = x[:, -1:]
        for _ in range(3):
            got.append(model(step, cache=fused))
    assert fused.fused_updates == 4 * 2  # 4 forwards x 2 layers
    plain = StaticKVCache(16)
    plain.update_with_query = None  # the attention then takes rope + update, as a cache without the method
    with torch.no_grad():
        want = [model(x, cache=plain)]
        for _ in range(3):
            want.append(model(step, cache=plain))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_attends_through_the_masked_decode_kernel(dtype, monkeypatch):
    """head_dim 64 (the kernel's): every layer of every replayed step runs thrifty.kv's split-K decode kernel over
    the masked static buffer (counted), and the tokens are what the model ranks first, near-ties aside."""
    import torch.nn.functional as F

    import thrifty.kv.decode_kernel as DK

    calls, masked_sdpa = [], []
    real, real_sdpa = DK.masked_decode_attention, F.scaled_dot_product_attention
    monkeypatch.setattr(DK, "masked_decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: masked_sdpa.append(kw.get("attn_mask") is not None) or real_sdpa(*a, **kw))
    cfg = LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).init_weights(seed=0).to("cuda", dtype).eval()
    x = ids().to("cuda")
    out = generate(model, x, 12, cuda_graph=True)
    # every graph-mode call (warm-up and capture; the replays run what was recorded) took the kernel, none SDPA
    assert len(calls) >= cfg.num_hidden_layers and len(calls) % cfg.num_hidden_layers == 0
    assert not any(masked_sdpa)
    assert_greedy_up_to_near_ties(model, out, x.shape[1], rel_tol=1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["bf16", "stacked_a48"])
def test_cuda_graphed_decoder_captures_once_across_calls(kind):
    """Three calls of one decoder: one capture; each call's tokens are what the model ranks first (near-ties
    aside); a model change (here: its dtype) captures again."""
    if kind == "bf16":
        model = tiny(dtype=torch.bfloat16).to("cuda")
    else:
        model = bitnet.pack(tiny(linear=bitnet.linear_factory("a4.8"), activation=bitnet.mlp_activation("a4.8")))
        bitnet.stack_projections(model)
        model = model.to("cuda")
    decoder = GraphedDecoder(model, 2, 48)
    for t, n, seed in ((11, 20, 0), (5, 30, 1), (20, 12, 2)):
        x = ids(t=t, seed=seed).to("cuda")
        out = decoder.generate(x, n)
        assert out.shape == (2, t + n) and decoder.captures == 1
        assert_greedy_up_to_near_ties(model, out, t)
    if kind == "bf16":
        model.float()
        decoder.generate(ids().to("cuda"), 4)
        assert decoder.captures == 2


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["fp32", "bf16", "packed_b158", "packed_a48", "stacked_a48"])
def test_cuda_graph_generate_picks_what_the_model_predicts(kind, monkeypatch):
    """The captured decode step, replayed (counted), picks at every step the token that one eager forward over
    the whole generated sequence ranks first, up to a near-tie: on fp32 and bf16 models and on packed BitNet
    models (their Triton GEMV kernels inside the graph). Token-for-token equality with eager decoding is not
    asserted: the graph's attention reads a masked fixed-length buffer, and one rounding flip of a near-tie
    changes every later token."""
    import importlib

    gen_module = importlib.import_module("thrifty.models.generate")
    if kind in ("fp32", "bf16"):
        model = tiny(dtype=torch.float32 if kind == "fp32" else torch.bfloat16).to("cuda")
    else:
        recipe = "b1.58" if kind == "packed_b158" else "a4.8"
        model = bitnet.pack(tiny(linear=bitnet.linear_factory(recipe), activation=bitnet.mlp_activation(recipe)))
        if kind.startswith("stacked"):
            bitnet.stack_projections(model)
        model = model.to("cuda")
    x = ids().to("cuda")
    replays = []
    real = gen_module._capture

    def counting(step):
        graph, logits = real(step)
        return type("Counted", (), {"replay": lambda self: replays.append(1) or graph.replay()})(), logits

    monkeypatch.setattr(gen_module, "_capture", counting)
    out = generate(model, x, 24, cuda_graph=True)
    assert out.shape == (2, x.shape[1] + 24) and len(replays) == 23
    assert_greedy_up_to_near_ties(model, out, x.shape[1], rel_tol=1e-4 if kind == "fp32" else 2e-2)


@pytest.mark.cuda
def test_cuda_graph_generate_survives_a_collection_during_capture():
    """A CUDA graph held only by a reference cycle, made unreachable while the decode step is being captured:
    a collection there would destroy it and invalidate the capture, so none runs until the capture ends."""
    from test_graphs import make_unreachable_graph_garbage

    from thrifty.bench import capture_graph

    model = tiny(dtype=torch.bfloat16).to("cuda")
    scratch = torch.zeros(4, device="cuda")
    old = [capture_graph(lambda: scratch + 1, warmup=1)[0]]

    def make_garbage_while_capturing(module, args):
        if torch.cuda.is_current_stream_capturing() and old:
            make_unreachable_graph_garbage(old)

    model.register_forward_pre_hook(make_garbage_while_capturing)
    x = ids().to("cuda")
    out = generate(model, x, 8, cuda_graph=True)
    assert not old and out.shape == (2, x.shape[1] + 8)
    assert_greedy_up_to_near_ties(model, out, x.shape[1], rel_tol=2e-2)
