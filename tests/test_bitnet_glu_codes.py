"""The GLU in front of a packed BitNet down projection makes that projection's activation codes in its own launch
(``packed_kernel.glu_codes``, ``PackedBitLinear.glu_input``): y is ``fused_layers.glu``'s bit for bit, the codes are
the codes kernel's of y bit for bit (sub-norm, INT8 / INT4 range), the model's logits do not change, and the fast
path is shown to run (launches counted) under the interpreter on the CPU and on CUDA."""

import copy

import pytest
import torch

from thrifty import bitnet
from thrifty.bitnet import BitLinear, PackedBitLinear
from thrifty.models import LlamaConfig, LlamaForCausalLM
from thrifty.triton_utils import kernels_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_available("cpu") and not torch.cuda.is_available(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def down_layer(k, n, kind, sub_norm, seed=0):
    torch.manual_seed(seed)
    bl = BitLinear(k, n, activation=kind, sub_norm=sub_norm)
    if sub_norm:
        with torch.no_grad():
            bl.norm.weight.uniform_(0.5, 1.5)
    return PackedBitLinear.from_bitlinear(bl, impl="triton").to(DEVICE)


def gate_up(m, k, dtype, seed=0):
    """The two halves of a stacked gate/up output (strided rows), varied scale, one near-zero row."""
    g = torch.Generator().manual_seed(seed)
    both = torch.randn(m, 2 * k, generator=g) * torch.rand(m, 1, generator=g).mul(3).add(0.05)
    both[-1] *= 1e-3
    both = both.to(dtype).to(DEVICE)
    return both[:, :k], both[:, k:]


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("sub_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("glu", ["relu2", "silu"])
@pytest.mark.parametrize("m, k", [(1, 37), (3, 300)])
def test_glu_codes_are_the_glu_then_the_codes_kernel_bit_for_bit(kind, sub_norm, dtype, glu, m, k):
    from thrifty.bitnet import packed_kernel as PK
    from thrifty.fused_layers import glu as plain_glu

    layer = down_layer(k, 5, kind, sub_norm)
    gate, up = gate_up(m, k, dtype, seed=m * 1000 + k)
    y, (codes, scale, sums) = PK.glu_codes(gate, up, glu, layer)
    want_y = plain_glu(gate, up, glu)
    want_codes, want_scale, want_sums = PK.layer_codes(want_y, layer)
    assert y.dtype == dtype and y.shape == (m, k) and torch.equal(y, want_y)
    assert torch.equal(codes, want_codes) and torch.equal(sums, want_sums)
    assert torch.equal(scale, want_scale)


def test_glu_codes_refuse_what_they_cannot_quantize():
    from thrifty.bitnet import packed_kernel as PK

    gate, up = gate_up(1, 40, torch.float32)
    with pytest.raises(ValueError, match="layer"):
        PK.glu_codes(gate, up, "relu2", down_layer(40, 4, "topk_int8", False))
    with pytest.raises(ValueError, match="gate"):
        PK.glu_codes(gate, up, "relu2", down_layer(48, 4, "int8", False))
    with pytest.raises(ValueError, match="kind"):
        PK.glu_codes(gate, up, "gelu", down_layer(40, 4, "int8", False))
    with pytest.raises(ValueError, match="up"):
        PK.glu_codes(gate, up[:, :20], "relu2", down_layer(40, 4, "int8", False))


def packed_model(recipe, seed=0):
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg, linear=bitnet.linear_factory(recipe), activation=bitnet.mlp_activation(recipe))
    return bitnet.pack(model.init_weights(seed=seed).eval(), impl="triton").to(DEVICE)


@pytest.mark.parametrize("recipe", ["b1.58", "a4.8"])
@pytest.mark.parametrize("stacked", [False, True])
def test_down_projection_takes_the_codes_of_the_glu_launch(recipe, stacked, monkeypatch):
    """Decode (1 token) and a short prefill (6 tokens, the whole-row codes kernel): every layer's GLU makes its down
    projection's codes (one launch counted per layer, the down projection's own codes kernel never runs), and the
    logits equal those of the same model whose down projections quantize their input themselves. With gradients
    on, nothing changes path."""
    from thrifty.bitnet import packed_kernel as PK

    model = packed_model(recipe)
    if stacked:
        bitnet.stack_projections(model)
    plain = copy.deepcopy(model)
    for layer in plain.model.layers:
        layer.mlp.down_proj.glu_input = lambda *a: None
    ran = []
    for name in ("_GLU_CODES_LAUNCH", "_ACT_LAUNCH"):
        launcher = getattr(PK, name)
        monkeypatch.setattr(PK, name, lambda *a, _l=launcher, _n=name, **kw: ran.append((_n, a[0])) or _l(*a, **kw))
    real_codes = PK.layer_codes
    own_codes = []
    monkeypatch.setattr(PK, "layer_codes", lambda x, layer: own_codes.append(layer) or real_codes(x, layer))
    downs = {id(layer.mlp.down_proj) for layer in model.model.layers}
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        for tokens in (6, 1):
            ran.clear()
            own_codes.clear()
            got = model(ids[:, :tokens])
            assert [n for n, _ in ran].count("_GLU_CODES_LAUNCH") == 2, (tokens, ran)
            assert not any(id(layer) in downs for layer in own_codes)
            assert torch.equal(got, plain(ids[:, :tokens])), tokens
    ran.clear()
    model(ids)  # gradients on: no GLU codes
    assert not [n for n, _ in ran if n == "_GLU_CODES_LAUNCH"]
