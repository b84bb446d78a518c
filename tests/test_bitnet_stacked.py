"""bitnet.stack_projections: packed q/k/v and gate/up stacked into one layer each give the unstacked model's
logits bit for bit (PyTorch path, and the Triton kernels under TRITON_INTERPRET=1 on the CPU), with 4 packed
launches per layer instead of 7; refusals name their argument."""

import copy

import pytest
import torch

from thrifty import bitnet
from thrifty.bitnet import PackedBitLinear, ProjectionSlice, stack_projections
from thrifty.models import LlamaConfig, LlamaForCausalLM

from generation_checks import assert_greedy_up_to_near_ties

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def packed_model(recipe, impl, seed=0):
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg, linear=bitnet.linear_factory(recipe), activation=bitnet.mlp_activation(recipe))
    return bitnet.pack(model.init_weights(seed=seed).eval(), impl=impl).to(DEVICE)


def packed_calls(model):
    calls = []
    for m in model.modules():
        if isinstance(m, PackedBitLinear):
            m.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("recipe", ["b1.58", "a4.8"])
def test_stacked_logits_are_the_unstacked_logits_bit_for_bit(recipe):
    impl = "triton" if DEVICE == "cuda" else "reference"
    base = packed_model(recipe, impl)
    stacked = copy.deepcopy(base)
    assert stack_projections(stacked) == 2 * stacked.config.num_hidden_layers
    ids = torch.randint(0, 64, (2, 9), device=DEVICE)
    calls = packed_calls(stacked)
    with torch.no_grad():
        want, got = base(ids), stacked(ids)
        one = base(ids[:, :1]), stacked(ids[:, :1])  # one token: the decode kernels on the Triton path
    assert torch.equal(got, want) and torch.equal(one[1], one[0])
    assert len(calls) == 2 * 4 * stacked.config.num_hidden_layers  # 4 packed launches per layer, two forwards
    attn = stacked.model.layers[0].self_attn
    assert isinstance(attn.q_proj, ProjectionSlice) and attn.qkv_proj.splits == (64, 32, 32)
    assert attn.qkv_proj.last_path == ("triton" if impl == "triton" else "reference")


@pytest.mark.parametrize("tokens", [1, 3])
def test_stacked_layer_is_its_siblings_in_the_kernels(tokens):
    """The Triton kernels (the v3 decode GEMV at one token, the tensor-core GEMM at 3) on the stacked q/k/v rows:
    each slice equals its sibling's own launch bit for bit (TRITON_INTERPRET=1 on the CPU; the model-level test
    covers the rest)."""
    torch.manual_seed(tokens)
    siblings = [PackedBitLinear.from_bitlinear(bitnet.BitLinear(64, n, activation="int4"), impl="triton").to(DEVICE)
                for n in (48, 16, 16)]
    stacked = bitnet.stacked.stack_layers(siblings)
    x = torch.randn(tokens, 64, device=DEVICE)
    with torch.no_grad():
        y = stacked(x)
        parts = [m(x) for m in siblings]
    assert stacked.last_path == "triton" and torch.equal(y, torch.cat(parts, dim=-1))


def test_refusals():
    with pytest.raises(ValueError, match="model"):
        stack_projections(LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                                       num_hidden_layers=1, num_attention_heads=4,
                                                       num_key_value_heads=2)))
    with pytest.raises(TypeError, match="model"):
        stack_projections("model")
    model = packed_model("a4.8", "reference")
    layer = model.model.layers[0]
    with pytest.raises(ValueError, match="layers"):  # o_proj has a sub-norm and another input width
        bitnet.stacked.stack_layers([layer.self_attn.q_proj, layer.mlp.down_proj])


def test_norms_write_the_codes_of_stacked_int8_projections(monkeypatch):
    """b1.58 (INT8): the norms in front of the stacked q/k/v and gate/up write the projections' codes in their own
    launch (packed_kernel.norm_codes), so at 1 token the codes kernel runs only for o (its sub-norm; down's codes
    come from the GLU's launch) and the v3 decode GEMV reads them; prefill (the GEMM) takes them too; the logits stay the unstacked model's bit
    for bit. The fused norms run under the interpreter here, as they do on CUDA; a4.8's INT4 projections keep
    plain norms."""
    from thrifty import layers
    from thrifty.bitnet import packed_kernel as PK
    from thrifty.bitnet.stacked import CodesRMSNorm

    monkeypatch.setattr(layers, "fused_inference", lambda x: not torch.is_grad_enabled())
    base = packed_model("b1.58", "triton")  # the CPU runs the kernels under TRITON_INTERPRET=1 (conftest)
    stacked = copy.deepcopy(base)
    stack_projections(stacked)
    block = stacked.model.layers[0]
    assert isinstance(block.input_layernorm, CodesRMSNorm) and isinstance(block.post_attention_layernorm, CodesRMSNorm)
    assert block.self_attn.qkv_proj.shared_input is block.input_layernorm.slot
    for name in ("input_layernorm", "post_attention_layernorm"):  # the norm's parameter, under its name
        key = f"model.layers.0.{name}.weight"
        assert torch.equal(stacked.state_dict()[key], base.state_dict()[key])
    ran = []
    for name in ("_ACT_LAUNCH", "_NORM_CODES_LAUNCH", "_DECODE_V3_LAUNCH"):
        launcher = getattr(PK, name)
        monkeypatch.setattr(PK, name, lambda *a, _l=launcher, _n=name, **kw: ran.append(_n) or _l(*a, **kw))
    ids = torch.randint(0, 64, (1, 6), device=DEVICE)
    with torch.no_grad():
        for tokens in (6, 1):
            want = base(ids[:, :tokens])
            ran.clear()
            got = stacked(ids[:, :tokens])
            assert torch.equal(got, want), tokens
            assert ran.count("_NORM_CODES_LAUNCH") == 2 and ran.count("_ACT_LAUNCH") == 1, (tokens, ran)  # o; down: GLU
        assert ran.count("_DECODE_V3_LAUNCH") == 4
    a48 = packed_model("a4.8", "reference")
    stack_projections(a48)
    assert type(a48.model.layers[0].input_layernorm) is layers.RMSNorm


@pytest.mark.cuda
def test_graphed_decoder_replays_the_norm_codes_and_v3():
    """b1.58 stacked, batch 1 on CUDA: the captured decode step (the norms writing the q/k/v and gate/up codes, the
    v3 GEMVs reading them) is captured once across calls and picks what the model ranks first (near-ties aside)."""
    from thrifty.bitnet.stacked import CodesRMSNorm
    from thrifty.models import GraphedDecoder

    model = packed_model("b1.58", "triton")
    stack_projections(model)
    assert isinstance(model.model.layers[0].input_layernorm, CodesRMSNorm)
    decoder = GraphedDecoder(model, 1, 40)
    for t, n, seed in ((7, 12, 0), (3, 20, 1)):
        x = torch.randint(0, 64, (1, t), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        out = decoder.generate(x, n)
        assert out.shape == (1, t + n) and decoder.captures == 1
        assert_greedy_up_to_near_ties(model, out, t)
