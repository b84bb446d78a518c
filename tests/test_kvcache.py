"""ShadowKV: the reference algorithm, the cache in transformers and in the reference model, bad input."""

import math

import pytest
import torch

from thrifty.kvcache import ShadowKVCache, ShadowKVConfig
from thrifty.kvcache import reference as ref


def rope_table(T, D, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    f = torch.arange(T, dtype=torch.float64)[:, None] * inv
    emb = torch.cat((f, f), -1)
    return emb.cos().float(), emb.sin().float()


def ragged_batch(lengths, H=2, G=3, D=6, seed=0):
    """Post-RoPE keys/values of a batch of prompts, token t at index t; padding rows filled with garbage."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    k_pre = torch.randn(B, H, T, D, generator=g)
    v = torch.randn(B, H, T, D, generator=g)
    cos, sin = rope_table(T + 64, D)
    k_post = ref.apply_rope(k_pre, cos[:T], sin[:T])
    q = torch.randn(B, H * G, 1, D, generator=g)
    return k_post, v, q, torch.tensor(lengths), cos, sin


def small_config(**kw):
    base = dict(rank=12, chunk_size=4, sparse_budget=8, outlier_chunks=2, local_chunks=2, min_prompt_len=16)
    base.update(kw)
    return ShadowKVConfig(**base)


# ----------------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("kw, arg", [
    (dict(sparse_budget=4, chunk_size=8), "sparse_budget"),
    (dict(sparse_budget=20, chunk_size=8), "sparse_budget"),
    (dict(rank=0), "rank"),
    (dict(chunk_size=-1), "chunk_size"),
    (dict(outlier_chunks=-2), "outlier_chunks"),
    (dict(host_values="int4"), "host_values"),
    (dict(selector="h2o"), "selector"),
    (dict(max_generated=0), "max_generated"),
    (dict(radius_weight=-0.5), "radius_weight"),
    (dict(radius_weight=float("nan")), "radius_weight"),
])
def test_bad_config_names_the_argument(kw, arg):
    with pytest.raises(ValueError, match=arg):
        ShadowKVConfig(**kw)


def test_config_types_and_defaults():
    c = ShadowKVConfig()
    assert (c.rank, c.chunk_size, c.sparse_budget, c.outlier_chunks, c.local_chunks) == (160, 8, 2048, 96, 4)
    # the library's measured departures from the paper: the radius term, half the outliers by the window
    assert (c.radius_weight, c.outlier_window_share, c.outlier_radius_share, c.observation_window) == (0.5, 0.5, 0.0, 32)
    with pytest.raises(TypeError, match="rank"):
        ShadowKVConfig(rank=16.0)
    with pytest.raises(ValueError, match="rank"):
        c.check_model(kv_heads=1, head_dim=64)


# ----------------------------------------------------------------------------------------------- reference

def test_full_budget_full_rank_equals_dense_attention_ragged():
    lengths = [37, 61, 50]
    k, v, q, L, cos, sin = ragged_batch(lengths)
    cfg = small_config(rank=12, sparse_budget=64)  # 2 heads x 6 = full rank; budget covers every chunk
    st = ref.compress_prompt(k, v, L, cos[:61], sin[:61], cfg)
    out = ref.decode_step(st, q, k[:, :, :1] * 0 + 0.5, v[:, :, :1] * 0 + 0.25, cfg, cos, sin, 0.4)
    # dense: the prompt then the one generated token
    kd = torch.cat((k, torch.zeros_like(k[:, :, :1])), 2)
    vd = torch.cat((v, torch.zeros_like(v[:, :, :1])), 2)
    for b, n in enumerate(lengths):
        kd[b, :, n], vd[b, :, n] = 0.5, 0.25
    want = ref.dense_attention(q, kd, vd, L + 1, 0.4)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_low_rank_error_falls_with_rank():
    torch.manual_seed(0)
    k = torch.randn(1, 2, 200, 16) @ torch.diag(torch.linspace(3, 0.1, 16))
    errs = []
    for r in (2, 8, 16, 32):
        u, sv = ref.low_rank_keys(k, torch.tensor([200]), r)
        errs.append(((u[:, None] @ sv - k).norm() / k.norm()).item())
    assert errs[0] > errs[1] > errs[2] > errs[3] and errs[3] < 1e-5, errs
    # the kept directions are those of torch's SVD (optimal): same error
    x = k[0].transpose(0, 1).reshape(200, 32)
    s = torch.linalg.svdvals(x)
    assert errs[1] == pytest.approx((s[8:].square().sum().sqrt() / s.square().sum().sqrt()).item(), rel=1e-4)


def test_unrope_is_exact():
    k, _, _, _, cos, sin = ragged_batch([40])
    torch.testing.assert_close(ref.apply_rope(ref.undo_rope(k, cos[:40], sin[:40]), cos[:40], sin[:40]), k)


def test_selection_picks_planted_chunks_per_kv_head_gqa():
    H, G, D, C = 2, 3, 8, 20
    lengths = [C * 4 + 8]
    k, v, _, L, cos, sin = ragged_batch(lengths, H=H, G=G, D=D)
    cfg = small_config(rank=8, outlier_chunks=0, sparse_budget=8)  # 2 chunks per KV head
    st = ref.compress_prompt(k, v, L, cos[:L[0]], sin[:L[0]], cfg)
    st.landmarks.mul_(0.01)
    planted = {0: (3, 17), 1: (5, 11)}
    q = torch.zeros(1, H * G, 1, D)
    for h, chunks in planted.items():
        for j, c in enumerate(chunks):
            st.landmarks[0, h, c] = 0.0
            st.landmarks[0, h, c, j] = 50.0  # each chunk lights up in a different query head of the group
            q[0, h * G + j, 0, j] = 1.0
    ids, picked = ref.select_chunks(q, st, cfg)
    assert picked.all()
    for h, chunks in planted.items():
        assert sorted(ids[0, h].tolist()) == sorted(chunks)


def test_quest_selector_picks_planted_chunk():
    k, v, q, L, cos, sin = ragged_batch([90], H=1, G=2, D=4)
    k[0, 0, 40:44] = q[0, 0, 0] * 30  # chunk 10: keys aligned with the first query head
    cfg = small_config(selector="quest", sparse_budget=4, outlier_chunks=0, rank=4)
    st = ref.compress_prompt(k, v, L, cos[:90], sin[:90], cfg)
    ids, _ = ref.select_chunks(q, st, cfg)
    assert 10 in ids[0, 0].tolist()
    assert st.u is None and st.keys_exact is not None


def test_outliers_are_the_least_similar_chunks():
    k, v, q, L, cos, sin = ragged_batch([64], H=1, D=4)
    k[0, 0, :] = k[0, 0, :1]  # every key equal: cosine 1 everywhere ...
    k[0, 0, 21] = -k[0, 0, 21]  # ... but chunk 5 holds one opposite key
    cfg = small_config(outlier_chunks=1, rank=4)
    st = ref.compress_prompt(k, v, L, cos[:64], sin[:64], cfg)
    assert st.outlier_ids[0, 0].tolist() == [5]
    assert not st.selectable[0, 0, 5]


def test_a_share_of_the_outliers_goes_to_the_widest_chunks():
    """outlier_radius_share: the min-cosine rule takes its share, the chunks of the largest radius among the rest
    take the others (chunk 5: one opposite key, lowest cosine; chunk 9: every key scaled apart, cosine 1 but the
    widest); with one outlier, share 0 is the min-cosine rule alone and share 1 the radius alone; the exact
    tokens follow the ids."""
    k, v, q, L, cos, sin = ragged_batch([64], H=1, D=4)
    k[0, 0, :] = k[0, 0, :1]
    k[0, 0, 21] = -k[0, 0, 21]  # chunk 5 (chunk_size 4)
    k[0, 0, 36:40] *= torch.tensor([1.0, 9.0, 1.0, 9.0])[:, None]  # chunk 9: same direction, far from its mean
    st = ref.compress_prompt(k, v, L, cos[:64], sin[:64], small_config(outlier_chunks=2, rank=4,
                                                                       outlier_radius_share=0.5,
                                                                       outlier_window_share=0.0))
    assert st.outlier_ids[0, 0].tolist() == [5, 9]
    assert not st.selectable[0, 0, 5] and not st.selectable[0, 0, 9]
    assert torch.equal(st.dense_k[0, 0, 4:8], k[0, 0, 36:40])  # (k is post-RoPE, as the cache gets it)
    for share, want in ((0.0, [5]), (1.0, [9])):  # one outlier: min cosine alone, radius alone
        one = ref.compress_prompt(k, v, L, cos[:64], sin[:64], small_config(outlier_chunks=1, rank=4,
                                                                            outlier_radius_share=share,
                                                                            outlier_window_share=0.0))
        assert one.outlier_ids[0, 0].tolist() == want, share
    with pytest.raises(ValueError, match="outlier_radius_share"):
        small_config(outlier_radius_share=1.5)


def test_reuse_buffer_equals_no_reuse_over_steps():
    k, v, q, L, cos, sin = ragged_batch([120, 97], H=2, G=2, D=6)
    cfg = small_config(rank=8, sparse_budget=16)
    st = ref.compress_prompt(k, v, L, cos[:120], sin[:120], cfg)
    buf = ref.ChunkReuseBuffer()
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        qs = q + 0.3 * step * torch.randn(q.shape, generator=g)
        ids, picked = ref.select_chunks(qs, st, cfg)
        pos = ref.chunk_positions(ids, cfg.chunk_size)
        want_k = ref.rebuild_keys(st, pos, cos, sin)
        want_v = st.values.gather(pos)
        got_k, got_v = buf.step(st, ids, picked, cfg.chunk_size, cos, sin)
        m = picked[..., None].expand(-1, -1, -1, cfg.chunk_size).flatten(2)
        torch.testing.assert_close(got_k[m], want_k[m])
        torch.testing.assert_close(got_v[m], want_v[m])
    assert buf.kept > 0 and buf.moved > 0


def test_fp8_host_values_halve_bytes_and_stay_close():
    k, v, q, L, cos, sin = ragged_batch([80], D=32)
    v = v.bfloat16()
    native = ref.HostValues.store(v, "native", torch.device("cpu"))
    fp8 = ref.HostValues.store(v, "fp8", torch.device("cpu"))
    pos = torch.arange(80)[None, None].expand(1, 2, 80)
    err = (fp8.gather(pos).float() - v.float()).norm() / v.float().norm()
    assert err < 0.05
    assert fp8.bytes_per_sequence() < 0.6 * native.bytes_per_sequence()
    assert ref.host_bytes_per_sequence(32, 8, 128, 124928, 2, fp8=False) == 8_187_281_408  # the 8.2 GB


# ----------------------------------------------------------------------------------------------- transformers

@pytest.fixture(scope="module")
def hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def _greedy(model, ids, mask, cache=None, n=6):
    kw = dict(past_key_values=cache) if cache is not None else {}
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, **kw)[:, ids.shape[1]:]


def test_hf_full_budget_matches_dense_greedy_mixed_lengths(hf_model):
    ids = torch.randint(0, 101, (3, 70), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :13] = 0  # left padding: prompts of 70, 57 and 41 tokens
    mask[2, :29] = 0
    dense = _greedy(hf_model, ids, mask)
    cache = ShadowKVCache(hf_model, small_config(rank=32, sparse_budget=400, min_prompt_len=20))
    out = _greedy(hf_model, ids, mask, cache)
    assert not cache.dense and cache.engine.stats["reference_steps"] > 0
    assert cache.engine.states[0].lengths.tolist() == [70, 57, 41]
    assert torch.equal(out, dense)
    # the attention switch stays on the model: a plain generate afterwards is still dense SDPA
    assert torch.equal(_greedy(hf_model, ids, mask), dense)


def test_hf_small_budget_runs_and_reports_host_bytes(hf_model):
    ids = torch.randint(0, 101, (2, 90), generator=torch.Generator().manual_seed(1))
    cache = ShadowKVCache(hf_model, small_config(rank=8, sparse_budget=8, min_prompt_len=20, host_values="fp8"))
    out = _greedy(hf_model, ids, torch.ones_like(ids), cache, n=4)
    assert out.shape == (2, 4) and cache.engine.stats["reference_steps"] == 2 * 3
    assert cache.host_bytes_per_sequence() == 2 * 2 * 90 * (16 + 4)  # layers * heads * tokens * (fp8 + scale)


def test_hf_short_prompt_stays_dense(hf_model):
    ids = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(2))
    cache = ShadowKVCache(hf_model, small_config(min_prompt_len=64))
    out = _greedy(hf_model, ids, torch.ones_like(ids), cache)
    assert cache.dense and cache.engine.stats["reference_steps"] == 0
    assert torch.equal(out, _greedy(hf_model, ids, torch.ones_like(ids)))


def test_hf_rank_too_large_is_refused(hf_model):
    with pytest.raises(ValueError, match="rank"):
        ShadowKVCache(hf_model, small_config(rank=33))  # 2 KV heads x 16
    with pytest.raises(TypeError, match="config"):
        ShadowKVCache(hf_model, {"rank": 8})


def test_max_generated_and_multi_token_steps_are_refused(hf_model):
    ids = torch.randint(0, 101, (1, 40), generator=torch.Generator().manual_seed(3))
    cache = ShadowKVCache(hf_model, small_config(min_prompt_len=20, max_generated=2))
    with pytest.raises(ValueError, match="max_generated"):
        _greedy(hf_model, ids, torch.ones_like(ids), cache, n=5)
    cache = ShadowKVCache(hf_model, small_config(min_prompt_len=20))
    with torch.no_grad():
        hf_model(input_ids=ids, past_key_values=cache)
        with pytest.raises(ValueError, match="one token per step"):
            hf_model(input_ids=ids[:, :3], past_key_values=cache)


# ----------------------------------------------------------------------------------------------- reference model

def test_reference_model_seam_full_budget_matches_dense():
    from thrifty.models import LlamaForCausalLM, generate, preset

    torch.manual_seed(0)
    model = LlamaForCausalLM(preset("tiny", vocab_size=97)).init_weights(std=0.2, seed=0).eval()
    ids = torch.randint(0, 97, (2, 75), generator=torch.Generator().manual_seed(4))
    dense = generate(model, ids, 6)
    caches = []

    def factory():
        caches.append(ShadowKVCache(model, small_config(rank=64, sparse_budget=400, min_prompt_len=20)))
        return caches[-1]

    out = generate(model, ids, 6, cache_factory=factory)
    assert type(caches[0]).__name__ == "ThriftyModelShadowKVCache"
    assert caches[0].engine.stats["reference_steps"] == 6 * 2  # generate also runs the step after the last token
    assert torch.equal(out, dense)
    assert torch.equal(generate(model, ids, 6), dense)  # the seam falls back to the model's attention


# ----------------------------------------------------------------------------------------------- passkey task

def test_passkey_task_layout_and_errors(hf_model):
    import random

    from thrifty.kvcache.needle import evaluate_passkey, make_passkey_task, needle_text

    encode = lambda s: [ord(ch) % 101 for ch in s]  # noqa: E731
    filler = [i % 101 for i in range(500)]
    task = make_passkey_task(encode, filler, 300, 0.5, random.Random(0))
    ids = task.input_ids[0].tolist()
    assert len(ids) == 300
    needle = encode(needle_text(task.key))
    starts = [i for i in range(300) if ids[i:i + len(needle)] == needle]
    assert len(starts) == 1 and 100 < starts[0] < 200
    with pytest.raises(ValueError, match="length"):
        make_passkey_task(encode, filler, 50, 0.5, random.Random(0))
    with pytest.raises(ValueError, match="depth"):
        make_passkey_task(encode, filler, 300, 1.5, random.Random(0))
    decode = lambda ids: "".join(str(i % 10) for i in ids)  # noqa: E731
    rows = evaluate_passkey(hf_model, encode, decode, filler, [240], [0.1], 1,
                            {"dense": None, "shadowkv": small_config(min_prompt_len=64, max_generated=16)})
    assert [r["method"] for r in rows] == ["dense", "shadowkv"] and all(0 <= r["accuracy"] <= 1 for r in rows)


# ----------------------------------------------------------------------------------- found by the fuzz suite

def _engine(cfg, H, D):
    from thrifty.kvcache import ShadowKVEngine

    eng = ShadowKVEngine(cfg, 1, H, D, lambda T, dev: rope_table(T, D))
    eng.impl = "reference"
    return eng


def test_nan_query_head_leaves_its_group_alone():
    k, v, q, L, cos, sin = ragged_batch([40], H=2, G=3, D=6)
    cfg = small_config(sparse_budget=8)  # a real selection: 2 of 8 chunks
    outs = []
    for poison in (False, True):
        eng = _engine(cfg, 2, 6)
        eng.prefill(0, k, v, L)
        qq = q.clone()
        if poison:
            qq[0, 1, 0, 0] = math.nan  # query head 1 (KV head 0's group): it used to void the group's picks
        else:
            qq[0, 1] = qq[0, 0]  # head 1 adds nothing to the group's max: the picks of heads 0 and 2 alone
        outs.append(eng.decode(0, qq, k[:, :, :1], v[:, :, :1], 0.4))
    assert outs[1][0, 1].isnan().all()
    keep = [0, 2, 3, 4, 5]  # the other heads, those of the same group included, pick and attend on their own
    assert torch.equal(outs[1][0, keep], outs[0][0, keep])


def test_nan_padding_and_prompts_shorter_than_a_chunk():
    k, v, q, L, cos, sin = ragged_batch([1, 9], H=1, G=1, D=4)
    k[0, :, 1:], v[0, :, 1:] = math.nan, math.nan  # padding rows: never read (a 0-weight pick read them)
    for lengths, cfg in (([1, 9], small_config(rank=4, sparse_budget=12)),
                         ([1], small_config(rank=4, chunk_size=4, sparse_budget=4, local_chunks=0))):
        B, T = len(lengths), max(lengths)
        eng = _engine(cfg, 1, 4)
        eng.prefill(0, k[:B, :, :T], v[:B, :, :T], torch.tensor(lengths))  # T = 1 < chunk_size used to crash
        out = eng.decode(0, q[:B], k[:B, :, :1], v[:B, :, :1], 0.5)
        assert out.isfinite().all()


def test_non_finite_prompt_key_empty_prompt_and_bad_model_are_refused():
    k, v, q, L, cos, sin = ragged_batch([12], H=1, G=1, D=4)
    k[0, 0, 5, 2] = math.inf
    with pytest.raises(ValueError, match="keys"):  # eigh used to fail to converge (or spread NaN to all heads)
        _engine(small_config(rank=4), 1, 4).prefill(0, k, v, L)
    with pytest.raises(ValueError, match="k_post"):
        _engine(small_config(rank=4), 1, 4).prefill(0, k[:, :, :0], v[:, :, :0], torch.tensor([0]))
    for model in (None, torch.nn.Linear(2, 2)):
        with pytest.raises(TypeError, match="model"):
            ShadowKVCache(model, small_config())


def test_hf_quantized_attention_survives_a_shadowkv_generate(hf_model):
    import copy

    from thrifty.attention import SageConfig, enable_hf

    model = copy.deepcopy(hf_model)
    ids = torch.randint(0, 101, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        exact = model(ids).logits
        enable_hf(model, config=SageConfig(qk_bits=4))
        quantized = model(ids).logits
    assert not torch.equal(quantized, exact)
    cache = ShadowKVCache(model, small_config(rank=32, sparse_budget=400, min_prompt_len=20))
    _greedy(model, ids, torch.ones_like(ids), cache)
    assert not cache.dense and cache.engine.stats["reference_steps"] > 0
    with torch.no_grad():  # the calls ShadowKV does not take still run quantized attention, not plain SDPA
        assert torch.equal(model(ids).logits, quantized)


# ----------------------------------------------------------------------------- RULER-style rows, shared compression

def _toy_codec():
    encode = lambda s: [ord(ch) % 100 + 1 for ch in s]  # noqa: E731  (never 0: the filler's separator)
    return encode, [(7 * i + 3) % 101 for i in range(3000)]


def test_fork_decodes_like_a_fresh_cache_and_checks_its_config(hf_model):
    from thrifty.kvcache.needle import dense_prefill, greedy_steps

    ids = torch.randint(0, 101, (2, 90), generator=torch.Generator().manual_seed(3))
    kv = dense_prefill(hf_model, ids[:, :-1], batch=1)  # two sub-batches, concatenated
    base = ShadowKVCache(hf_model, small_config(rank=20, sparse_budget=8, min_prompt_len=16))
    base.load_prompt(kv)
    for budget in (8, 16):
        cfg = small_config(rank=20, sparse_budget=budget, min_prompt_len=16)
        fresh = ShadowKVCache(hf_model, cfg)
        fresh.load_prompt(kv)
        want = greedy_steps(hf_model, fresh, ids[:, -1:], 5)
        got = greedy_steps(hf_model, base.fork(hf_model, cfg), ids[:, -1:], 5)
        assert torch.equal(got, want)
    assert base.engine.generated(0) == 0 and base.engine.states[0].gen_k.shape[2] == 0  # the source is untouched
    with pytest.raises(ValueError, match="rank"):
        base.fork(hf_model, small_config(rank=12, min_prompt_len=16))
    with pytest.raises(ValueError, match="selector"):
        base.fork(hf_model, small_config(rank=20, min_prompt_len=16, selector="quest"))
    used = ShadowKVCache(hf_model, small_config(rank=20, min_prompt_len=16))
    used.load_prompt(kv)
    greedy_steps(hf_model, used, ids[:, -1:], 1)
    with pytest.raises(ValueError, match="already decoded"):
        used.fork(hf_model, small_config(rank=20, min_prompt_len=16))
    with pytest.raises(ValueError, match="no compressed prompt"):
        ShadowKVCache(hf_model, small_config(rank=20)).fork(hf_model, small_config(rank=20))


def test_needle_tasks_layout():
    import random

    from thrifty.kvcache.needle import make_needle_task

    encode, filler = _toy_codec()
    rng = random.Random(0)
    for kind in ("single", "multikey", "multivalue"):
        for depth in (0.0, 0.3, 1.0):
            t = make_needle_task(kind, encode, filler, 600, depth, rng, keys=3, values=3, filler_sub=5)
            ids = t.input_ids[0].tolist()
            assert len(ids) == 600 and t.kind == kind and 0 not in ids  # filler_sub replaced the separator
            assert len(t.answers) == (3 if kind == "multivalue" else 1) and len(set(t.answers)) == len(t.answers)
            for a in t.answers:
                assert _find(ids, encode(f" {a}.")), (kind, a)
            # the asked needle sits at ``depth`` of the filler (the frame is ~100 tokens here)
            first = min(_find(ids, encode(f" {t.answers[0]}.")))
            assert abs(first / 600 - depth) < 0.35, (kind, depth, first)
    with pytest.raises(ValueError, match="kind"):
        make_needle_task("twokeys", encode, filler, 600, 0.5, rng)
    with pytest.raises(ValueError, match="length"):
        make_needle_task("multikey", encode, filler, 120, 0.5, rng)


def _find(ids, pat):
    return [i for i in range(len(ids) - len(pat) + 1) if ids[i:i + len(pat)] == pat]


def test_score_answer():
    from thrifty.kvcache.needle import NeedleTask, score_answer

    one = NeedleTask("single", torch.zeros(1, 1), ["12345"], 1, 0.5)
    assert score_answer(" 12345.", one) == 1.0
    assert score_answer(" 1234.", one) == 0.0 and score_answer(" the 12345", one) == 1.0
    assert score_answer(" 7, 12345", one) == 0.0 and score_answer("", one) == 0.0
    mv = NeedleTask("multivalue", torch.zeros(1, 1), ["11111", "22222"], 1, 0.5)
    assert score_answer(" 22222 and 11111", mv) == 1.0 and score_answer(" 22222, 3", mv) == 0.5
    assert score_answer(" 222223", mv) == 0.0


def test_evaluate_batch_full_budget_matches_dense_and_small_budget_runs(hf_model):
    import random

    from thrifty.kvcache.needle import evaluate_batch, make_needle_task

    encode, filler = _toy_codec()
    rng = random.Random(1)
    tasks = [make_needle_task("single", encode, filler, 300, 0.5, rng) for _ in range(3)]
    seen = []
    decode = lambda ids: seen.append(list(ids)) or "".join(str(i % 10) for i in ids)  # noqa: E731
    methods = {"dense": None,
               "full": small_config(rank=32, sparse_budget=400, max_generated=16, min_prompt_len=1),  # everything
               "small": small_config(rank=32, sparse_budget=8, max_generated=16, min_prompt_len=1),
               "quest": small_config(rank=32, sparse_budget=8, max_generated=16, selector="quest")}
    timings = {}
    scores = evaluate_batch(hf_model, tasks, methods, decode, prefill_batch=2, timings=timings)
    assert list(scores) == list(methods) and all(len(s) == 3 for s in scores.values())
    dense, full = seen[0:3], seen[3:6]
    assert dense == full and len(dense[0]) == 8  # 7 steps per answer + 1
    assert scores["dense"] == scores["full"]
    assert timings["decode_steps"] == 4 * 8 and timings["prefill_s"] > 0
    with pytest.raises(ValueError, match="one prompt length"):
        evaluate_batch(hf_model, tasks[:1] + [make_needle_task("single", encode, filler, 310, 0.5, rng)],
                       methods, decode)


# ----------------------------------------------------------------------------------------------- observation window

def test_window_config_is_checked():
    with pytest.raises(ValueError, match="outlier_window_share"):
        small_config(outlier_window_share=0.6, outlier_radius_share=0.5)  # the shares split one set of chunks
    with pytest.raises(ValueError, match="outlier_window_share"):
        small_config(outlier_window_share=-0.1)
    with pytest.raises(ValueError, match="observation_window"):
        small_config(observation_window=0)
    small_config(outlier_window_share=0.5, outlier_radius_share=0.5)  # all by the two rules: fine


@pytest.mark.parametrize("block", [16384, 37, 5])
def test_window_mass_is_the_causal_softmax_mass_per_chunk(block):
    """Against float64: each window row (at lengths[b] - w + j) softmaxes over the keys up to its position,
    rows before position 0 count for nothing, the mass is summed over rows and the group, then per chunk."""
    g = torch.Generator().manual_seed(block)
    B, H, G, T, D, w, c = 3, 2, 3, 61, 8, 10, 4
    lengths = torch.tensor([61, 40, 7])  # the last one is shorter than the window
    k = torch.randn(B, H, T, D, generator=g)
    q = torch.randn(B, H * G, w, D, generator=g)
    C = -(-T // c)
    got = ref.window_mass(q, k, lengths, C, c, block=block)
    want = torch.zeros(B, H, C * c, dtype=torch.float64)
    for b in range(B):
        for h in range(H * G):
            for j in range(w):
                pos = int(lengths[b]) - w + j
                if pos < 0:
                    continue
                s = k[b, h // G, :pos + 1].double() @ q[b, h, j].double() / math.sqrt(D)
                want[b, h // G, :pos + 1] += s.softmax(0)
    want = want.view(B, H, C, c).sum(-1)
    assert torch.allclose(got.double(), want, atol=1e-5)
    assert torch.allclose(got.sum((1, 2)).double(), torch.tensor([G * H * w, G * H * w, G * H * 7.0]).double())


def test_a_share_of_the_outliers_goes_to_the_observation_window():
    """outlier_window_share: the min-cosine rule takes its share, the chunks the window's queries attend most
    among the rest the window's share, then the radius share (chunk 5: one opposite key, lowest cosine; chunk 9:
    the widest; chunk 12: four equal keys in a direction only the window's query looks at). Without the window's
    queries its share goes to the min-cosine rule."""
    k, v, q, L, cos, sin = ragged_batch([64], H=1, D=4)
    e = k[0, 0, 0].clone()
    k[0, 0, :] = e
    k[0, 0, 21] = -e  # chunk 5
    k[0, 0, 36:40] *= torch.tensor([1.0, 9.0, 1.0, 9.0])[:, None]  # chunk 9
    u = torch.randn(4, generator=torch.Generator().manual_seed(1))
    u = u - (u @ e) / (e @ e) * e  # orthogonal to every other key
    k[0, 0, 48:52] = u  # chunk 12
    window_q = (20.0 * u / u.norm()).expand(1, 3, 8, 4).clone()  # 3 query heads (G = 3), w = 8
    cfg = dict(rank=4, outlier_chunks=2, outlier_radius_share=0.0, outlier_window_share=0.5, observation_window=8)
    st = ref.compress_prompt(k, v, L, cos[:64], sin[:64], small_config(**cfg), window_q=window_q)
    assert st.outlier_ids[0, 0].tolist() == [5, 12]
    assert torch.equal(st.dense_k[0, 0, 4:8], k[0, 0, 48:52])
    three = dict(cfg, outlier_chunks=3, outlier_radius_share=1 / 3, outlier_window_share=1 / 3)
    st = ref.compress_prompt(k, v, L, cos[:64], sin[:64], small_config(**three), window_q=window_q)
    assert st.outlier_ids[0, 0].tolist() == [5, 12, 9]
    no_window = ref.compress_prompt(k, v, L, cos[:64], sin[:64], small_config(**cfg))
    as_cos = ref.compress_prompt(k, v, L, cos[:64], sin[:64], small_config(**dict(cfg, outlier_window_share=0.0)))
    assert torch.equal(no_window.outlier_ids, as_cos.outlier_ids)


def _capture_windows(monkeypatch):
    seen = []
    real = ref.compress_prompt

    def spy(*a, window_q=None, **kw):
        seen.append(window_q)
        return real(*a, window_q=window_q, **kw)

    monkeypatch.setattr(ref, "compress_prompt", spy)
    return seen


def test_hf_generate_hands_each_prompts_last_queries_to_the_compression(hf_model, monkeypatch):
    """On a transformers model the prefill's attention call passes the last w real queries of every prompt
    (left padding removed) to the compression: the queries of that prompt run alone."""
    from thrifty.kvcache.needle import dense_prefill

    ids = torch.randint(0, 101, (2, 60), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0  # left padding: 60 and 43 tokens
    seen = _capture_windows(monkeypatch)
    cfg = small_config(rank=16, sparse_budget=8, min_prompt_len=20, outlier_chunks=4, outlier_radius_share=0.25,
                       outlier_window_share=0.5, observation_window=6)
    _greedy(hf_model, ids, mask, ShadowKVCache(hf_model, cfg), n=3)
    assert len(seen) == 2 and all(q is not None and q.shape == (2, 4, 6, 16) for q in seen)
    for b, start in ((0, 0), (1, 17)):
        _, want = dense_prefill(hf_model, ids[b:b + 1, start:], window=6)
        for layer, q in enumerate(seen):
            assert torch.allclose(q[b:b + 1].float(), want[layer], atol=1e-4), (b, layer)


def test_reference_model_compresses_with_the_window_at_its_attention_call(monkeypatch):
    from thrifty.models import LlamaForCausalLM, generate, preset

    torch.manual_seed(0)
    model = LlamaForCausalLM(preset("tiny", vocab_size=97)).init_weights(std=0.2, seed=0).eval()
    ids = torch.randint(0, 97, (2, 75), generator=torch.Generator().manual_seed(4))
    dense = generate(model, ids, 4)
    seen = _capture_windows(monkeypatch)
    cfg = small_config(rank=64, sparse_budget=400, min_prompt_len=20, outlier_window_share=0.5,
                       outlier_radius_share=0.0, observation_window=5)
    out = generate(model, ids, 4, cache_factory=lambda: ShadowKVCache(model, cfg))
    heads, head_dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    assert len(seen) == model.config.num_hidden_layers
    assert all(q is not None and q.shape == (2, heads, 5, head_dim) for q in seen)
    assert torch.equal(out, dense)  # full budget: still dense attention


def test_load_prompt_window_queries_and_forks(hf_model):
    from thrifty.kvcache.needle import dense_prefill, greedy_steps

    ids = torch.randint(0, 101, (2, 90), generator=torch.Generator().manual_seed(3))
    kv, wq = dense_prefill(hf_model, ids[:, :-1], batch=1, window=8)
    assert len(wq) == 2 and wq[0].shape == (2, 4, 8, 16)
    cfg = small_config(rank=20, min_prompt_len=16, outlier_chunks=4, outlier_window_share=0.5,
                       outlier_radius_share=0.0, observation_window=8)
    base = ShadowKVCache(hf_model, cfg)
    base.load_prompt(kv, window_queries=wq)
    plain = ShadowKVCache(hf_model, cfg)
    plain.load_prompt(kv)  # no queries: the window's share goes to the min-cosine rule
    windowed = any(not torch.equal(a.outlier_ids, b.outlier_ids)
                   for a, b in zip(base.engine.states, plain.engine.states))
    assert windowed
    greedy_steps(hf_model, base.fork(hf_model, cfg), ids[:, -1:], 2)
    with pytest.raises(ValueError, match="outlier_window_share"):
        base.fork(hf_model, small_config(rank=20, min_prompt_len=16, outlier_chunks=4, outlier_window_share=0.0))
    with pytest.raises(ValueError, match="window_queries"):
        ShadowKVCache(hf_model, cfg).load_prompt(kv, window_queries=wq[:1])
    with pytest.raises(ValueError, match="window_queries"):
        ShadowKVCache(hf_model, cfg).load_prompt(kv, window_queries=[q[:1] for q in wq])


def test_needle_window_queries_never_exceed_a_short_prompt(hf_model, monkeypatch):
    """A prompt shorter than the observation window hands every one of its query rows to the compression (the
    window is the whole prompt), not a negative slice's tail."""
    from thrifty.kvcache import needle

    seen = []
    load = ShadowKVCache.load_prompt

    def spy(self, kv, lengths=None, window_queries=None):
        seen.append([q.shape[2] for q in window_queries])
        return load(self, kv, lengths, window_queries=window_queries)

    monkeypatch.setattr(ShadowKVCache, "load_prompt", spy)
    ids = torch.randint(0, 101, (1, 21), generator=torch.Generator().manual_seed(3))
    task = needle.NeedleTask(kind="single", input_ids=ids, answers=[12345], length=21, depth=0.5)
    cfg = small_config(outlier_window_share=0.5, observation_window=32)
    scores = needle.evaluate_batch(hf_model, [task], {"shadowkv": cfg}, decode=lambda ids: "")
    assert seen == [[20, 20]]  # 20 prefilled positions, 2 layers
    assert scores["shadowkv"] == [0.0]
