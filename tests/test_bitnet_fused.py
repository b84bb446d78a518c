"""The fused BitLinear path (sub-norm + quantizer kernel, norm backward, ternary weight kernel, q/k/v and gate/up
quantized once) against reference.py and float64, through the public API, under TRITON_INTERPRET=1 on the CPU;
checkpoints that rebuild their BitLinears."""

import math

import pytest
import torch

from thrifty import bitnet
from thrifty.bitnet import BitLinear, quant_kernel as QK, reference as ref
from thrifty.models import LlamaConfig, LlamaForCausalLM
from thrifty.triton_utils import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available("cpu") and not torch.cuda.is_available(),
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = ("int8", "int4", "topk_int8")
QMAX = {"int8": 127.0, "int4": math.sqrt(7.0), "topk_int8": 127.0}
SHAPES = [(1, 5), (3, 7), (5, 33), (2, 3, 130), (7, 257), (4, 384)]


def fresh(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g).mul(4).add(0.05)
    return x.to(dtype).to(DEVICE)


def layer(d_in, d_out, kind, sub_norm, seed):
    torch.manual_seed(seed)
    m = BitLinear(d_in, d_out, activation=kind, sub_norm=sub_norm, impl="triton", device=DEVICE)
    if sub_norm:
        with torch.no_grad():
            m.norm.weight.uniform_(0.5, 1.5)
    return m


def float64_quantize(x64: torch.Tensor, kind: str) -> torch.Tensor:
    """The paper's formulas in float64 (TopK by the reference's mask: which entries is not a float question)."""
    mag = x64.abs()
    if kind == "int4":
        beta = mag.mean(-1, keepdim=True)
        return (math.sqrt(7) * x64 / (beta + ref.EPS)).round().clamp(-8, 7) * beta / math.sqrt(7)
    if kind == "topk_int8":
        x64 = torch.where(ref.topk_mask(x64), x64, torch.zeros_like(x64))
    gamma = x64.abs().amax(-1, keepdim=True)
    return (x64 * 127 / (gamma + ref.EPS)).round().clamp(-128, 127) * gamma / 127


def assert_within_a_code(got, want, scale, kind, rare=0.02):
    """Every value within one code step of ``want`` (a value at a rounding half may go either way when the
    statistic is summed in another order), and only a few values off at all."""
    step = scale / QMAX[kind]
    diff = (got.double() - want.double()).abs()
    assert (diff <= step * 1.001 + 1e-6 * scale).all(), (kind, (diff / step).max())
    assert (diff > 1e-5 * scale).double().mean() <= rare, kind


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sub_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_bitlinear_matches_reference_and_float64(kind, sub_norm, dtype):
    for i, shape in enumerate(SHAPES):
        d = shape[-1]
        m = layer(d, 9, kind, sub_norm, seed=i)
        x = fresh(shape, seed=100 + i, dtype=dtype)
        got_q = m.quantize_input(x)
        assert m.last_path == "triton" and got_q.dtype == dtype
        normed = m._normed(x) if sub_norm else x  # the module's own reference norm
        want_q = ref.quantize_activation(normed, kind)
        scale = normed.float().abs().amax(-1, keepdim=True)
        if dtype == torch.bfloat16 or not sub_norm:
            # same input to the quantizer: the reference's values (INT4's mean summed in another order)
            assert_within_a_code(got_q, want_q, scale, kind, rare=0.0 if kind != "int4" else 0.02)
        else:
            assert_within_a_code(got_q, want_q, scale, kind)
        assert_within_a_code(got_q, float64_quantize(normed.double(), kind).to(dtype), scale, kind)
        y = m(x)
        assert m.last_path == "triton"
        # the reference BitLinear math, in the matmul dtype (what F.linear sees under autocast)
        want = torch.nn.functional.linear(want_q, ref.quantize_weight_ternary(m.weight.detach()).to(dtype))
        tol = (1e-5 if dtype == torch.float32 else 2e-2) * (want.abs().max() + 1)
        close = ((y.float() - want.float()).abs() <= tol).double().mean()
        assert close >= (0.99 if sub_norm or kind == "int4" else 1.0), (kind, shape, close)


@pytest.mark.parametrize("kind", KINDS)
def test_fused_gradients_match_reference_autograd(kind):
    for i, shape in enumerate([(3, 7), (5, 33), (4, 130)]):
        d = shape[-1]
        for sub_norm in (False, True):
            m = layer(d, 6, kind, sub_norm, seed=10 + i)
            x = fresh(shape, seed=200 + i).requires_grad_()
            g = fresh(shape[:-1] + (6,), seed=300 + i)
            (m(x) * g).sum().backward()
            assert m.last_path == "triton"
            x_ref = x.detach().clone().requires_grad_()
            w_ref = m.weight.detach().clone().requires_grad_()
            nw_ref = m.norm.weight.detach().clone().requires_grad_() if sub_norm else None
            (ref.bitlinear_reference(x_ref, w_ref, activation=kind, norm_weight=nw_ref) * g).sum().backward()
            for got, want in ((x.grad, x_ref.grad), (m.weight.grad, w_ref.grad),
                              *(((m.norm.weight.grad, nw_ref.grad),) if sub_norm else ())):
                err = (got - want).abs().max() / (want.abs().max() + 1e-12)
                assert err <= 1e-5, (kind, shape, sub_norm, float(err))


def test_norm_backward_matches_float64_autograd():
    """The RMSNorm-backward kernel against float64 autograd of weight · x / RMS(x) (fp32 in, no casts)."""
    for shape in [(1, 1), (3, 7), (33, 130), (65, 257)]:  # 33 and 65 rows: partial programs of 32 rows
        x = fresh(shape, seed=7)
        w = fresh(shape[-1:], seed=8).abs() + 0.5
        g = fresh(shape, seed=9)
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        y64 = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
        (y64 * g.double()).sum().backward()
        rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-5)
        dx, dw = QK.norm_backward(x, w, rstd, g)
        assert (dx.double() - x64.grad).abs().max() <= 1e-5 * (x64.grad.abs().max() + 1)
        assert (dw.double() - w64.grad).abs().max() <= 1e-5 * (w64.grad.abs().max() + 1)


def test_ternary_weight_kernel_matches_reference():
    for shape, splits in (((7, 5), None), ((9, 33), (3, 2, 4)), ((130, 257), (64, 66))):
        w = fresh(shape, seed=11)
        want = ref.quantize_weight_ternary(w, splits)
        for dtype in (torch.float32, torch.bfloat16):
            got = QK.ternary_weight(w, splits, dtype)
            assert got.dtype == dtype
            # α is a sum in another order (relative 1e-6 at these sizes); the codes are the same
            assert torch.equal(got.float().sign(), want.sign()), (shape, splits)
            assert torch.allclose(got.float(), want.to(dtype).float(), rtol=1e-5, atol=0), (shape, splits)
            # ternary: each sub-matrix holds exactly {-α, 0, α}
            for part in got.float().split(list(splits) if splits else [shape[0]], dim=0):
                assert part.abs().unique().numel() <= 2


def test_topk_ties_on_16_bit_keys_match_reference():
    row = [0.5, 1.0, -1.0, 2.0, 1.0, 1.0, 0.25, -1.0, 3.0]  # k = 5 of 9: 3, 2, then the first three ±1
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.tensor([row, [0.0] * 9, [1.0] * 9], dtype=dtype, device=DEVICE)
        got = QK.quantize_rows(x, "topk_int8")
        assert torch.equal(got, ref.quantize_topk_int8(x)), dtype
        assert got[0].ne(0).tolist() == [False, True, True, True, True, False, False, False, True]
        assert got[2].ne(0).sum() == 5  # all tied: the first five


def test_quantize_rows_refuses_bad_arguments():
    x = fresh((2, 8), seed=0)
    with pytest.raises(ValueError, match="kind"):
        QK.quantize_rows(x, "fp4")
    with pytest.raises(TypeError, match="x"):
        QK.quantize_rows(x.double(), "int8")
    with pytest.raises(ValueError, match="norm_weight"):
        QK.quantize_rows(x, "int8", norm_weight=torch.ones(7, device=DEVICE))
    with pytest.raises(ValueError, match="impl"):
        BitLinear(8, 4, impl="yes")
    with pytest.raises(TypeError, match="impl"):
        BitLinear(8, 4, impl=True)
    with pytest.raises(ValueError, match="impl"):
        bitnet.BitNetConfig(impl="always")


def tiny_model(recipe="a4.8", impl="triton", seed=1):
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(cfg).init_weights(seed=seed)
    return bitnet.convert(model, bitnet.BitNetConfig(recipe=recipe, impl=impl))


def test_shared_inputs_are_quantized_once(monkeypatch):
    """q/k/v share one quantization, gate/up another: 4 input kernels per layer, and the same logits and
    gradients as when every projection quantizes its own input."""
    model = tiny_model()
    plain = tiny_model()
    for m in plain.modules():
        if isinstance(m, BitLinear):
            m.shared_input = None
    calls = []
    real = QK._launch
    monkeypatch.setattr(QK, "_launch", lambda *a: calls.append(a[1]) or real(*a))
    ids = torch.randint(0, 64, (2, 11), device=DEVICE)
    loss = model(ids, labels=ids)
    assert sorted(calls) == sorted(["int4", "topk_int8", "int4", "int8"] * 2)
    assert {m.last_path for m in model.modules() if isinstance(m, BitLinear)} == {"triton"}
    loss.backward()
    calls.clear()
    plain_loss = plain(ids, labels=ids)
    assert len(calls) == 7 * 2 and torch.equal(loss, plain_loss)
    plain_loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name
    shared = [m.shared_input for m in model.modules() if isinstance(m, BitLinear) and m.shared_input]
    assert shared and all(s._entry is None for s in shared)  # no activation kept after the forward


def test_checkpoint_records_the_recipe_and_rebuilds_bitlinears(tmp_path):
    for recipe, strength in (("a4.8", 1.0), ("b1.58", 0.25)):
        model = tiny_model(recipe, impl="auto")
        bitnet.set_strength(model, strength)
        ids = torch.randint(0, 64, (2, 9), device=DEVICE)
        with torch.no_grad():
            before = model(ids)
        path = model.save_pretrained(tmp_path / recipe)
        import json

        record = json.loads((path / "config.json").read_text())["thrifty_bitnet"]
        assert record["recipe"] == recipe and record["strength"] == strength and record["sub_norm"]
        loaded = LlamaForCausalLM.from_pretrained(path, device=DEVICE)
        assert bitnet.current_recipe(loaded) == recipe
        assert loaded.model.layers[0].self_attn.o_proj.norm is not None
        with torch.no_grad():
            assert torch.equal(loaded(ids), before)
    (tmp_path / "bad").mkdir()
    config = json.loads((tmp_path / "a4.8" / "config.json").read_text())
    config["thrifty_bitnet"]["recipe"] = "a9"
    (tmp_path / "a4.8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="recipe"):
        LlamaForCausalLM.from_pretrained(tmp_path / "a4.8")
