"""PackedBitLinear: its codes are the training quantizers' bit for bit, its forward is the training BitLinear's
(integer dot exact), the Triton kernels (interpreter on the CPU) equal the PyTorch path, and export/load round
trips while corrupted, truncated and mismatched files are refused."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from thrifty import bitnet
from thrifty.bitnet import BitLinear, PackedBitLinear, reference as ref
from thrifty.bitnet.packed import activation_codes, integer_matmul, ternary_codes
from thrifty.models import LlamaConfig, LlamaForCausalLM
from thrifty.triton_utils import kernels_available

KINDS = ["int8", "int4", "topk_int8"]
needs_kernels = pytest.mark.skipif(not kernels_available("cpu") and not torch.cuda.is_available(),
                                   reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def tokens(m, k, seed=0):
    """Tokens of varied scale with an outlier and an all-zero token (when m > 2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g).mul(4).add(0.05)
    x[0, -1] *= 20
    if m > 2:
        x[-1] = 0
    return x


def layer(k, n, kind, *, sub_norm=False, bias=False, splits=None, seed=0):
    torch.manual_seed(seed)
    bl = BitLinear(k, n, activation=kind, sub_norm=sub_norm, bias=bias, weight_splits=splits)
    with torch.no_grad():
        if bias:
            bl.bias.normal_()
        if sub_norm:
            bl.norm.weight.uniform_(0.5, 1.5)
    return bl


# ----------------------------------------------------------------------------------------------- codes

@pytest.mark.parametrize("splits", [None, (3, 5, 9)])
def test_ternary_codes_times_alpha_is_the_training_weight_bit_for_bit(splits):
    w = torch.randn(17, 70) * 0.03
    codes, alpha = ternary_codes(w, splits)
    assert codes.dtype == torch.int8 and set(codes.unique().tolist()) <= {-1, 0, 1}
    rows = torch.cat([a.repeat(s) for a, s in zip(alpha, splits or (17,))])
    assert torch.equal(codes.float() * rows[:, None], ref.quantize_weight_ternary(w, splits))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_codes_times_scale_is_the_training_quantizer_bit_for_bit(kind, dtype):
    x = tokens(6, 37).to(dtype)
    codes, scale = activation_codes(x, kind, beta_scale=1.0, topk_ratio=0.5)
    lo, hi = (-8, 7) if kind == "int4" else (-128, 127)
    assert codes.dtype == torch.int8 and int(codes.min()) >= lo and int(codes.max()) <= hi
    want = ref.quantize_activation(x, kind).float() if dtype == torch.float32 else None
    got = codes.float() * scale[:, None]
    if want is not None:
        assert torch.equal(got, want)
    else:  # the reference rounds its fp32 result to bf16: so must the codes·scale
        assert torch.equal(got.to(dtype), ref.quantize_activation(x, kind))
    if kind == "topk_int8":
        assert ((codes[:-1] != 0).sum(1) <= math.ceil(0.5 * 37)).all()


def test_a_non_finite_token_gets_a_nan_scale_and_zero_codes():
    x = tokens(3, 9)
    x[1, 2] = float("inf")
    codes, scale = activation_codes(x, "int8")
    assert torch.isnan(scale[1]) and not torch.isnan(scale[[0, 2]]).any()
    assert (codes[1] == 0).all()


# ----------------------------------------------------------------------------------------------- layer

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sub_norm,bias,splits", [(False, False, None), (True, True, (20, 13))])
def test_packed_layer_is_the_training_forward(kind, sub_norm, bias, splits):
    """The integer dot equals the training operands' dot exactly; the output differs from BitLinear's fp32
    F.linear only by fp32 rounding (float64 of the same quantized operands is the judge)."""
    bl = layer(300, 33, kind, sub_norm=sub_norm, bias=bias, splits=splits)
    packed = PackedBitLinear.from_bitlinear(bl, impl="reference")
    x = tokens(5, 300, seed=1)
    with torch.no_grad():
        xq = ref.quantize_activation(bl._normed(x), kind).double()
        wq = ref.quantize_weight_ternary(bl.weight, splits).double()
        exact = F.linear(xq, wq, None if bl.bias is None else bl.bias.double())
        training = bl(x)
        y = packed(x)
    codes, scale = packed.quantize_input(x)
    acc = integer_matmul(codes, packed.ternary())
    alpha_rows = packed.row_scale().double()
    finite = scale > 0
    # the training operands are the codes times their scales (fp32-rounded products): dividing recovers them
    x_int = xq[finite] / scale[finite, None].double()
    w_int = wq / alpha_rows[:, None]
    assert torch.equal(torch.round(x_int), codes[finite].double()) and (x_int - x_int.round()).abs().max() < 1e-4
    assert torch.equal(w_int, packed.ternary().double())
    assert torch.equal(acc[finite].double(), F.linear(torch.round(x_int), w_int))  # exact, not merely close
    tol = 4 * torch.finfo(torch.float32).eps * exact.abs().amax(1, keepdim=True).clamp_min(1e-30)
    assert ((y.double() - exact).abs() <= tol).all()
    assert ((training.double() - exact).abs() <= 16 * tol).all()  # both are fp32 roundings of `exact`
    assert packed.last_path == "reference"


def test_from_bitlinear_refuses_what_it_cannot_pack_exactly():
    with pytest.raises(ValueError, match="activation 'fp4'"):
        PackedBitLinear.from_bitlinear(BitLinear(8, 4, activation="fp4"))
    with pytest.raises(ValueError, match="strength is 0.5"):
        PackedBitLinear.from_bitlinear(BitLinear(8, 4, strength=0.5))
    with pytest.raises(TypeError, match="layer: expected a BitLinear"):
        PackedBitLinear.from_bitlinear(torch.nn.Linear(8, 4))
    p = PackedBitLinear.from_bitlinear(BitLinear(8, 4))
    with pytest.raises(ValueError, match="x: expected 8 features"):
        p(torch.zeros(2, 7))
    with pytest.raises(TypeError, match="x:"):
        p(torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="impl"):
        PackedBitLinear(8, 4, impl="cuda")


def test_packed_weights_are_an_eighth_of_bf16_bytes():
    p = PackedBitLinear.from_bitlinear(BitLinear(4096, 512))
    assert p.packed.numel() == 512 * 4096 // 4
    assert p.packed.numel() / (512 * 4096 * 2) == 0.125


# --------------------------------------------------------------------------------------------- kernels

def _kernel_vs_torch(bl, x, config=None):
    from thrifty.bitnet import packed_kernel

    p = PackedBitLinear.from_bitlinear(bl, impl="reference")
    want = p(x)
    got = packed_kernel.packed_linear(x.reshape(-1, p.in_features), p, config).view(want.shape)
    return got, want


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m,k,n", [(1, 300, 37), (3, 513, 70), (4, 256, 33), (5, 257, 65), (16, 300, 20),
                                   (70, 513, 130)])
def test_kernels_equal_the_torch_path(kind, m, k, n):
    """GEMV (1–4 tokens), tensor-core skinny GEMM (5–64) and prefill GEMM (> 64), odd sizes; INT8/TopK bit for bit,
    INT4 within one code at an exact half (its mean is summed in another order)."""
    bl = layer(k, n, kind, seed=m)
    got, want = _kernel_vs_torch(bl, tokens(m, k, seed=k))
    if kind == "int4":
        assert ((got - want).abs() <= 1e-6 * want.abs().amax()).all()
    else:
        assert torch.equal(got, want)


@needs_kernels
@pytest.mark.parametrize("kernel,block_m", [("gemv", 2), ("gemm", 16)])
def test_split_k_is_exact_and_leaves_the_workspace_zero(kernel, block_m):
    from thrifty.bitnet import packed_kernel

    bl = layer(1100, 45, "int8", bias=True)
    x = tokens(2, 1100, seed=5).to(torch.bfloat16)
    cfg = dict(kernel=kernel, BLOCK_N=32 if kernel == "gemv" else 64, BLOCK_M=block_m, split=3,
               groups_per_split=2, num_warps=4, num_stages=2)
    got, want = _kernel_vs_torch(bl, x, cfg)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not packed_kernel._WORKSPACES[x.device].any()
    assert packed_kernel.scratch_nonzero(x.device) == {"workspace": 0}  # the public check says so too
    again, _ = _kernel_vs_torch(bl, x, cfg)  # a second split call starts from the zeroed workspace
    assert torch.equal(again, want)


def test_scratch_nonzero_counts_what_a_kernel_left_behind():
    """packed_kernel.scratch_nonzero: 0 for buffers not allocated; the count of entries a (broken) kernel left."""
    from thrifty.bitnet import packed_kernel

    device = torch.device("meta")  # no kernel ever allocates here: the pool starts empty for it
    assert packed_kernel.scratch_nonzero(device) == {"workspace": 0}
    with pytest.raises(TypeError, match="device"):
        packed_kernel.scratch_nonzero(0.5)
    with pytest.raises(ValueError, match="device"):
        packed_kernel.scratch_nonzero("not a device")
    cpu = torch.device("cpu")
    saved = packed_kernel._WORKSPACES.get(cpu)
    try:
        packed_kernel._WORKSPACES[cpu] = torch.tensor([0, 3, 0, -1], dtype=torch.int32)
        assert packed_kernel.scratch_nonzero("cpu") == {"workspace": 2}
    finally:
        if saved is None:
            packed_kernel._WORKSPACES.pop(cpu, None)
        else:
            packed_kernel._WORKSPACES[cpu] = saved


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "topk_int8"])
def test_kernels_with_sub_norm_bias_and_nan_token(kind):
    """The kernel's fused sub-norm is quant_kernel's (1/√ correctly rounded, PyTorch's rsqrt is not): codes may
    move by one at a rounding half, so the outputs agree to a code's worth, and a NaN token stays NaN."""
    bl = layer(200, 24, kind, sub_norm=True, bias=True)
    x = tokens(3, 200, seed=2)
    x[1, 5] = float("nan")
    got, want = _kernel_vs_torch(bl, x)
    assert torch.isnan(got[1]).all() and torch.isnan(want[1]).all()
    ok = [0, 2]
    assert not torch.isnan(got[ok]).any()
    assert ((got[ok] - want[ok]).abs() <= 2e-6 * want[ok].abs().amax() + 1e-6).all()


@needs_kernels
def test_forward_routes_to_the_kernels_when_asked():
    p = PackedBitLinear.from_bitlinear(layer(64, 16, "int8"), impl="triton")
    y = p(tokens(2, 64))
    assert p.last_path == "triton" and y.shape == (2, 16)


# ---------------------------------------------------------------------------------------------- export

def tiny_model(recipe="a4.8", seed=0):
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg, linear=bitnet.linear_factory(recipe), activation=bitnet.mlp_activation(recipe))
    model.init_weights(seed=seed)
    return model.eval()


def rebuild(path, impl="reference"):
    """The reference model of an export, built from its header with PackedBitLinear shells, then loaded."""
    head = bitnet.read_header(path)
    model = LlamaForCausalLM(LlamaConfig(**head["model_config"]), linear=bitnet.packed_factory(head, impl=impl),
                             activation=bitnet.relu_squared)
    shells = [m for m in model.modules() if isinstance(m, PackedBitLinear)]
    assert len(shells) == len(head["layers"])  # no full-precision weight was built for a ternary layer
    return bitnet.load(path, model).eval()


def logits(out):
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("storage", ["2bit", "base3"])
def test_export_load_round_trip_gives_the_packed_model_logits(tmp_path, storage):
    model = tiny_model("a4.8")
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    path = bitnet.export(model, tmp_path / "m.safetensors", storage=storage)
    loaded = rebuild(path)
    assert sum(isinstance(m, PackedBitLinear) for m in loaded.modules()) == 2 * 7
    assert not any(isinstance(m, BitLinear) for m in loaded.modules())
    with torch.no_grad():
        assert torch.equal(logits(loaded(ids)), logits(bitnet.pack(model, impl="reference")(ids)))


@pytest.mark.parametrize("recipe", ["a4.8", "b1.58"])
def test_from_packed_builds_the_model_from_the_file_alone(tmp_path, recipe):
    """No model to pass: the export's header holds the config and recipe; the same logits as the manual rebuild,
    no full-precision ternary layer, and a file from another architecture is refused by name."""
    model = tiny_model(recipe)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    path = bitnet.export(model, tmp_path / "m.safetensors")
    loaded = LlamaForCausalLM.from_packed(path, impl="reference")
    assert not any(isinstance(m, BitLinear) for m in loaded.modules())
    assert sum(isinstance(m, PackedBitLinear) for m in loaded.modules()) == 2 * 7
    with torch.no_grad():
        assert torch.equal(logits(loaded(ids)), logits(rebuild(path)(ids)))
    with pytest.raises(ValueError, match="missing"):
        LlamaForCausalLM.from_packed(tmp_path / "absent.safetensors")


@pytest.mark.parametrize("recipe", ["a4.8", "b1.58"])
def test_export_of_a_packed_or_stacked_model_is_the_export_of_its_bitlinears(tmp_path, recipe):
    """A model already packed (bitnet.pack), or packed with q/k/v and gate/up stacked (what the "serve-bitnet"
    preset leaves), exports the same tensors and recipe as its BitLinear model: from_packed builds it unstacked
    with the recipe's ReLU² and gives the packed model's logits."""
    from safetensors.torch import load_file

    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(4))
    model = tiny_model(recipe)
    want = load_file(str(bitnet.export(model, tmp_path / "bitlinear.safetensors")))
    bitnet.pack(model, impl="reference")
    for form in ("packed", "stacked"):
        if form == "stacked":
            bitnet.stack_projections(model)
        path = bitnet.export(model, tmp_path / f"{form}.safetensors")
        got = load_file(str(path))
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), form
        assert bitnet.read_header(path)["recipe"] == recipe
        with torch.no_grad():
            assert torch.equal(logits(LlamaForCausalLM.from_packed(path, impl="reference")(ids)), logits(model(ids)))


def test_siblings_quantize_their_shared_input_once(tmp_path, monkeypatch):
    """q/k/v and gate/up read one tensor: packed (in memory or loaded through packed_factory) they quantize it
    once per forward, with the same logits as without sharing."""
    from thrifty.bitnet import packed as packed_module

    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    path = bitnet.export(tiny_model("b1.58"), tmp_path / "m.safetensors")
    for model in (bitnet.pack(tiny_model("b1.58"), impl="reference"), rebuild(path)):
        calls = []
        original = packed_module.activation_codes
        monkeypatch.setattr(packed_module, "activation_codes", lambda *a, **k: calls.append(1) or original(*a, **k))
        with torch.no_grad():
            shared = logits(model(ids))
        assert len(calls) == 2 * 4  # per layer: q/k/v once, o, gate/up once, down
        for m in model.modules():
            if isinstance(m, PackedBitLinear):
                m.shared_input = None
        with torch.no_grad():
            assert torch.equal(logits(model(ids)), shared)
        assert len(calls) == 2 * 4 + 2 * 7
        monkeypatch.undo()


def test_packed_model_is_the_training_model():
    """b1.58 end to end: fp32 rounding only. (In a4.8 an ulp of difference in the attention output can flip a
    near-tie of TopK at the first positions, a discrete change the per-layer test above rules out as a bug.)"""
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        training = logits(tiny_model("b1.58")(ids))
        packed = logits(bitnet.pack(tiny_model("b1.58"), impl="reference")(ids))
    assert ((training - packed).abs() <= 1e-5 * training.abs().max()).all()


def test_load_into_a_given_model_and_mismatches_refused(tmp_path):
    path = bitnet.export(tiny_model(), tmp_path / "m.safetensors")
    target = tiny_model(seed=3)
    bitnet.load(path, target)
    assert isinstance(target.model.layers[0].self_attn.q_proj, PackedBitLinear)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="m.safetensors: layer .* in the file"):
        bitnet.load(path, other)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())  # untouched


def _corrupt(path, offset_from_end, new=None, truncate=False):
    data = bytearray(path.read_bytes())
    if truncate:
        data = data[:-offset_from_end]
    else:
        data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupted_truncated_and_foreign_files_are_refused(tmp_path):
    good = bitnet.export(tiny_model(), tmp_path / "m.safetensors")
    raw = good.read_bytes()
    bad = tmp_path / "bad.safetensors"
    for damage, match in ((lambda p: _corrupt(p, 10), "checksum mismatch"),
                          (lambda p: _corrupt(p, 100, truncate=True), "not a readable safetensors"),
                          (lambda p: p.write_bytes(b"\x00" * 40), "not a readable safetensors")):
        bad.write_bytes(raw)
        damage(bad)
        with pytest.raises(ValueError, match=match):
            bitnet.load(bad, tiny_model())
    # a header edited by hand (valid JSON, wrong shape): the header checksum catches it
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(good), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    layers = json.loads(meta["layers"])
    layers["model.layers.0.mlp.down_proj"]["in_features"] = 47
    save_file(tensors, str(bad), metadata={**meta, "layers": json.dumps(layers)})
    with pytest.raises(ValueError, match="header checksum mismatch"):
        bitnet.load(bad, tiny_model())
    with pytest.raises(ValueError, match="header checksum mismatch"):
        bitnet.read_header(bad)
    save_file(tensors, str(bad), metadata={k: v for k, v in meta.items() if k != "format"})
    with pytest.raises(ValueError, match="not a thrifty BitNet export"):
        bitnet.load(bad, tiny_model())
    with pytest.raises(ValueError, match="missing"):
        bitnet.load(tmp_path / "absent.safetensors", tiny_model())
    with pytest.raises(TypeError, match="model: expected an nn.Module"):
        bitnet.load(good, None)


def test_export_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="no BitLinear"):
        bitnet.export(tiny_model("fp"), tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="storage"):
        bitnet.export(tiny_model(), tmp_path / "x.safetensors", storage="1bit")
    with pytest.raises(ValueError, match="path: the folder"):
        bitnet.export(tiny_model(), tmp_path / "no" / "x.safetensors")
    with pytest.raises(TypeError, match="model: expected an nn.Module"):
        bitnet.export("model", tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match=r"model: model\.layers\.0\.self_attn\.q_proj: activation 'fp4' has no "
                                         "integer packed path"):
        bitnet.export(tiny_model("a4.8-fp4"), tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()  # nothing half-written


@pytest.mark.parametrize("spoil, match", [
    (lambda layer: layer.configure(strength=0.5), r"model: model\.layers\.1\.mlp\.down_proj: strength is 0\.5; only "
                                                  "a fully converted layer"),
    (lambda layer: layer.configure(activation="fp4"), r"model: model\.layers\.1\.mlp\.down_proj: activation 'fp4' "
                                                      "has no integer packed path"),
])
def test_pack_checks_every_layer_before_converting_any(spoil, match, monkeypatch):
    """One layer that cannot pack, the last of the model, among packable ones: pack refuses by its name before
    it converts any layer, and the model keeps every BitLinear and its state."""
    converted = []
    real = PackedBitLinear.from_bitlinear.__func__
    monkeypatch.setattr(PackedBitLinear, "from_bitlinear",
                        classmethod(lambda cls, layer, **kw: converted.append(layer) or real(cls, layer, **kw)))
    model = tiny_model()
    spoil(model.model.layers[1].mlp.down_proj)
    names = [n for n, m in model.named_modules() if isinstance(m, bitnet.BitLinear)]
    assert names[-1] == "model.layers.1.mlp.down_proj" and len(names) == 14
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        bitnet.check_packable(model)
    with pytest.raises(ValueError, match=match):
        bitnet.pack(model)
    assert converted == []
    assert [n for n, m in model.named_modules() if isinstance(m, bitnet.BitLinear)] == names
    assert not any(isinstance(m, PackedBitLinear) for m in model.modules())
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    with pytest.raises(TypeError, match="model: expected an nn.Module"):
        bitnet.check_packable("model")


# --------------------------------------------------------------------------------------------------- GPU

@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 3, 16, 200, 2048])
def test_compiled_kernels_equal_the_torch_path_on_cuda(kind, m):
    """The GPU build (inline PTX: dp4a, 4-byte decode; wgmma; cp.async pipelining), which the interpreter never
    runs: 7B-like and odd shapes, every plan (2048 tokens of 4096x4096: the square prefill tile), against the
    PyTorch path on the same GPU."""
    torch.backends.cuda.matmul.allow_tf32 = False  # the PyTorch path's fp32 integer matmul must stay exact
    for k, n in ((4096, 4096), (1100, 333)):
        bl = layer(k, n, kind, seed=m).cuda()
        got, want = _kernel_vs_torch(bl, tokens(m, k, seed=k).cuda().to(torch.bfloat16))
        if kind == "int4":  # a code may move at an exact half (mean summed in another order): rare and small
            same = got == want
            assert same.float().mean() >= 0.99, (kind, m, k, n)
            assert ((got.float() - want.float()).abs() <= 1e-2 * want.float().abs().amax()).all()
        else:
            assert torch.equal(got, want), (kind, m, k, n)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel,m", [("gemv", 1), ("gemv", 4), ("gemm", 16)])
def test_split_k_on_cuda_is_exact(kernel, m):
    """Integer atomics on real concurrent programs."""
    from thrifty.bitnet import packed_kernel

    bl = layer(11008, 256, "int8", bias=True).cuda()
    x = tokens(m, 11008, seed=9).cuda().to(torch.bfloat16)
    cfg = dict(kernel=kernel, BLOCK_N=32 if kernel == "gemv" else 64, BLOCK_M=max(m, 16) if kernel == "gemm" else m,
               split=8, groups_per_split=6, num_warps=4, num_stages=4)
    for _ in range(3):  # repeated: a race would show as a mismatch in some run
        got, want = _kernel_vs_torch(bl, x, cfg)
        assert torch.equal(got, want)
    assert not packed_kernel._WORKSPACES[x.device].any()


# ------------------------------------------------------------------------------------- decode GEMV at 1-4 tokens

@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("m,k,n,sub_norm,bias", [(1, 300, 37, False, False), (2, 513, 70, True, True),
                                                 (3, 1100, 45, False, True), (4, 257, 33, True, False)])
def test_decode_gemv_at_few_tokens(kind, m, k, n, sub_norm, bias):
    """The v3 decode GEMV at 1–4 tokens (one grid row per token) of an INT8 / INT4-range layer on the codes kernel's
    codes: bit for bit the split-K GEMV on the same codes, the PyTorch path's output for INT8 without a sub-norm
    (a sum — sub-norm, INT4's mean — is added in another order: a code may move at an exact half); NaN and
    all-zero tokens; K not a multiple of the chunk."""
    from thrifty.bitnet import packed_kernel as PK

    bl = layer(k, n, kind, sub_norm=sub_norm, bias=bias, seed=m)
    p = PackedBitLinear.from_bitlinear(bl, impl="reference")
    x = tokens(m, k, seed=k + m)
    if m >= 2:
        x[1, 3] = float("nan")
    cfg = PK.decode_plan(m, n, k)
    got = PK.packed_linear(x, p, cfg)
    gemv = dict(kernel="gemv", BLOCK_N=32, BLOCK_M=PK._pow2(m), split=1, groups_per_split=10 ** 6, num_warps=4,
                num_stages=1)
    two = PK.matmul_codes(*PK.layer_codes(x, p), p.packed, p.row_scale(), p.bias, x.dtype, n, k, gemv)
    want = p(x)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and (nan.any(1) == torch.isnan(x).any(1)).all()
    ok = ~nan
    assert torch.equal(got[ok], two[ok])
    if kind == "int8" and not sub_norm:
        assert torch.equal(got[ok], want[ok])
    else:
        assert ((got[ok] - want[ok]).abs() <= 2e-6 * want[ok].abs().amax() + 1e-6).all()
    if m >= 3:  # the all-zero token: bias only
        assert torch.equal(got[-1], want[-1])


def test_decode_plan_7b_shapes_take_the_v3_tile():
    """decode_plan is the v3 GEMV on ready codes (8 rows per program, 2 warps, K chunks of 256 int32 words: one chunk
    at K = 4096 with plain loads, three at 11008 pipelined in 3 stages) for 1–4 tokens; plan() gives it 1 token and
    2 tokens of a layer of ≤ 4096 rows, wider layers and 3–4 tokens the tensor-core GEMM (measured faster there)."""
    from thrifty.bitnet import packed_kernel as PK

    v3 = {(4096, 4096): 1, (12288, 4096): 1, (22016, 4096): 1, (4096, 11008): 3, (11008, 4096): 1}
    for (n, k), stages in v3.items():
        cfg = PK.plan(1, n, k, 132)
        assert cfg == PK.decode_plan(1, n, k, 132) == PK.decode_plan(4, n, k, 132)
        assert (cfg["kernel"], cfg["version"], cfg["rows_per_program"], cfg["BLOCK_N"], cfg["KW"], cfg["num_warps"],
                cfg["num_stages"]) == ("decode", 3, 8, 8, 256, 2, stages), (n, k, cfg)
        for m in (2, 3, 4):
            cfg = PK.plan(m, n, k, 132)
            if m == 2 and n <= 4096:
                assert cfg == PK.decode_plan(1, n, k, 132)
            else:
                assert cfg["kernel"] == "gemm" and cfg == PK.plan(16, n, k, 132), (m, n, k, cfg)
    assert PK.decode_plan(1, 1024, 2560, 132)["rows_per_program"] == 4  # 8 rows: < 2 programs per SM
    assert PK.decode_plan(1, 64, 1100, 132)["KW"] == 128  # < 256 words per row: 1 warp
    for m in (0, 5):
        with pytest.raises(ValueError, match="1–4 tokens"):
            PK.decode_plan(m, 64, 64)


@needs_kernels
def test_prefill_takes_square_tiles_where_they_fill_the_gpu():
    """More than 32 tokens: 128x128 tiles where the layer has ≥ 4096 rows and they fill 1.5 waves (7B layers at
    1024–2048 tokens), else 64x64 (the 2B's 2560-row layers, 512 tokens of 4096 rows), all 4 warps; the square tile
    equals the torch path bit for bit (odd K and N, a partial token tile)."""
    from thrifty.bitnet import packed_kernel as PK

    def tile(m, n):
        p = PK.plan(m, n, 4096, 132)
        return p["BLOCK_N"], p["BLOCK_M"], p["num_warps"]

    assert tile(2048, 4096) == tile(1024, 4096) == tile(512, 11008) == (128, 128, 4)
    assert tile(2048, 2560) == tile(512, 4096) == tile(129, 22016) == tile(64, 4096) == (64, 64, 4)
    assert tile(32, 4096) == (64, 16, 4)
    bl = layer(300, 150, "int8", bias=True, seed=7)
    cfg = dict(PK.plan(130, 150, 300), BLOCK_N=128, BLOCK_M=128)
    got, want = _kernel_vs_torch(bl, tokens(130, 300, seed=7), cfg)
    assert torch.equal(got, want)


@needs_kernels
def test_few_token_forwards_quantize_once_then_multiply(monkeypatch):
    """PackedBitLinear's kernel path at 2 rows of a narrow INT8 layer: the codes kernel once, then the v3 GEMV (one
    grid row per token); at 3 rows the codes kernel once, then the tensor-core GEMM; both equal the reference (1 row:
    test_one_token_runs_v3_on_codes_made_once_per_input)."""
    from thrifty.bitnet import packed_kernel as PK

    p = PackedBitLinear.from_bitlinear(layer(64, 16, "int8"), impl="triton")
    ref = PackedBitLinear.from_bitlinear(layer(64, 16, "int8"), impl="reference")
    launched = []
    codes_kernel = PK.quantize_codes
    monkeypatch.setattr(PK, "quantize_codes", lambda *a, **k: launched.append(1) or codes_kernel(*a, **k))
    assert PK.plan(2, 16, 64)["version"] == 3 and PK.plan(3, 16, 64)["kernel"] == "gemm"
    assert torch.equal(p(tokens(2, 64)), ref(tokens(2, 64))) and p.last_path == "triton" and launched == [1]
    assert torch.equal(p(tokens(3, 64)), ref(tokens(3, 64))) and launched == [1, 1]


# ------------------------------------------------------------------------------------------- decode GEMV v3

def _float64_output(codes, scale, packed_layer):
    """((Σ codes·t) · s) · α (+ b) in float64 from the integer codes: what the fp32 epilogue rounds."""
    acc = integer_matmul(codes.long(), packed_layer.ternary()).double()
    y = acc * scale.double()[:, None] * packed_layer.row_scale().double()[None, :]
    return y + packed_layer.bias.double() if packed_layer.bias is not None else y


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k,n,sub_norm,bias", [(300, 37, False, False), (1100, 45, True, True),
                                              (5000, 19, False, True), (4100, 70, True, False)])
def test_decode_v3_on_ready_codes(kind, k, n, sub_norm, bias):
    """v3 (1 token, odd K and N: one chunk of 128 words, one of 256 partly masked, two pipelined chunks of 256)
    on the codes kernel's codes: bit for bit the split-K GEMV's result on the same codes (the integer dot is
    exact, the epilogue the same), the float64 value of those codes within fp32 rounding, and the PyTorch path's
    output (bit for bit for INT8 / TopK without a sub-norm; else a code may move at an exact half, as the codes
    kernel's sums are added in another order)."""
    from thrifty.bitnet import packed_kernel as PK

    bl = layer(k, n, kind, sub_norm=sub_norm, bias=bias, seed=k)
    p = PackedBitLinear.from_bitlinear(bl, impl="reference")
    x = tokens(1, k, seed=n)
    cfg = PK.decode_plan(1, n, k)
    assert cfg["version"] == 3
    codes = PK.layer_codes(x, p)
    got = PK.matmul_codes(*codes, p.packed, p.row_scale(), p.bias, x.dtype, n, k, cfg)
    gemv = dict(kernel="gemv", BLOCK_N=32, BLOCK_M=1, split=1, groups_per_split=10 ** 6, num_warps=4, num_stages=1)
    assert torch.equal(got, PK.matmul_codes(*codes, p.packed, p.row_scale(), p.bias, x.dtype, n, k, gemv))
    exact = _float64_output(codes[0][:, :k], codes[1], p)
    assert ((got.double() - exact).abs() <= 4 * torch.finfo(torch.float32).eps * exact.abs().amax()).all()
    want = p(x)
    if kind != "int4" and not sub_norm:
        assert torch.equal(got, want)
    else:
        assert ((got - want).abs() <= 2e-6 * want.abs().amax() + 1e-6).all()
    assert torch.equal(PK.packed_linear(x, p), got)  # the planned layer path: codes kernel + v3


@needs_kernels
@pytest.mark.parametrize("rows,block_n,kw,warps,stages", [(6, 8, 128, 1, 2), (3, 4, 256, 2, 3), (16, 16, 128, 1, 1)])
def test_decode_v3_tiles_tokens_and_bad_rows(rows, block_n, kw, warps, stages):
    """Other v3 tiles than the plan's (rows_per_program not a power of two, 1–2 warps, several chunks with a
    partial last one) and several tokens (one per program column): a NaN token stays NaN, an all-zero token
    gives the bias, bf16 output, every other output the PyTorch path's bit for bit (INT8)."""
    from thrifty.bitnet import packed_kernel as PK

    bl = layer(2100, 45, "int8", bias=True)  # 144 int32 words per row: 2 chunks of 128, the second mostly masked
    p = PackedBitLinear.from_bitlinear(bl, impl="reference")
    x = tokens(3, 2100, seed=3).to(torch.bfloat16)
    x[1, 7] = float("nan")
    cfg = dict(kernel="decode", version=3, BLOCK_N=block_n, BLOCK_M=1, rows_per_program=rows, KW=kw, SB=0, split=1,
               num_warps=warps, num_stages=stages)
    got = PK.packed_linear(x, p, cfg)
    want = p(x)
    assert got.dtype == torch.bfloat16 and torch.isnan(got[1]).all()
    assert torch.equal(got[[0, 2]], want[[0, 2]]) and torch.equal(got[2], p.bias.to(torch.bfloat16))


@needs_kernels
def test_one_token_runs_v3_on_codes_made_once_per_input(monkeypatch):
    """PackedBitLinear's kernel path at 1 row: the codes kernel once per input (siblings sharing an input reuse
    it), then the v3 decode GEMV with the PyTorch path's output; at 2 rows of this narrow layer the same two kernels
    (v3 with one grid row per token)."""
    from thrifty.bitnet import packed_kernel as PK
    from thrifty.bitnet.bitlinear import SharedInput

    ran = []
    for name in ("_ACT_LAUNCH", "_DECODE_V3_LAUNCH", "_GEMV_LAUNCH", "_GEMM_LAUNCH"):
        launcher = getattr(PK, name)
        monkeypatch.setattr(PK, name, lambda *a, _l=launcher, _n=name, **kw: ran.append(_n) or _l(*a, **kw))
    shared = SharedInput(3)
    siblings = []
    for n in (24, 8, 8):
        p = PackedBitLinear.from_bitlinear(layer(64, n, "int8", seed=n), impl="triton")
        p.shared_input = shared
        siblings.append(p)
    x = tokens(1, 64)
    got = [p(x) for p in siblings]
    assert ran == ["_ACT_LAUNCH"] + ["_DECODE_V3_LAUNCH"] * 3
    for p, y in zip(siblings, got):
        p.impl = "reference"
        assert torch.equal(y, p(x)) and y.shape == (1, p.out_features)
    ran.clear()
    p = siblings[0]
    p.impl, p.shared_input = "triton", None
    p(tokens(2, 64))
    assert ran == ["_ACT_LAUNCH", "_DECODE_V3_LAUNCH"]


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(4096, 4096), (12288, 4096), (4096, 11008), (2560, 6912), (333, 1100)])
def test_decode_v3_on_cuda_equals_the_torch_path(n, k):
    """The compiled v3 (16-byte loads, cp.async pipeline at 11008 / 6912, inline dp4a) at the 7B / 2B plans."""
    from thrifty.bitnet import packed_kernel as PK

    torch.backends.cuda.matmul.allow_tf32 = False
    bl = layer(k, n, "int8", bias=True, seed=n).cuda()
    x = tokens(1, k, seed=k).cuda().to(torch.bfloat16)
    assert PK.plan(1, n, k, PK._sm_count(x.device))["version"] == 3
    got, want = _kernel_vs_torch(bl, x)
    assert torch.equal(got, want)


def _assert_graph_replays_exact(p, xs, want):
    """``p`` captured in a CUDA graph on a static copy of ``xs[0]``, then replayed on each input in reverse order:
    every output equals ``want`` bit for bit (a kernel launched early must still wait for the codes it reads)."""
    static = xs[0].clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = p(static)
    for x, w in zip(xs[::-1], want[::-1]):
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, w)


@pytest.mark.cuda
def test_decode_v3_launches_early_on_hopper_and_stays_exact_in_a_graph():
    """sm_90: the v3 GEMV is launched with programmatic dependent launch (its compiled kernel carries the
    attribute: the fast path ran) behind the codes kernel that lets it start; eager and CUDA-graph replays equal
    the torch path bit for bit, also when the input changes between replays (the GEMV waits for its codes)."""
    from thrifty.bitnet import packed_kernel as PK

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    torch.backends.cuda.matmul.allow_tf32 = False
    assert PK.pdl_ok(torch.device("cuda"))
    bl = layer(4096, 4096, "int8", bias=True, seed=3).cuda()
    ref_layer = PackedBitLinear.from_bitlinear(bl, impl="reference")
    p = PackedBitLinear.from_bitlinear(bl, impl="triton")
    xs = [tokens(1, 4096, seed=s).cuda().to(torch.bfloat16) for s in range(3)]
    with torch.no_grad():
        want = [ref_layer(x) for x in xs]
        assert torch.equal(p(xs[0]), want[0])
        assert any(kernel.metadata.launch_pdl for kernel, _ in PK._DECODE_V3_LAUNCH.cache.values())
        _assert_graph_replays_exact(p, xs, want)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [3, 16])
def test_gemm_of_few_tokens_launches_early_on_hopper_and_stays_exact_in_a_graph(m):
    """sm_90: the tensor-core GEMM of few tokens on a grid of ≤ 2 programs per SM (4096 rows: 64) is launched with
    programmatic dependent launch behind its codes kernel (the compiled kernel carries the attribute: the fast path
    ran); a grid of more programs per SM is not. Eager and CUDA-graph replays equal the reference bit for bit, also
    when the input changes between replays (the GEMM waits for its codes)."""
    from thrifty.bitnet import packed_kernel as PK

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    assert PK.plan(m, 4096, 4096)["kernel"] == "gemm"
    assert PK.gemm_launches_early(m, 64, dev) and not PK.gemm_launches_early(m, 3 * PK._sm_count(dev), dev)
    bl = layer(4096, 4096, "int8", bias=True, seed=5).cuda()
    ref_layer = PackedBitLinear.from_bitlinear(bl, impl="reference")
    p = PackedBitLinear.from_bitlinear(bl, impl="triton")
    xs = [tokens(m, 4096, seed=s).cuda().to(torch.bfloat16) for s in range(3)]
    with torch.no_grad():
        want = [ref_layer(x) for x in xs]
        PK._GEMM_LAUNCH.cache.clear()
        assert torch.equal(p(xs[0]), want[0])
        assert [kernel.metadata.launch_pdl for kernel, _ in PK._GEMM_LAUNCH.cache.values()] == [True]
        _assert_graph_replays_exact(p, xs, want)


def test_norm_codes_refuses_bad_arguments_by_name():
    """Checked before any launch: the quantizer kind (TopK is not fused), the weight's shape, the residual's shape
    and dtype, and a row longer than the kernel's."""
    from thrifty.bitnet import packed_kernel as PK

    x, w = torch.randn(2, 64), torch.ones(64)
    with pytest.raises(ValueError, match="kind"):
        PK.norm_codes(x, w, 1e-5, "topk_int8")
    with pytest.raises(ValueError, match="weight"):
        PK.norm_codes(x, torch.ones(63), 1e-5, "int8")
    with pytest.raises(ValueError, match="residual"):
        PK.norm_codes(x, w, 1e-5, "int8", residual=torch.randn(2, 32))
    with pytest.raises(ValueError, match="residual"):
        PK.norm_codes(x, w, 1e-5, "int8", residual=torch.randn(2, 64, dtype=torch.float64))
    D = PK.MAX_ROW["int8"] + 1
    with pytest.raises(ValueError, match="x: rows"):
        PK.norm_codes(torch.randn(1, D), torch.ones(D), 1e-5, "int8")


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("D,dtype,add", [(64, torch.float32, False), (300, torch.bfloat16, True),
                                         (1024, torch.bfloat16, False)])
def test_norm_codes_are_the_fused_norm_then_the_codes_kernel(kind, D, dtype, add):
    """packed_kernel.norm_codes (the norm in front of a stacked projection writing its codes): y and the residual
    sum are fused_layers' bit for bit, the codes the codes kernel's on y (zero-padded to whole groups, also past a
    short row's block); INT4's mean is summed in another order: a code may move by one at an exact half."""
    from thrifty import fused_layers as FL
    from thrifty.bitnet import packed_kernel as PK

    g = torch.Generator().manual_seed(D)
    x = (torch.randn(3, D, generator=g) * 2).to(dtype)
    r = torch.randn(3, D, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    x[1] = 0  # an all-zero row (no residual): zero codes, scale 0
    if add:
        total, y, codes = PK.norm_codes(x, w, 1e-5, kind, beta_scale=2.0, residual=r)
        want_total, want_y = FL.add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(total, want_total)
    else:
        y, codes = PK.norm_codes(x, w, 1e-5, kind, beta_scale=2.0)
        want_y = FL.rms_norm(x, w, 1e-5)
    assert torch.equal(y, want_y) and codes[0].shape == (3, -(-D // 256) * 256)
    want = PK.quantize_codes(want_y, kind, beta_scale=2.0)
    if kind == "int8":
        assert all(torch.equal(a, b) for a, b in zip(codes, want))
    else:
        assert (codes[0].int() - want[0].int()).abs().max() <= 1 and torch.allclose(codes[1], want[1], rtol=1e-6)
    assert not codes[0][:, D:].any()


@pytest.mark.cuda
def test_norm_codes_on_cuda_are_the_fused_norm_then_the_codes_kernel():
    """The compiled norm + codes launch at the 7B width: y, the sum and the INT8 codes bit for bit."""
    from thrifty import fused_layers as FL
    from thrifty.bitnet import packed_kernel as PK

    x, r = (torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    total, y, codes = PK.norm_codes(x, w, 1e-5, "int8", residual=r)
    want_total, want_y = FL.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(total, want_total) and torch.equal(y, want_y)
    assert all(torch.equal(a, b) for a, b in zip(codes, PK.quantize_codes(want_y, "int8")))
    y1, codes1 = PK.norm_codes(x, w, 1e-5, "int8")
    assert torch.equal(y1, FL.rms_norm(x, w, 1e-5))
    assert all(torch.equal(a, b) for a, b in zip(codes1, PK.quantize_codes(y1, "int8")))


# ------------------------------------------------------------------------------- streaming codes kernel

def _force_streaming(monkeypatch):
    """quantize_codes takes the streaming kernel for INT8 / INT4 at any size."""
    from thrifty.bitnet import packed_kernel as PK

    monkeypatch.setattr(PK, "STREAM_MIN_ROWS", 1)
    monkeypatch.setattr(PK, "STREAM_MIN_BLOCK", {"int8": 1, "int4": 1})


def _streaming_and_whole_row(monkeypatch, x, kind, *, norm_weight=None, chunk=None, beta_scale=1.0):
    """quantize_codes(x) by the streaming kernel (``chunk`` columns per chunk) and by the whole-row kernel."""
    from thrifty.bitnet import packed_kernel as PK

    _force_streaming(monkeypatch)
    if chunk is not None:
        monkeypatch.setattr(PK, "STREAM_CHUNK", chunk)
    got = PK.quantize_codes(x, kind, beta_scale=beta_scale, norm_weight=norm_weight)
    monkeypatch.setattr(PK, "STREAM_MIN_ROWS", 1 << 40)
    want = PK.quantize_codes(x, kind, beta_scale=beta_scale, norm_weight=norm_weight)
    return got, want


def _torch_codes(x, kind, norm_weight=None, beta_scale=1.0):
    """The PyTorch path's codes and scales of rows ``x`` (PackedBitLinear.quantize_input: the sub-norm, then
    activation_codes)."""
    bl = BitLinear(x.shape[1], 8, activation=kind, sub_norm=norm_weight is not None)
    with torch.no_grad():
        if norm_weight is not None:
            bl.norm.weight.copy_(norm_weight)
    p = PackedBitLinear.from_bitlinear(bl.to(x.device), impl="reference")
    p.beta_scale = beta_scale
    return p.quantize_input(x)


def _check_streaming_codes(got, want, torch_codes, D, exact):
    """``got`` (streaming kernel) against the whole-row kernel's ``want`` and the PyTorch path's codes: equal
    (``exact``: INT8 without the sub-norm) or within one code at an exact half and the scales to an ulp (Σx², Σ|x|
    summed in another order); Σ codes are the codes' sum, the padding past D is zero, a non-finite row has a NaN
    scale and zero codes."""
    codes, scale, sums = got
    assert codes.shape == want[0].shape and codes.dtype == torch.int8
    assert not codes[:, D:].any() and torch.equal(sums, codes.int().sum(1))
    t_codes, t_scale = torch_codes
    for other_codes, other_scale in ((want[0], want[1]), (t_codes, t_scale)):
        other_codes = other_codes[:, :D]
        if exact:
            assert torch.equal(codes[:, :D], other_codes)
            assert torch.allclose(scale, other_scale, rtol=0, atol=0, equal_nan=True)  # equal, NaN at NaN
        else:
            assert (codes[:, :D].int() - other_codes.int()).abs().max() <= 1
            assert torch.allclose(scale, other_scale, rtol=1e-6, atol=0, equal_nan=True)
    if exact:
        assert torch.equal(sums, want[2])


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("D,chunk", [(37, None), (300, None), (1100, None), (1100, 256), (2563, None),
                                     (2563, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sub_norm", [False, True])
def test_streaming_codes_kernel_is_the_whole_row_kernel(monkeypatch, kind, D, chunk, dtype, sub_norm):
    """The prefill codes kernel (_act_codes_stream_kernel: the row in chunks, up to three passes) on odd widths,
    below one chunk (37, 300) and over several with a partial last one (1100, 2563; chunks of 256-1024 columns):
    INT8 without the sub-norm bit for bit against the whole-row kernel and the PyTorch path, INT4 and the sub-norm
    within one code at an exact half (their sums in another order); a zero row, a NaN row, an inf row."""
    g = torch.Generator().manual_seed(D)
    x = torch.randn(5, D, generator=g) * torch.rand(5, 1, generator=g).mul(4).add(0.05)
    x[0, -1] *= 20  # the max in the last (partial) chunk
    x[2] = 0
    x[3, D // 2] = float("nan")
    x[4, 0] = float("-inf")
    x = x.to(dtype)
    w = torch.rand(D, generator=g).add(0.5) if sub_norm else None
    got, want = _streaming_and_whole_row(monkeypatch, x, kind, norm_weight=w, chunk=chunk, beta_scale=1.5)
    codes, scale, _ = got
    assert torch.isnan(scale[3:]).all() and not codes[3:].any()
    assert scale[2] == 0 and not codes[2].any()
    _check_streaming_codes(got, want, _torch_codes(x, kind, w, 1.5), D, exact=kind == "int8" and not sub_norm)


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("sub_norm", [False, True])
def test_streaming_codes_kernel_on_one_row(monkeypatch, kind, sub_norm):
    """M = 1, bf16, a width of several chunks with the max in the first one."""
    x = tokens(1, 1100, seed=3).to(torch.bfloat16)
    x[0, 3] = 50.0
    w = torch.linspace(0.5, 1.5, 1100) if sub_norm else None
    got, want = _streaming_and_whole_row(monkeypatch, x, kind, norm_weight=w, chunk=256)
    _check_streaming_codes(got, want, _torch_codes(x, kind, w), 1100, exact=kind == "int8" and not sub_norm)


def test_codes_kernel_streams_long_rows_at_prefill():
    """The measured rule (H200): INT8 streams at 11008 but not at 4096 / 8192, INT4 from 6912; TopK, decode and
    small batches never."""
    from thrifty.bitnet import packed_kernel as PK

    m = max(PK.STREAM_MIN_ROWS, 2048)
    assert [PK.codes_kernel("int8", m, d) for d in (2560, 4096, 8192, 11008)] == ["whole-row"] * 3 + ["stream"]
    assert [PK.codes_kernel("int4", m, d) for d in (4096, 6912, 11008)] == ["whole-row", "stream", "stream"]
    assert PK.codes_kernel("topk_int8", m, 11008) == "whole-row"
    assert PK.codes_kernel("int8", PK.STREAM_MIN_ROWS - 1, 11008) == "whole-row"
    assert PK.codes_kernel("int8", 1, 11008) == "whole-row"


@needs_kernels
def test_quantize_codes_launches_the_kernel_codes_kernel_names(monkeypatch):
    """quantize_codes runs the kernel codes_kernel names: the streaming one for INT8 / INT4 from STREAM_MIN_ROWS rows
    where the whole-row kernel's block reaches STREAM_MIN_BLOCK, the whole-row one for fewer rows, shorter rows
    and TopK."""
    from thrifty.bitnet import packed_kernel as PK

    launched = []
    for name in ("_ACT_LAUNCH", "_ACT_STREAM_LAUNCH"):
        real = getattr(PK, name)
        monkeypatch.setattr(PK, name, lambda *a, _real=real, _name=name, **k: (launched.append(_name),
                                                                                _real(*a, **k)))
    monkeypatch.setattr(PK, "STREAM_MIN_ROWS", 4)
    monkeypatch.setattr(PK, "STREAM_MIN_BLOCK", {"int8": 512, "int4": 256})
    x = tokens(4, 300)
    for kind, m, d, want in (("int8", 4, 300, "stream"), ("int4", 4, 300, "stream"), ("int8", 3, 300, "whole-row"),
                             ("topk_int8", 4, 300, "whole-row"), ("int8", 4, 40, "whole-row"),
                             ("int4", 4, 40, "stream")):
        launched.clear()
        PK.quantize_codes(x[:m, :d], kind)
        assert PK.codes_kernel(kind, m, d) == want, (kind, m, d)
        assert launched == ["_ACT_STREAM_LAUNCH" if want == "stream" else "_ACT_LAUNCH"], (kind, m, d)


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_layer_on_streamed_codes_equals_the_torch_path(monkeypatch, kind):
    """The layer forward (prefill GEMM) on the streaming kernel's codes, sub-norm and bias: as the whole-row
    kernel's test (test_kernels_equal_the_torch_path) judges it."""
    from thrifty.bitnet import packed_kernel as PK

    _force_streaming(monkeypatch)
    monkeypatch.setattr(PK, "STREAM_CHUNK", 256)
    bl = layer(513, 70, kind, seed=4)
    got, want = _kernel_vs_torch(bl, tokens(70, 513, seed=4))
    if kind == "int4":
        assert ((got - want).abs() <= 1e-6 * want.abs().amax()).all()
    else:
        assert torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("D", [4096, 11008])
@pytest.mark.parametrize("sub_norm", [False, True])
def test_streaming_codes_kernel_on_cuda_at_prefill(monkeypatch, kind, D, sub_norm):
    """The compiled streaming kernel at 2048 bf16 rows of the 7B widths (taken at both here; quantize_codes streams
    only where it is faster): INT8 without the sub-norm bit for bit against the PyTorch path on the CPU (on CUDA,
    PyTorch divides by a scalar through its reciprocal: not correctly rounded) and the whole-row kernel; INT4 and
    the sub-norm within one code (sums in another order; the sub-norm's 1/√ is correctly rounded, PyTorch's rsqrt
    is not, so a row's max may move by one bf16 step: a few rows' scales by ~0.4%)."""
    from thrifty.bitnet import packed_kernel as PK

    g = torch.Generator(device="cuda").manual_seed(D)
    x = (torch.randn(2048, D, device="cuda", generator=g)
         * torch.rand(2048, 1, device="cuda", generator=g).mul(4).add(0.05)).to(torch.bfloat16)
    x[7, 100] = float("nan")
    x[8] = 0
    w = torch.rand(D, device="cuda", generator=g).add(0.5) if sub_norm else None
    got, want = _streaming_and_whole_row(monkeypatch, x, kind, norm_weight=w)
    codes, scale, sums = (t.cpu() for t in got)
    t_codes, t_scale = _torch_codes(x.cpu(), kind, None if w is None else w.cpu())
    assert torch.isnan(scale[7]) and not codes[7].any() and scale[8] == 0 and not codes[8].any()
    assert not codes[:, D:].any() and torch.equal(sums, codes.int().sum(1))
    if kind == "int8" and not sub_norm:
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
        assert torch.allclose(got[1], want[1], rtol=0, atol=0, equal_nan=True)
        assert torch.equal(codes[:, :D], t_codes) and torch.allclose(scale, t_scale, rtol=0, atol=0, equal_nan=True)
    else:
        for other_codes, other_scale in ((want[0].cpu()[:, :D], want[1].cpu()), (t_codes, t_scale)):
            assert (codes[:, :D].int() - other_codes.int()).abs().max() <= 1
            close = torch.isclose(scale, other_scale, rtol=1e-6, atol=0, equal_nan=True)
            assert close.float().mean() >= 0.99
            assert torch.allclose(scale, other_scale, rtol=1e-2, atol=0, equal_nan=True)
