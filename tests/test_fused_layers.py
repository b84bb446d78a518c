"""thrifty.fused_layers: one-launch RMSNorm (also after the residual add), GLU and RoPE against the PyTorch
forms they replace (layers.RMSNorm, models.llama's MLP and RotaryEmbedding) and float64, under the interpreter on the CPU and natively on CUDA; the reference
model takes them exactly for inference calls on CUDA."""

import pytest
import torch

from thrifty.layers import RMSNorm
from thrifty.models.llama import LlamaConfig, LlamaForCausalLM, RotaryEmbedding
from thrifty.triton_utils import interpreting

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not (interpreting() or torch.cuda.is_available()),
                                   reason="needs CUDA or TRITON_INTERPRET=1")
ULP = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


def torch_rms_norm(x, weight, eps):
    """layers.RMSNorm's PyTorch form (with gradients on it never takes the kernel)."""
    norm = RMSNorm(x.shape[-1], eps).to(x.device)
    norm.weight = torch.nn.Parameter(weight.clone())
    with torch.enable_grad():
        return norm(x).detach()


@needs_kernels
@pytest.mark.parametrize("dtype, w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("rows, D", [(3, 37), (5, 576), (1, 130), (0, 64)])
def test_rms_norm_matches_the_pytorch_form_and_float64(dtype, w_dtype, rows, D):
    from thrifty.fused_layers import rms_norm

    g = torch.Generator().manual_seed(rows * 1000 + D)
    x = (torch.randn(2, rows, D, generator=g) * 3).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(w_dtype).to(DEVICE)
    got = rms_norm(x, w, 1e-5)
    want = torch_rms_norm(x, w, 1e-5)
    assert got.dtype == want.dtype == torch.result_type(w, x) and got.shape == x.shape
    if not rows:
        return
    x64 = x.double()
    exact = w.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).double()
    tol = ULP[dtype] * 2 * exact.abs().max().item()
    assert (got.double() - want.double()).abs().max().item() <= tol
    assert (got.double() - exact).abs().max().item() <= tol


@needs_kernels
def test_rms_norm_takes_strided_rows_and_refuses_a_wrong_weight():
    from thrifty.fused_layers import rms_norm

    x = torch.randn(6, 40, device=DEVICE)[::2]  # rows 2 apart: a row stride of 80
    w = torch.rand(40, device=DEVICE) + 0.5
    assert torch.allclose(rms_norm(x, w, 1e-6), torch_rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(39, device=DEVICE), 1e-6)


@needs_kernels
@pytest.mark.parametrize("dtype, w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("rows, D", [(3, 37), (4, 576), (0, 8)])
def test_add_rms_norm_is_the_sum_then_the_norm(dtype, w_dtype, rows, D):
    from thrifty.fused_layers import add_rms_norm

    g = torch.Generator().manual_seed(rows + D)
    x = torch.randn(rows, D, generator=g).to(dtype).to(DEVICE)
    r = torch.randn(rows, D, generator=g).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(w_dtype).to(DEVICE)
    total, normed = add_rms_norm(x, r, w, 1e-5)
    if DEVICE == "cuda":  # the sum is rounded once to nearest, as PyTorch's
        assert torch.equal(total, x + r)
    elif rows:  # the interpreter's fp32 -> 16-bit cast does not round to nearest: one unit in the last place
        assert (total.double() - (x + r).double()).abs().max().item() <= ULP[dtype] * (x + r).abs().max().item()
    want = torch_rms_norm(x + r, w, 1e-5)
    assert normed.dtype == want.dtype
    if rows:
        tol = ULP[dtype] * 2 * want.abs().max().item()
        assert (normed.double() - want.double()).abs().max().item() <= tol
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, r.float() if dtype != torch.float32 else r.half(), w, 1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["silu", "relu2"])
@pytest.mark.parametrize("rows, F", [(3, 45), (2, 3000)])
def test_glu_is_the_activation_then_the_product(dtype, kind, rows, F):
    """On the halves of one stacked output (strided rows), as a stacked gate/up projection gives them."""
    from thrifty.bitnet.recipes import relu_squared
    from thrifty.fused_layers import glu
    from thrifty.models.llama import glu_kind

    act = torch.nn.functional.silu if kind == "silu" else relu_squared
    assert glu_kind(act) == kind
    g = torch.Generator().manual_seed(rows * F)
    both = (torch.randn(rows, 2 * F, generator=g) * 3).to(dtype).to(DEVICE)
    gate, up = both[:, :F], both[:, F:]
    got = glu(gate, up, kind)
    want = act(gate) * up
    assert got.dtype == dtype and got.shape == gate.shape
    tol = ULP[dtype] * 4 * want.abs().max().item() + (1e-6 if kind == "silu" else 0.0)
    assert (got.double() - want.double()).abs().max().item() <= tol
    with pytest.raises(ValueError, match="kind"):
        glu(gate, up, "gelu")


def torch_rope(rotary, x, positions):
    with torch.enable_grad():
        return rotary(x, positions).detach()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, H, T, Dh, per_row", [(2, 3, 5, 64, False), (1, 4, 1, 6, False), (2, 2, 3, 16, True)])
def test_rope_matches_the_pytorch_form_and_float64(dtype, B, H, T, Dh, per_row):
    from thrifty.fused_layers import rope

    g = torch.Generator().manual_seed(B * 100 + T * 10 + Dh)
    rotary = RotaryEmbedding(Dh, 10000.0).to(DEVICE)
    # (B, T, H, Dh) viewed as (B, H, T, Dh): the strides q and k have in the model
    x = torch.randn(B, T, H, Dh, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
    positions = (torch.randint(0, 5000, (B, T), generator=g) if per_row else torch.arange(7, 7 + T)).to(DEVICE)
    cos, sin = rotary.cos_sin(positions)
    got = rope(x, cos, sin)
    want = torch_rope(rotary, x, positions)
    assert got.dtype == dtype and got.shape == (B, H, T, Dh) and got.is_contiguous()
    c, s = (cos[:, None] if cos.ndim == 3 else cos).double(), (sin[:, None] if sin.ndim == 3 else sin).double()
    x64 = x.double()
    exact = x64 * c + torch.cat((-x64[..., Dh // 2:], x64[..., : Dh // 2]), -1) * s
    tol = ULP[dtype] * 2 * exact.abs().max().item()
    assert (got.double() - want.double()).abs().max().item() <= tol
    assert (got.double() - exact).abs().max().item() <= tol


@needs_kernels
def test_rope_refuses_tables_of_the_wrong_shape_or_dtype():
    from thrifty.fused_layers import rope

    x = torch.randn(1, 2, 3, 8, device=DEVICE)
    cos = torch.ones(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="cos"):
        rope(x, cos[:2], cos[:2])
    with pytest.raises(ValueError, match="cos, sin"):
        rope(x, cos.double(), cos.double())


def unfused_step(rotary, q, k, v, keys, values, positions):
    """What the static cache does on CUDA without the fused kernel: the RoPE kernel on q and on k, then two index
    copies."""
    from thrifty.fused_layers import rope

    cos, sin = rotary.cos_sin(positions)
    keys, values = keys.clone(), values.clone()
    keys.index_copy_(2, positions, rope(k, cos, sin).to(keys.dtype))
    values.index_copy_(2, positions, v.to(values.dtype))
    return rope(q, cos, sin), keys, values


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, HQ, HK, T, Dh", [(1, 4, 2, 1, 64), (2, 3, 3, 3, 6), (2, 6, 2, 2, 130)])
def test_rope_qk_into_cache_is_rope_then_index_copy_bit_for_bit(dtype, B, HQ, HK, T, Dh):
    """q, k, v as strided views of one stacked projection output (as the model hands them over), positions in no
    order; the rotated q and both buffers equal the RoPE kernel + index_copy_ exactly (what the cache runs on CUDA
    without the fused kernel), other slots untouched; and against float64 within the dtype's rounding."""
    from thrifty.fused_layers import rope_qk_into_cache

    g = torch.Generator().manual_seed(B * 1000 + HQ * 100 + T * 10 + Dh)
    rotary = RotaryEmbedding(Dh, 10000.0).to(DEVICE)
    width = (HQ + 2 * HK) * Dh
    y = torch.randn(B, T, width, generator=g).to(dtype).to(DEVICE)
    q = y[..., : HQ * Dh].view(B, T, HQ, Dh).transpose(1, 2)
    k = y[..., HQ * Dh: (HQ + HK) * Dh].view(B, T, HK, Dh).transpose(1, 2)
    v = y[..., (HQ + HK) * Dh:].view(B, T, HK, Dh).transpose(1, 2)
    capacity = 11
    positions = torch.randperm(capacity, generator=g)[:T].to(DEVICE)
    keys = torch.randn(B, HK, capacity, Dh, generator=g).to(dtype).to(DEVICE)
    values = torch.randn(B, HK, capacity, Dh, generator=g).to(dtype).to(DEVICE)
    want_q, want_k, want_v = unfused_step(rotary, q, k, v, keys, values, positions)
    cos, sin = rotary.cos_sin(positions)
    got_q = rope_qk_into_cache(q, k, v, cos, sin, keys, values, positions)
    assert got_q.shape == (B, HQ, T, Dh) and got_q.is_contiguous() and got_q.dtype == dtype
    assert torch.equal(got_q, want_q) and torch.equal(keys, want_k) and torch.equal(values, want_v)
    exact = torch.cat((-k.double()[..., Dh // 2:], k.double()[..., : Dh // 2]), -1) * sin.double() + \
        k.double() * cos.double()
    written = keys.double()[:, :, positions]
    assert (written - exact).abs().max().item() <= ULP[dtype] * 2 * exact.abs().max().item()


@needs_kernels
def test_rope_qk_into_cache_writes_nothing_outside_the_buffer_and_refuses_bad_input():
    from thrifty.fused_layers import rope_qk_into_cache

    rotary = RotaryEmbedding(8, 10000.0).to(DEVICE)
    q, k, v = (torch.randn(1, h, 1, 8, device=DEVICE) for h in (2, 1, 1))
    keys, values = torch.zeros(1, 1, 4, 8, device=DEVICE), torch.zeros(1, 1, 4, 8, device=DEVICE)
    positions = torch.tensor([4], device=DEVICE)  # one past the end: the host checks refuse it before the kernel
    cos, sin = rotary.cos_sin(positions)
    rope_qk_into_cache(q, k, v, cos, sin, keys, values, positions)
    assert not keys.any() and not values.any()
    ok = (q, k, v, cos, sin, keys, values, positions)
    for i, bad, name in ((1, k.half(), "k, v"), (2, v[..., :6], "k, v"), (3, cos.double(), "cos, sin"),
                         (5, keys[:, :, :, :6], "keys, values"), (7, positions.float(), "positions"),
                         (7, positions.view(1, 1), "positions")):
        args = list(ok)
        args[i] = bad
        with pytest.raises(ValueError, match=name):
            rope_qk_into_cache(*args)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_reference_model_inference_takes_the_fused_layers(monkeypatch, dtype):
    """Under no_grad on CUDA every RMSNorm (with the residual add before it: the blocks' last adds are deferred
    into the next norm), GLU and RoPE of the reference model is one launch; with gradients on, none is; the
    logits agree to the dtype's rounding."""
    import thrifty.fused_layers as fused

    calls = {"rms_norm": 0, "add_rms_norm": 0, "glu": 0, "rope": 0}
    for name in calls:
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, (lambda real, name: lambda *a, **k: (
            calls.__setitem__(name, calls[name] + 1), real(*a, **k))[1])(real, name))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).to("cuda", dtype)
    ids = torch.randint(0, 256, (2, 9), device="cuda")
    with torch.no_grad():
        fast = model(ids).float()
    # each block's last add goes into the next norm (the final norm included): only the first norm has no add
    expected = {"rms_norm": 1, "add_rms_norm": 2 * 2, "glu": 2, "rope": 2 * 2}
    assert calls == expected
    slow = model(ids).float().detach()
    assert calls == expected
    assert (fast - slow).abs().max().item() <= (1e-4 if dtype == torch.float32 else 0.1) * slow.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_block_adds_give_the_same_hidden_states(dtype):
    """The blocks run with ``defer=True`` (each block's last residual add handed to the next norm, as LlamaModel
    does on the GPU at inference) give the plain loop's hidden states bit for bit (PyTorch forms here)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    ids = torch.randint(0, 256, (2, 7))
    positions = torch.arange(7)
    inner = model.model
    with torch.no_grad():
        want = inner(ids, positions)
        x, pending = inner.embed_tokens(ids), None
        for layer in inner.layers:
            x, pending = layer(x, positions, inner.rotary, pending=pending, defer=True)
        got = inner.norm.add_and_norm(x, pending)[1]
    assert torch.equal(got, want)
