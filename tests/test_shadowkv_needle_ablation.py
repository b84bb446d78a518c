"""benchmarks/shadowkv_needle_ablation.py: its baseline scorers are the library's (the ablation measures
thrifty's ShadowKV and Quest, not a re-implementation), on random keys."""

import dataclasses
import math

import torch

from thrifty.kvcache import ShadowKVConfig
from thrifty.kvcache import reference as R

from script_module import load_script

def _module():
    return load_script("benchmarks/shadowkv_needle_ablation.py", "shadowkv_needle_ablation")


def test_ablation_scores_match_reference():
    A = _module()
    torch.manual_seed(0)
    B, H, G, T, D, c = 1, 3, 3, 200, 16, 8
    k = torch.randn(B, H, T, D)
    v = torch.randn(B, H, T, D)
    pos = torch.arange(T, dtype=torch.float32)[:, None] / (10000 ** (torch.arange(D // 2) / (D // 2)))
    cos = torch.cat((pos.cos(), pos.cos()), -1)
    sin = torch.cat((pos.sin(), pos.sin()), -1)
    q = torch.randn(B, H * G, 1, D)
    for selector, scorer in (("shadowkv", "landmark"), ("quest", "bound")):
        cfg = ShadowKVConfig(rank=32, chunk_size=c, sparse_budget=32, outlier_chunks=2, local_chunks=1,
                             min_prompt_len=1, selector=selector, radius_weight=0.0,
                             outlier_radius_share=0.0)  # the paper's scorer and outlier rule
        st = R.compress_prompt(k, v, torch.tensor([T]), cos, sin, cfg)
        C = st.selectable.shape[-1]
        kc = k[:, :, :C * c].view(B, H, C, c, D)
        got = A.chunk_scores(q, st, kc, scorer, "max_softmax")
        torch.testing.assert_close(got, R.landmark_scores(q, st), rtol=1e-5, atol=1e-6)
    assert R.low_rank_keys is not A._cached_low_rank  # importing the script patches nothing
    assert math.isfinite(float(got.sum()))


def test_tf32_rounding_and_patch_restores_reference():
    A = _module()
    x = torch.tensor([1.0, 1.0 + 2 ** -11, 1.0 + 2 ** -10 + 2 ** -12, -(1.0 + 2 ** -11), 3.0e-5, 0.0])
    got = A.tf32(x)
    # ties away from zero at 2^-11, nearest elsewhere; 10 mantissa bits kept
    assert got.tolist() == [1.0, 1.0 + 2 ** -10, 1.0 + 2 ** -10, -(1.0 + 2 ** -10), float(A.tf32(x[4:5])), 0.0]
    assert (got.view(torch.int32) & 0x1FFF).eq(0).all()
    assert float((A.tf32(x[4:5]) - x[4]).abs() / x[4]) <= 2 ** -11
    originals = (R.landmark_scores, R.rebuild_keys, R.attend)
    torch.manual_seed(1)
    B, H, G, T, D, c = 1, 2, 3, 96, 16, 8
    k, v = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    cos, sin = torch.ones(T, D), torch.zeros(T, D)
    cfg = ShadowKVConfig(rank=32, chunk_size=c, sparse_budget=16, outlier_chunks=1, local_chunks=1,
                         min_prompt_len=1)
    st = R.compress_prompt(k, v, torch.tensor([T]), cos, sin, cfg)
    q, kn, vn = torch.randn(B, H * G, 1, D), torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
    import dataclasses
    exact = R.decode_step(dataclasses.replace(st), q, kn, vn, cfg, cos, sin, D ** -0.5)
    with A.TF32Reference():
        assert R.attend is not originals[2]
        approx = R.decode_step(dataclasses.replace(st), q, kn, vn, cfg, cos, sin, D ** -0.5)
    assert (R.landmark_scores, R.rebuild_keys, R.attend) == originals
    err = float((approx - exact).abs().max())
    assert 0 < err < 1e-2


def test_chunk_methods_keep_outlier_and_local_tokens():
    A = _module()
    base = ShadowKVConfig(rank=32, chunk_size=8, sparse_budget=512, outlier_chunks=48, local_chunks=4,
                          min_prompt_len=1)
    methods = {"dense": None, "shadowkv_O48@512": base}
    got = A.chunk_methods(methods, ["dense", "shadowkv_O48@512", "shadowkv_O48@512/c4", "dense/c4", "nope/c4"])
    assert list(got) == ["shadowkv_O48@512/c4"]  # only named /c<k> entries of a sparse method
    c4 = got["shadowkv_O48@512/c4"]
    assert (c4.chunk_size, c4.outlier_chunks, c4.local_chunks, c4.sparse_budget) == (4, 96, 8, 512)
    assert c4.dense_tokens == base.dense_tokens and c4.select_chunks * 4 == base.select_chunks * 8
    assert methods["shadowkv_O48@512"] is base  # the c=8 method is left as it is
    # a chunk-4 compression decodes on the reference path
    torch.manual_seed(2)
    B, H, G, T, D = 1, 2, 2, 1000, 16
    k, v = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    cos, sin = torch.ones(T, D), torch.zeros(T, D)
    cfg = A.replace(c4, rank=32)
    st = R.compress_prompt(k, v, torch.tensor([T]), cos, sin, cfg)
    assert st.selectable.shape[-1] == T // 4 - 8  # the 8 local chunks are not selectable
    out = R.decode_step(st, torch.randn(B, H * G, 1, D), torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), cfg,
                        cos, sin, D ** -0.5)
    assert out.shape == (B, H * G, 1, D) and torch.isfinite(out).all()
    import pytest

    with pytest.raises(ValueError, match="whole chunks of 3"):
        A.chunk_methods(methods, ["shadowkv_O48@512/c3"])


def test_meta_scorers_bound_and_end_to_end_patch():
    """radius / maha at lam = 1 bound the best exact q.k of each chunk (softmax is monotone, so compare logits),
    lam = 0 is the landmark, far >= landmark; MetaReference restores the library's functions."""
    A = _module()
    torch.manual_seed(3)
    B, H, G, T, D, c = 1, 2, 3, 160, 16, 8
    k, v = torch.randn(B, H, T, D) * torch.linspace(0.2, 3, D), torch.randn(B, H, T, D)
    C = T // c
    kc = k.view(B, H, C, c, D)
    lm = kc.mean(3)
    meta = A.chunk_meta(kc, lm, torch.tensor([C]))
    qg = torch.randn(B, H, G, D)
    oracle = torch.einsum("bhgd,bhcnd->bhgcn", qg, kc).amax(-1) / math.sqrt(D)
    land = torch.einsum("bhgd,bhcd->bhgc", qg, lm) / math.sqrt(D)
    for scorer in ("radius", "maha"):
        assert (A.meta_logits(qg, lm, meta, scorer, 1.0) >= oracle - 1e-5).all()
        torch.testing.assert_close(A.meta_logits(qg, lm, meta, scorer, 0.0), land)
    far = A.meta_logits(qg, lm, meta, "far", None)
    assert (far >= land - 1e-6).all() and (far <= oracle + 1e-5).all()
    assert ((A.fp8_round(meta["k_far"]) - meta["k_far"]).abs() <= meta["k_far"].abs() * 2 ** -3 + 1e-6).all()
    assert A.parse_scorer("rad0.25") == ("radius", 0.25) and A.parse_scorer("far8") == ("far8", None)
    originals = (R.compress_prompt, R.landmark_scores)
    cfg = ShadowKVConfig(rank=32, chunk_size=c, sparse_budget=16, outlier_chunks=1, local_chunks=1,
                         min_prompt_len=1, radius_weight=0.0,  # the paper's scorer and outliers, which the
                         outlier_radius_share=0.0)  # script's variants extend
    cos, sin = torch.ones(T, D), torch.zeros(T, D)
    q = torch.randn(B, H * G, 1, D)
    with A.MetaReference() as m:
        st = R.compress_prompt(k, v, torch.tensor([T]), cos, sin, cfg)
        with m.scoring("rad0"):  # lam 0: the library's scores
            torch.testing.assert_close(R.landmark_scores(q, st), originals[1](q, st))
        with m.scoring("far"):
            assert R.landmark_scores is not originals[1]
            out = R.decode_step(st, q, torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), cfg, cos, sin, D ** -0.5)
        assert torch.isfinite(out).all()
        # the ablation's chunk_scores agrees with the end-to-end scorer
        Cs = st.selectable.shape[-1]
        got = A.chunk_scores(q, st, k[:, :, :Cs * c].view(B, H, Cs, c, D), "radius", "max_softmax", lam=0.5)
        with m.scoring("rad0.5"):
            torch.testing.assert_close(got, R.landmark_scores(q, st))
    assert (R.compress_prompt, R.landmark_scores) == originals
    # the library's radius term (ShadowKVConfig.radius_weight) is the script's rad<λ> scorer
    lib = R.compress_prompt(k, v, torch.tensor([T]), cos, sin, dataclasses.replace(cfg, radius_weight=0.5))
    torch.testing.assert_close(R.landmark_scores(q, lib), got)


def test_spec_options_outliers_and_group():
    """Scorer options: parse_spec; reselect_outliers with the library's rule reproduces compress_prompt's state,
    other rules keep the outlier count and the local window (owin/owinh with the library's window mass); gsum /
    glogit pick only selectable chunks."""
    A = _module()
    assert A.parse_spec("rad0.5,orad,gsum") == ("radius", 0.5, ("orad", "gsum"))
    assert A.outlier_rule("rad0.5,gsum") == "mincos" and A.outlier_rule("rad0.5,owinh") == "owinh"
    for bad in ("rad0.5,orad,orel", "rad0.5,gsum,glogit", "far,r2", "rad0.5,nope"):
        try:
            A.parse_spec(bad)
        except ValueError:
            continue
        raise AssertionError(bad)
    torch.manual_seed(4)
    B, H, G, T, D, c = 1, 2, 3, 203, 16, 8
    k, v = torch.randn(B, H, T, D) * torch.linspace(0.2, 3, D), torch.randn(B, H, T, D)
    cos, sin = torch.ones(T, D), torch.zeros(T, D)
    cfg = ShadowKVConfig(rank=32, chunk_size=c, sparse_budget=32, outlier_chunks=4, local_chunks=2,
                         min_prompt_len=1, radius_weight=0.0, outlier_radius_share=0.0)
    L = torch.tensor([T])
    st = R.compress_prompt(k, v, L, cos, sin, cfg)
    C = st.selectable.shape[-1]
    qw = torch.randn(B, H * G, 5, D)
    wm = R.window_mass(qw, k, L, C, c)
    assert wm.shape == (B, H, C) and float(wm.sum()) <= H * G * 5 + 1e-4
    same = dataclasses.replace(st)
    A.reselect_outliers(same, k, v, L, cfg, st.radius, "mincos")
    for f in ("outlier_ids", "selectable", "dense_k", "dense_v", "dense_valid"):
        assert torch.equal(getattr(same, f), getattr(st, f)), f
    for rule in A.OUTLIER_RULES:
        s2 = dataclasses.replace(st)
        A.reselect_outliers(s2, k, v, L, cfg, st.radius, rule, wm)
        ids = s2.outlier_ids[0]
        assert all(len(set(h.tolist())) == cfg.outlier_chunks for h in ids)
        assert int(s2.selectable.sum()) == int(st.selectable.sum())
        assert torch.equal(s2.dense_k[:, :, cfg.outlier_chunks * c:], st.dense_k[:, :, cfg.outlier_chunks * c:])
        torch.testing.assert_close(s2.dense_k[0, 1, :c], k[0, 1, int(ids[1, 0]) * c:int(ids[1, 0] + 1) * c])
    s2 = dataclasses.replace(st)
    A.reselect_outliers(s2, k, v, L, cfg, st.radius, "orad")
    real = st.radius[:, :, :int(st.n_chunks[0])]
    assert set(s2.outlier_ids[0, 0].tolist()) == set(real[0, 0].topk(cfg.outlier_chunks).indices.tolist())
    q = torch.randn(B, H * G, 1, D)
    with A.MetaReference() as m:
        st = R.compress_prompt(k, v, L, cos, sin, cfg)
        for spec in ("rad0.5,gsum", "rad0.5,glogit", "rad0.5,r2"):
            with m.scoring(spec):
                s = R.landmark_scores(q, st)
            assert ((s >= 0) == st.selectable).all()


def test_library_outlier_share_is_the_scripts_ohalf_rule():
    """ShadowKVConfig(outlier_radius_share=0.5) picks the outlier chunks of the script's ``ohalf`` rule (what the
    proxy measured), as sets per (sequence, KV head)."""
    A = _module()
    torch.manual_seed(1)
    B, H, T, D, c, O = 1, 2, 240, 16, 8, 6
    k, v = torch.randn(B, H, T, D) * torch.linspace(0.2, 3, D), torch.randn(B, H, T, D)
    cos, sin = torch.ones(T, D), torch.zeros(T, D)
    cfg = ShadowKVConfig(rank=32, chunk_size=c, sparse_budget=16, outlier_chunks=O, local_chunks=1,
                         min_prompt_len=1, outlier_radius_share=0.5)
    st = R.compress_prompt(k, v, torch.tensor([T]), cos, sin, cfg)
    C = st.selectable.shape[-1]
    kc = k[:, :, :C * c].view(B, H, C, c, D)
    want = A.choose_outliers("ohalf", kc, kc.mean(3), st.radius, torch.ones(B, C, dtype=torch.bool), O)
    for h in range(H):
        assert set(st.outlier_ids[0, h].tolist()) == set(want[0, h].tolist())
