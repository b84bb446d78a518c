"""ShadowKV's Triton kernels against the reference and float64 (interpreter on the CPU, fresh random inputs, odd
sizes), the kernel path against the reference path over many decode steps (asserting the kernels ran), and
CUDA-graph capture of a step (GPU only)."""

import dataclasses

import pytest
import torch

from thrifty.bench import capture_graph
from thrifty.kv.decode_kernel import masked_decode_attention
from thrifty.kvcache import ShadowKVConfig, ShadowKVEngine
from thrifty.kvcache import reference as ref
from thrifty.kvcache.decode import fast_layer
from thrifty.kvcache.fill_kernel import fill_slots
from thrifty.kvcache.score_kernel import TUNING, SelectTuning, score_and_select

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rope_table(T, D):
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    emb = torch.arange(T, dtype=torch.float64)[:, None] * inv
    emb = torch.cat((emb, emb), -1)
    return emb.cos().float().to(DEV), emb.sin().float().to(DEV)


def make_state(lengths, H=3, D=32, cfg=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    k_pre = (torch.randn(B, H, T, D, generator=g) * torch.linspace(2, 0.1, D)).to(DEV)
    v = torch.randn(B, H, T, D, generator=g).to(DEV)
    cos, sin = rope_table(T + 64, D)
    k = ref.apply_rope(k_pre, cos[:T], sin[:T]).to(dtype)
    st = ref.compress_prompt(k, v.to(dtype), torch.tensor(lengths), cos[:T], sin[:T], cfg)
    return st, k, v.to(dtype), cos, sin


# Blocks of 16 and 16 coarse bins (one per octave: the clamped bin is reached): the select stage's multi-split,
# multi-block and many-candidate paths at interpreter sizes, and tail tiles of one entry per split (the tail's
# concatenation loops). The GPU's defaults see one block at these sizes.
# rank_block=1: the candidates go through the radix select (RANKED: pairwise ranks up to 16 candidates, as the
# GPU's default of 128 does at batch 1).
SMALL = SelectTuning(logit_block=16, score_block=16, select_block=16, hist_bins=16, hist_shift=23, tail_tile=16,
                     rank_block=1)
RANKED = dataclasses.replace(SMALL, rank_block=16)

CFG = ShadowKVConfig(rank=20, chunk_size=4, sparse_budget=20, outlier_chunks=2, local_chunks=2, min_prompt_len=16)


def f64_error_ok(got, ref_out, exact, slack):
    """The kernel's error against float64 is no worse than the fp32 reference's, plus ``slack``."""
    err_kernel = (got.double() - exact).abs().max().item()
    err_ref = (ref_out.double() - exact).abs().max().item()
    assert err_kernel <= 2 * err_ref + slack, (err_kernel, err_ref)


def select_engine(lengths, H, G, D, cfg, dtype, seed, tuning=None):
    st, k, v, cos, sin = make_state(lengths, H=H, D=D, cfg=cfg, dtype=dtype, seed=seed)
    e = ShadowKVEngine(cfg, 1, H, D, lambda n, dev: (cos[:n], sin[:n]))
    e.prefill(0, k, v, torch.tensor(lengths, device=DEV))
    e.impl = "triton"
    e.select_tuning = tuning
    return e, fast_layer(e, 0, G)


def top_k_lowest_ids(scores, K):
    """The K highest scores' chunk ids, ties to the lowest ids (the select kernel's rule), as a sorted set."""
    order = scores.sort(dim=-1, descending=True, stable=True).indices[..., :K]
    return order.sort(-1).values


def radius_args(st):
    """The chunk-radius arguments of a layer state, as the decode step passes them."""
    return dict(radius=st.radius, radius_weight=st.radius_weight)


def scores_f64(q, st):
    B, Hq, _, D = q.shape
    H = st.selectable.shape[1]
    qg = q[:, :, 0].double().view(B, H, Hq // H, D)
    lg = torch.einsum("bhgd,bhcd->bhgc", qg, st.landmarks.double())
    lg = (lg + st.radius_weight * qg.norm(dim=-1)[..., None] * st.radius.double()[:, :, None]) / D ** 0.5
    sel = st.selectable[:, :, None]
    p = lg.masked_fill(~sel, float("-inf")).softmax(-1)
    return torch.where(sel, p, -1.0).amax(2)


@pytest.mark.parametrize("dtype, G, lengths, K, tuning", [
    (torch.float32, 1, [157, 130], 7, None), (torch.float32, 3, [333], 13, None),
    (torch.bfloat16, 4, [211, 99], 5, None), (torch.float32, 3, [333], 13, SMALL),
    (torch.bfloat16, 4, [211, 99], 5, SMALL),
    (torch.float32, 2, [157, 30], 13, SMALL),  # the short sequence has fewer selectable chunks than K: -1 ties
    (torch.float32, 2, [157, 30], 13, None), (torch.float32, 3, [333], 13, RANKED),
    (torch.float32, 2, [157, 30], 13, RANKED)])
@pytest.mark.parametrize("radius_weight", [0.0, 0.5])
def test_score_and_select_matches_reference_and_topk(dtype, G, lengths, K, tuning, radius_weight):
    """The chunk scores (with and without the radius term) against the reference and float64, and the picks."""
    cfg = ShadowKVConfig(rank=20, chunk_size=4, sparse_budget=4 * K, outlier_chunks=2, local_chunks=2,
                         min_prompt_len=16, max_generated=8, radius_weight=radius_weight)
    H, D = 3, 32
    e, fl = select_engine(lengths, H, G, D, cfg, dtype, seed=G, tuning=tuning)
    st = e.states[0]
    g = torch.Generator().manual_seed(11 + G)
    q = (torch.randn(len(lengths), H * G, 1, D, generator=g) * 3).to(DEV, dtype)
    kn = torch.randn(len(lengths), H, 1, D, generator=g).to(DEV, dtype)
    vn = torch.randn(len(lengths), H, 1, D, generator=g).to(DEV, dtype)
    score_and_select(q, kn, vn, st.landmarks, st.selectable, D ** -0.5, fl, **radius_args(st))
    got = fl.scratch.scores
    want = ref.landmark_scores(q, st)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    f64_error_ok(got, want, scores_f64(q, st), 1e-6 if dtype == torch.float32 else 1e-2)
    assert (got[~st.selectable] == -1).all()
    # the selection is the top K of the scores (ties: lowest ids); every slot is filled at the first step;
    # slot_of inverts slot_ids
    assert torch.equal(fl.slot_ids.long().sort(-1).values, top_k_lowest_ids(got, K))
    assert_tail_path(fl, tuning)
    picked = st.selectable.gather(-1, fl.slot_ids.long())
    assert torch.equal(fl.work, torch.where(picked, fl.slot_ids, -1))
    for b in range(len(lengths)):
        for h in range(H):
            for s, chunk in enumerate(fl.slot_ids[b, h].tolist()):
                assert fl.slot_of[b, h, chunk] == s
            assert (fl.slot_of[b, h] >= 0).sum() == K
    # the new token sits in the first generated row, valid; slot rows valid where the pick is selectable
    assert torch.equal(fl.k[:, :, fl.gen_base], kn[:, :, 0].to(fl.k.dtype))
    assert torch.equal(fl.v[:, :, fl.gen_base], vn[:, :, 0].to(fl.v.dtype))
    assert fl.valid[:, :, fl.gen_base].all() and not fl.valid[:, :, fl.gen_base + 1].any()
    assert torch.equal(fl.valid[:, :, fl.sel_base:fl.gen_base], picked.repeat_interleave(4, -1))


def assert_tail_path(fl, tuning):
    """The tail took each head's candidates the way its tuning says: pairwise ranks when they fit rank_block
    (1), else the radix select (2)."""
    tu = tuning or TUNING
    counts = fl.scratch.counts.reshape(fl.scratch.tail_path.shape[0], -1, 4)[..., 1].sum(-1)
    want = torch.where(counts <= tu.rank_block, 1, 2).to(fl.scratch.tail_path.dtype)
    assert torch.equal(fl.scratch.tail_path, want), (fl.scratch.tail_path, counts)


@pytest.mark.parametrize("tuning", [None, SMALL, RANKED])
def test_select_breaks_ties_and_keeps_hits_in_place(tuning):
    cfg = ShadowKVConfig(rank=20, chunk_size=4, sparse_budget=24, outlier_chunks=1, local_chunks=1,
                         min_prompt_len=16, max_generated=8)
    H, G, D, K = 2, 2, 32, 6
    e, fl = select_engine([123], H, G, D, cfg, torch.float32, seed=5, tuning=tuning)
    st = e.states[0]
    st.landmarks[:, :, ::3] = st.landmarks[:, :, :1]  # a third of the chunks score exactly alike
    q = torch.randn(1, H * G, 1, D, generator=torch.Generator().manual_seed(1)).to(DEV) * 0.1
    kn = vn = torch.zeros(1, H, 1, D, device=DEV)
    score_and_select(q, kn, vn, st.landmarks, st.selectable, D ** -0.5, fl, **radius_args(st))
    scores = fl.scratch.scores
    ids = fl.slot_ids.long()
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()  # K distinct chunks
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True)
    assert (scores.masked_fill(~chosen, 2).amin(-1) >= scores.masked_fill(chosen, -2).amax(-1)).all()
    assert torch.equal(ids.sort(-1).values, top_k_lowest_ids(scores, K))
    assert_tail_path(fl, tuning)
    before = fl.slot_ids.clone()
    fl.n_generated += 1
    score_and_select(q, kn, vn, st.landmarks, st.selectable, D ** -0.5, fl, **radius_args(st))  # same query: all hits
    assert torch.equal(fl.slot_ids, before) and (fl.work == -1).all()
    q2 = q.clone()
    q2[:, :G] = torch.randn(1, G, 1, D, generator=torch.Generator().manual_seed(2)).to(DEV) * 4  # head 0 moves
    fl.n_generated += 1
    score_and_select(q2, kn, vn, st.landmarks, st.selectable, D ** -0.5, fl, **radius_args(st))
    now = fl.slot_ids
    kept = (now == before)
    assert kept[:, 1].all() and (fl.work[:, 1] == -1).all()  # head 1: same picks, same slots, no work
    new_set = set(now[0, 0].tolist())
    assert all(kept[0, 0, s] for s, c in enumerate(before[0, 0].tolist()) if c in new_set)  # hits stay put
    assert set(fl.work[0, 0][fl.work[0, 0] >= 0].tolist()) == new_set - set(before[0, 0].tolist())


def test_score_and_select_refuses_a_missing_or_malformed_radius():
    cfg = ShadowKVConfig(rank=20, chunk_size=4, sparse_budget=20, outlier_chunks=2, local_chunks=2, min_prompt_len=16,
                         max_generated=8)
    e, fl = select_engine([157], 3, 2, 32, cfg, torch.float32, seed=1)
    st = e.states[0]
    q = torch.randn(1, 6, 1, 32).to(DEV)
    kn = vn = torch.zeros(1, 3, 1, 32, device=DEV)
    for radius in (None, st.radius.double(), st.radius[..., :-1]):
        with pytest.raises(ValueError, match="radius"):
            score_and_select(q, kn, vn, st.landmarks, st.selectable, 32 ** -0.5, fl, radius=radius, radius_weight=0.5)


@pytest.mark.parametrize("tuning", [None, SMALL])
def test_select_ties_across_splits_and_clusters(tuning):
    """Adversarial selections over several steps, against a stable sort of the kernel's scores and against the
    reference's scores: ties straddling the threshold spread over every split (more candidates than a tail
    block), all picks clustered in a few splits (a long miss segment), K above the short sequence's selectable
    chunks, C not a multiple of any block; the slot maps stay each other's inverse and hits never move."""
    # no radius term: the ties are made on the landmarks alone (the radius path: the test above)
    cfg = ShadowKVConfig(rank=20, chunk_size=4, sparse_budget=4 * 21, outlier_chunks=2, local_chunks=1,
                         min_prompt_len=16, max_generated=8, radius_weight=0.0)
    H, G, D, K = 2, 1, 32, 21
    lengths = [515, 70]  # 127 and 16 chunks (16 - 3 selectable < K)
    e, fl = select_engine(lengths, H, G, D, cfg, torch.float32, seed=9, tuning=tuning)
    st = e.states[0]
    lm = st.landmarks
    lm[0, 0, 1::2] = lm[0, 0, :1]  # head 0: half the chunks alike (ties everywhere)
    lm[0, 1, 60:100] = lm[0, 1, 60:100] * 4  # head 1: the large scores in one stretch of chunks
    g = torch.Generator().manual_seed(4)
    q0 = torch.randn(2, H * G, 1, D, generator=g) * 0.5
    prev = None
    for step in range(3):
        q = (q0 + 0.3 * step * torch.randn(q0.shape, generator=g)).to(DEV)
        if step == 1:
            q[0, 0] = -q[0, 0]  # head 0 turns around: most picks change
        kn = vn = torch.zeros(2, H, 1, D, device=DEV)
        score_and_select(q, kn, vn, st.landmarks, st.selectable, D ** -0.5, fl, **radius_args(st))
        fl.n_generated += 1
        scores = fl.scratch.scores
        torch.testing.assert_close(scores, ref.landmark_scores(q, st), atol=1e-5, rtol=1e-5)
        ids = fl.slot_ids.long()
        assert torch.equal(ids.sort(-1).values, top_k_lowest_ids(scores, K)), step
        for b in range(2):
            for h in range(H):
                inv = torch.full((st.selectable.shape[-1],), -1, dtype=torch.int32, device=DEV)
                inv[fl.slot_ids[b, h].long()] = torch.arange(K, dtype=torch.int32, device=DEV)
                assert torch.equal(fl.slot_of[b, h], inv)
        picked = st.selectable.gather(-1, ids)
        assert torch.equal(fl.valid[:, :, fl.sel_base:fl.gen_base], picked.repeat_interleave(4, -1))
        if prev is not None:
            stay = (prev[..., :, None] == fl.slot_ids[..., None, :]).any(-1)  # the old chunk is still selected
            assert torch.equal(fl.slot_ids[stay], prev[stay])  # ... in the same slot
            new = ~stay & picked
            assert torch.equal(fl.work[new], fl.slot_ids[new]) and (fl.work[~new] == -1).all()
        prev = fl.slot_ids.clone()
    assert (scores[0, 0] == scores[0, 0, 1]).sum() > K  # the ties really straddled


@pytest.mark.parametrize("chunk_size, host", [(4, "native"), (8, "native"), (4, "fp8")])
def test_fill_kernel_matches_reference(chunk_size, host):
    cfg = ShadowKVConfig(rank=20, chunk_size=chunk_size, sparse_budget=5 * chunk_size, outlier_chunks=1,
                         local_chunks=1, min_prompt_len=16, host_values=host)
    st, _, _, cos, sin = make_state([150, 121], cfg=cfg, seed=chunk_size)
    B, H, K, c, D = 2, 3, 5, chunk_size, 32
    g = torch.Generator().manual_seed(3 + chunk_size)
    ids = torch.stack([torch.randperm(int(st.n_chunks.min()), generator=g)[:K] for _ in range(B * H)]).view(B, H, K)
    todo = torch.rand(B, H, K, generator=g) < 0.6
    work = torch.where(todo, ids, -1).to(DEV, torch.int32)
    k_out = torch.full((B, H, 7 + K * c + 3, D), 9.0, device=DEV)
    v_out = torch.full((B, H, 7 + K * c + 3, D), 9.0, device=DEV)
    fill_slots(work, st.u, st.sv, cos, sin, st.values.data, st.values.scale, k_out, v_out, 7, c)
    pos = ref.chunk_positions(ids.to(DEV), c)
    want_k = ref.rebuild_keys(st, pos, cos, sin).view(B, H, K, c, D)
    u64 = st.u.double().gather(1, pos.reshape(B, H * K * c, 1).expand(-1, -1, st.u.shape[-1])).view(B, H, K * c, -1)
    exact_k = ref.apply_rope(u64 @ st.sv.double(), cos[pos].double(), sin[pos].double()).view(B, H, K, c, D)
    want_v = st.values.gather(pos).view(B, H, K, c, D)
    k_slots = k_out[:, :, 7:7 + K * c].view(B, H, K, c, D)
    v_slots = v_out[:, :, 7:7 + K * c].view(B, H, K, c, D)
    torch.testing.assert_close(k_slots[todo], want_k[todo], atol=1e-4, rtol=1e-4)
    f64_error_ok(k_slots[todo], want_k[todo], exact_k[todo], 1e-5)
    torch.testing.assert_close(v_slots[todo], want_v[todo].float(), atol=1e-6, rtol=1e-6)
    assert (k_slots[~todo] == 9.0).all() and (v_slots[~todo] == 9.0).all()  # hits are not touched
    for out in (k_out, v_out):
        assert (out[:, :, :7] == 9.0).all() and (out[:, :, 7 + K * c:] == 9.0).all()


@pytest.mark.parametrize("G, N, splits, merge_block", [(1, 37, 3, 64), (3, 150, None, 64), (4, 333, None, 64),
                                                       (4, 333, 1, 64), (3, 333, None, 4)])  # 11 splits, 3 loads
def test_decode_attention_kernel_matches_reference(G, N, splits, merge_block):
    g = torch.Generator().manual_seed(G + N)
    B, H, D = 2, 3, 32
    q = torch.randn(B, H * G, 1, D, generator=g).to(DEV)
    k = torch.randn(B, H, N, D, generator=g).to(DEV) * 2
    v = torch.randn(B, H, N, D, generator=g).to(DEV)
    valid = (torch.rand(B, H, N, generator=g) < 0.7).to(DEV)
    valid[..., -1] = True
    k[~valid] = float("nan")  # stale or padding rows: whatever they hold must not leak
    v[~valid] = float("nan")
    got = masked_decode_attention(q, k, v, valid, 0.3, splits=splits, block_n=32, merge_block=merge_block)
    want = ref.attend(q, torch.where(valid[..., None], k, 0), torch.where(valid[..., None], v, 0), valid, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    kd, vd = (torch.where(valid[..., None], x, 0).double() for x in (k, v))
    s = torch.einsum("bhgd,bhnd->bhgn", q.double().view(B, H, G, D), kd) * 0.3
    exact = torch.einsum("bhgn,bhnd->bhgd", s.masked_fill(~valid[:, :, None], float("-inf")).softmax(-1), vd)
    f64_error_ok(got, want, exact.reshape(B, H * G, 1, D), 1e-5)  # fp32 online softmax over the splits


@pytest.mark.parametrize("G, N", [(1, 70), (2, 193)])
def test_decode_attention_kernel_takes_one_mask_for_the_batch(G, N):
    """The reference model's static cache hands one (capacity,) mask of written slots for every sequence and head:
    an expanded (stride 0) view of it gives exact attention over the written prefix, empty slots unread."""
    g = torch.Generator().manual_seed(G * 100 + N)
    B, H, D = 2, 3, 64
    q = torch.randn(B, H * G, 1, D, generator=g).to(DEV)
    k = torch.randn(B, H, N, D, generator=g).to(DEV)
    v = torch.randn(B, H, N, D, generator=g).to(DEV)
    written = N // 2 + 3
    mask = (torch.arange(N) < written).to(DEV)
    k[:, :, written:] = float("nan")  # empty slots: never read into the result
    v[:, :, written:] = float("nan")
    got = masked_decode_attention(q, k, v, mask.view(1, 1, N).expand(B, H, N), 0.125)
    kd, vd = k[:, :, :written].double(), v[:, :, :written].double()
    s = torch.einsum("bhgd,bhnd->bhgn", q.double().view(B, H, G, D), kd) * 0.125
    exact = torch.einsum("bhgn,bhnd->bhgd", s.softmax(-1), vd).reshape(B, H * G, 1, D)
    assert (got.double() - exact).abs().max().item() <= 1e-5


def _engines(cfg, lengths, H=2, G=3, D=32, seed=0):
    st, k, v, cos, sin = make_state(lengths, H=H, D=D, cfg=cfg, seed=seed)
    engines = []
    for impl in ("reference", "triton"):
        e = ShadowKVEngine(cfg, 1, H, D, lambda n, dev: (cos[:n], sin[:n]), impl=impl)
        e.prefill(0, k, v, torch.tensor(lengths, device=DEV))
        engines.append(e)
    return engines


@pytest.mark.parametrize("host", ["native", "fp8"])
def test_kernel_path_matches_reference_over_many_steps(host):
    """The public code's efficient and reference classes diverge from the first decode step; ours must not."""
    cfg = ShadowKVConfig(rank=24, chunk_size=4, sparse_budget=24, outlier_chunks=2, local_chunks=2,
                         min_prompt_len=16, max_generated=32, host_values=host)
    H, G, D = 2, 3, 32
    ref_e, fast_e = _engines(cfg, [211, 150], H=H, G=G, D=D)
    g = torch.Generator().manual_seed(7)
    q0 = torch.randn(2, H * G, 1, D, generator=g)
    misses = []
    for step in range(12):
        q = (q0 + 0.4 * torch.randn(q0.shape, generator=g)).to(DEV)  # drifting queries: hits and misses
        kn = torch.randn(2, H, 1, D, generator=g).to(DEV)
        vn = torch.randn(2, H, 1, D, generator=g).to(DEV)
        want = ref_e.decode(0, q, kn, vn, 0.2)
        got = fast_e.decode(0, q, kn, vn, 0.2)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"step {step}")
        misses.append(fast_e.fast[0].last_miss.float().mean().item())
    assert fast_e.stats["kernel_steps"] == 12 and ref_e.stats["reference_steps"] == 12  # the fast path ran
    assert misses[0] == 1.0 and min(misses[1:]) < 1.0  # the reuse buffer did reuse


@pytest.mark.cuda
def test_decode_step_captures_in_a_cuda_graph():
    from thrifty.kvcache.decode import kernel_decode_step

    cfg = ShadowKVConfig(rank=64, chunk_size=8, sparse_budget=64, outlier_chunks=4, local_chunks=2,
                         min_prompt_len=16, max_generated=64)
    _, e = _engines(cfg, [1000, 1000], H=2, G=4, D=64)
    q = torch.randn(2, 8, 1, 64, device="cuda")
    kn, vn = torch.randn(2, 2, 1, 64, device="cuda"), torch.randn(2, 2, 1, 64, device="cuda")
    # the 3 warm-up calls compile the kernels
    graph, out = capture_graph(lambda: kernel_decode_step(e, 0, q, kn, vn, 0.125), warmup=3)
    before = int(e.fast[0].n_generated)
    graph.replay()
    torch.cuda.synchronize()
    assert int(e.fast[0].n_generated) == before + 1
    eager = kernel_decode_step(e, 0, q, kn, vn, 0.125)
    assert torch.isfinite(out).all() and eager.shape == out.shape


def test_transformers_model_through_the_kernel_path():
    from transformers import LlamaConfig, LlamaForCausalLM

    from thrifty.kvcache import ShadowKVCache

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 101, (2, 90), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    kv = ShadowKVConfig(rank=24, chunk_size=4, sparse_budget=16, outlier_chunks=2, local_chunks=2,
                        min_prompt_len=32, max_generated=8)
    outs = []
    for impl in ("reference", "triton"):
        cache = ShadowKVCache(model, kv, impl=impl)
        outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                   past_key_values=cache, output_logits=True, return_dict_in_generate=True))
        assert cache.engine.stats["kernel_steps" if impl == "triton" else "reference_steps"] == 2 * 3
    for a, b in zip(outs[0].logits, outs[1].logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    quest = ShadowKVCache(model, ShadowKVConfig(**{**kv.__dict__, "selector": "quest"}), impl="triton")
    with pytest.raises(ValueError, match="selector"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, past_key_values=quest)
