"""The reference model against transformers' LlamaForCausalLM on the same weights, and its seams."""

import pytest
import torch
import transformers

from thrifty.models import KVCache, LlamaConfig, LlamaForCausalLM, generate


def tiny_hf(tie: bool, seed: int = 0, **over):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-5,
               tie_word_embeddings=tie, rope_theta=10000.0)
    cfg.update(over)
    hf_cfg = transformers.LlamaConfig(**cfg)
    hf_cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # HF inits norms to 1; perturb so the test covers their weights
        for n, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def to_thrifty(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    return LlamaForCausalLM.from_pretrained(tmp_path).eval()


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("heads", [(6, 2, 8), (4, 4, 12), (3, 1, 16)])
def test_logits_match_transformers(tmp_path, tie, heads):
    nh, nkv, hd = heads
    hf = tiny_hf(tie, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd)
    ours = to_thrifty(hf, tmp_path)
    ids = torch.randint(0, 97, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    assert (got - expected).abs().max().item() < 1e-4


def test_loss_matches_transformers(tmp_path):
    hf = tiny_hf(True)
    ours = to_thrifty(hf, tmp_path)
    ids = torch.randint(0, 97, (3, 21), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[0, :5] = -100
    with torch.no_grad():
        expected = hf(ids, labels=labels).loss  # HF shifts inside
        shifted = torch.full_like(labels, -100)
        shifted[:, :-1] = labels[:, 1:]
        got = ours(ids, labels=shifted)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_cached_decode_matches_full_forward(tmp_path):
    ours = to_thrifty(tiny_hf(False), tmp_path)
    ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = ours(ids)
        cache = KVCache()
        first = ours(ids[:, :11], cache=cache)
        chunk = ours(ids[:, 11:15], cache=cache)  # chunked prefill: several queries against a longer cache
        steps = [ours(ids[:, t:t + 1], cache=cache) for t in range(15, 19)]
    torch.testing.assert_close(torch.cat([first, chunk] + steps, dim=1), full, rtol=1e-4, atol=1e-4)


def test_greedy_generation_matches_transformers(tmp_path):
    hf = tiny_hf(True)
    ours = to_thrifty(hf, tmp_path)
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    expected = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = generate(ours, ids, 12)
    assert torch.equal(got, expected)


def test_seams_are_called(tmp_path):
    calls = {"attn": 0, "linear": [], "loss": 0}

    def attention(q, k, v, *, causal, scale):
        calls["attn"] += 1
        from thrifty.models import sdpa_attention
        return sdpa_attention(q, k, v, causal=causal, scale=scale)

    def linear(i, o, *, name):
        calls["linear"].append(name)
        return torch.nn.Linear(i, o, bias=False)

    def loss(hidden, weight, labels):
        calls["loss"] += 1
        assert hidden.shape[:2] == labels.shape and weight.shape[1] == hidden.shape[-1]
        return hidden.sum() * 0

    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg, attention=attention, linear=linear, loss=loss)
    ids = torch.randint(0, 50, (2, 7))
    model(ids, labels=ids)
    assert calls["attn"] == 2 and calls["loss"] == 1
    assert len(calls["linear"]) == 14 and "layers.1.mlp.down_proj" in calls["linear"]


def test_save_load_round_trip(tmp_path):
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).init_weights(seed=0)
    model.save_pretrained(tmp_path)
    again = LlamaForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 50, (1, 9))
    torch.testing.assert_close(model(ids), again(ids))
    # transformers reads our checkpoint too
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-4, atol=1e-4)


def test_bad_inputs_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="hidden_size"):
        LlamaConfig(hidden_size=30, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(TypeError, match="config"):
        LlamaForCausalLM({"hidden_size": 3})
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    with pytest.raises(TypeError, match="input_ids"):
        model(torch.randn(2, 5))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        model(torch.zeros(2, 5, dtype=torch.long), labels=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="path"):
        LlamaForCausalLM.from_pretrained(tmp_path / "nothing")
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 0)


def test_loss_seam_sees_autocast_dtype():
    seen = {}

    def loss(hidden, weight, labels):
        seen["dtypes"] = (hidden.dtype, weight.dtype)
        return hidden.float().sum() * 0

    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg, loss=loss)
    ids = torch.randint(0, 50, (2, 7))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids, labels=ids).backward()
    assert seen["dtypes"] == (torch.bfloat16, torch.bfloat16)
    model(ids, labels=ids)
    assert seen["dtypes"] == (torch.float32, torch.float32)


@pytest.mark.parametrize("name, expected", [
    # SmolLM2-135M's published count
    ("135m", 134_515_008),
    # Llama-3.2-1B's shape, vocabulary 49152 tied: embedding 49152*2048, per block q/o 2048^2, k/v 512*2048,
    # gate/up/down 2048*8192, two norms; 16 blocks; the final norm
    ("1b", 49152 * 2048 + 16 * (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 2048 * 8192 + 2 * 2048) + 2048),
])
def test_presets_build_on_meta_with_expected_parameter_count(name, expected):
    from thrifty.models import preset

    cfg = preset(name)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert all(p.is_meta for p in model.parameters())  # nothing allocated: the 1b preset costs no memory here
    assert sum(p.numel() for p in model.parameters()) == expected
    assert model.lm_head.weight is model.model.embed_tokens.weight
    if name == "1b":
        assert 1.07e9 < expected < 1.08e9
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 64)
        assert cfg.max_position_embeddings == 8192 and cfg.intermediate_size == 8192
