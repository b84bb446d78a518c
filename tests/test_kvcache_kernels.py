"""ShadowKV's Triton kernels against the reference (interpreter on the CPU, small odd sizes), the kernel path
against the reference path over many decode steps, and CUDA-graph capture of a step (GPU only)."""

import pytest
import torch

from thrifty.kvcache import ShadowKVConfig, ShadowKVEngine
from thrifty.kvcache import reference as ref
from thrifty.kvcache.attention_kernel import decode_attention
from thrifty.kvcache.decode import plan_reuse
from thrifty.kvcache.rebuild_kernel import rebuild_keys
from thrifty.kvcache.score_kernel import landmark_scores
from thrifty.kvcache.values_kernel import gather_values

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


CFG = ShadowKVConfig(rank=20, chunk_size=4, sparse_budget=20, outlier_chunks=2, local_chunks=2, min_prompt_len=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_landmark_scores_kernel_matches_reference(dtype):
    st, *_ = make_state([157, 130], cfg=CFG, dtype=dtype)
    q = torch.randn(2, 9, 1, 32, device=DEV).to(dtype) * 3
    want = ref.landmark_scores(q, st)
    got = landmark_scores(q, st.landmarks, st.selectable, 32 ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert (got[~st.selectable] == -1).all()


@pytest.mark.parametrize("chunk_size", [4, 8])
def test_rebuild_kernel_matches_reference(chunk_size):
    cfg = ShadowKVConfig(rank=20, chunk_size=chunk_size, sparse_budget=5 * chunk_size, outlier_chunks=1,
                         local_chunks=1, min_prompt_len=16)
    st, _, _, cos, sin = make_state([150, 121], cfg=cfg)
    B, H, K, c = 2, 3, 5, chunk_size
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(int(st.n_chunks.min()), generator=g)[:K] for _ in range(B * H)]).view(B, H, K)
    dest = torch.stack([torch.randperm(K, generator=g) for _ in range(B * H)]).view(B, H, K)
    miss = torch.rand(B, H, K, generator=g) < 0.6
    ids, dest, miss = ids.to(DEV), dest.to(DEV), miss.to(DEV)
    out = torch.full((B, H, 7 + K * c + 3, 32), 9.0, device=DEV)
    rebuild_keys(st.u, st.sv, cos, sin, ids, dest, miss, out, 7, c)
    want = ref.rebuild_keys(st, ref.chunk_positions(ids, c), cos, sin).view(B, H, K, c, 32)
    slots = out[:, :, 7:7 + K * c].view(B, H, K, c, 32)
    for b in range(B):
        for h in range(H):
            for j in range(K):
                got = slots[b, h, dest[b, h, j]]
                if miss[b, h, j]:
                    torch.testing.assert_close(got, want[b, h, j], atol=1e-4, rtol=1e-4)
                else:
                    assert (got == 9.0).all()  # hits are not touched
    assert (out[:, :, :7] == 9.0).all() and (out[:, :, 7 + K * c:] == 9.0).all()


@pytest.mark.parametrize("host", ["native", "fp8"])
def test_values_kernel_matches_reference(host):
    cfg = ShadowKVConfig(rank=20, chunk_size=4, sparse_budget=20, outlier_chunks=2, local_chunks=2,
                         min_prompt_len=16, host_values=host)
    st, *_ = make_state([99, 131], cfg=cfg, dtype=torch.bfloat16)
    B, H, K, c = 2, 3, 5, 4
    ids = torch.arange(K, device=DEV).flip(0).expand(B, H, K).contiguous() * 3
    dest = torch.arange(K, device=DEV).expand(B, H, K).contiguous()
    miss = torch.ones(B, H, K, dtype=torch.bool, device=DEV)
    miss[0, 1, 2] = False
    out = torch.zeros(B, H, K * c, 32, dtype=torch.bfloat16, device=DEV)
    gather_values(st.values.data, st.values.scale, ids, dest, miss, out, 0, c)
    want = st.values.gather(ref.chunk_positions(ids, c))
    m = miss[..., None].expand(-1, -1, -1, c).flatten(2)
    torch.testing.assert_close(out[m], want[m], atol=1e-2, rtol=1e-2)
    assert (out[~m] == 0).all()


@pytest.mark.parametrize("G, N", [(1, 37), (3, 150), (4, 333)])
def test_decode_attention_kernel_matches_reference(G, N):
    g = torch.Generator().manual_seed(G)
    B, H, D = 2, 3, 32
    q = torch.randn(B, H * G, 1, D, generator=g).to(DEV)
    k = torch.randn(B, H, N, D, generator=g).to(DEV) * 2
    v = torch.randn(B, H, N, D, generator=g).to(DEV)
    valid = (torch.rand(B, H, N, generator=g) < 0.7).to(DEV)
    valid[..., -1] = True
    got = decode_attention(q, k, v, valid, 0.3, splits=3, block_n=32)
    torch.testing.assert_close(got, ref.attend(q, k, v, valid, 0.3), atol=1e-5, rtol=1e-4)


def test_plan_reuse_keeps_hits_in_place():
    slot_ids = torch.tensor([[[4, 9, 2, 7]]])
    ids = torch.tensor([[[7, 1, 4, 5]]])
    dest, miss, new = plan_reuse(slot_ids, ids)
    assert miss.tolist() == [[[False, True, False, True]]]
    assert dest[0, 0, 0] == 3 and dest[0, 0, 2] == 0  # hits stay where they are
    assert sorted(new[0, 0].tolist()) == [1, 4, 5, 7] and new[0, 0, 0] == 4 and new[0, 0, 3] == 7
    empty = torch.full((1, 1, 4), -1)
    dest, miss, new = plan_reuse(empty, ids)
    assert miss.all() and sorted(dest[0, 0].tolist()) == [0, 1, 2, 3]


def _engines(cfg, lengths, H=2, G=3, D=32, seed=0):
    st, k, v, cos, sin = make_state(lengths, H=H, D=D, cfg=cfg, seed=seed)
    engines = []
    for backend in ("reference", "triton"):
        e = ShadowKVEngine(cfg, 1, H, D, lambda n, dev: (cos[:n], sin[:n]))
        e.prefill(0, k, v, torch.tensor(lengths, device=DEV))
        e.backend = backend
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
    assert fast_e.stats["kernel_steps"] == 12 and ref_e.stats["reference_steps"] == 12
    assert misses[0] == 1.0 and min(misses[1:]) < 1.0  # the reuse buffer did reuse


@pytest.mark.cuda
def test_decode_step_captures_in_a_cuda_graph():
    from thrifty.kvcache.decode import kernel_decode_step

    cfg = ShadowKVConfig(rank=64, chunk_size=8, sparse_budget=64, outlier_chunks=4, local_chunks=2,
                         min_prompt_len=16, max_generated=64)
    _, e = _engines(cfg, [1000, 1000], H=2, G=4, D=64)
    q = torch.randn(2, 8, 1, 64, device="cuda")
    kn, vn = torch.randn(2, 2, 1, 64, device="cuda"), torch.randn(2, 2, 1, 64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            kernel_decode_step(e, 0, q, kn, vn, 0.125)  # warm-up compiles the kernels
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel_decode_step(e, 0, q, kn, vn, 0.125)
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
    for backend in ("reference", "triton"):
        cache = ShadowKVCache(model, kv)
        cache.engine.backend = backend
        outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                   past_key_values=cache, output_logits=True, return_dict_in_generate=True))
        assert cache.engine.stats["kernel_steps" if backend == "triton" else "reference_steps"] == 2 * 3
    for a, b in zip(outs[0].logits, outs[1].logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    quest = ShadowKVCache(model, ShadowKVConfig(**{**kv.__dict__, "selector": "quest"}))
    quest.engine.backend = "triton"
    with pytest.raises(ValueError, match="selector"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, past_key_values=quest)
