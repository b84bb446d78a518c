"""BitNet b1.58 / a4.8: quantizers vs float64 formulas, STE, BitLinear math, fused kernels vs the reference,
recipes training on the real corpus, convert on a transformers Llama, two-stage training and its checkpoints."""

import math

import pytest
import torch
import torch.nn as nn

from thrifty import bitnet
from thrifty.bitnet import BitLinear, BitNetConfig, TwoStageSchedule, reference as ref
from thrifty.models import LlamaConfig, LlamaForCausalLM, preset
from thrifty.paths import data_dir
from thrifty.train import Trainer, TrainConfig

SHAPES = [(2, 1), (3, 7), (5, 33), (4, 130), (2, 257)]
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
needs_corpus = pytest.mark.skipif(not (data_dir() / "corpus" / "manifest.json").is_file(),
                                  reason="run `thrifty setup` first (scripts/setup.sh does)")


def rows(shape, seed=0):
    """Random tokens of varied scale, an outlier, and an all-zero token (last)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g).mul(5).add(0.01)
    x[0, -1] *= 20
    x[-1] = 0
    return x


# ------------------------------------------------------------------------------------------ quantizers (float64)

@pytest.mark.parametrize("shape", SHAPES)
def test_int8_matches_float64_formula(shape):
    x = rows(shape)
    y = ref.quantize_int8(x).double()
    xd = x.double()
    gamma = xd.abs().amax(-1, keepdim=True)
    codes = y * 127 / gamma.clamp_min(1e-30)
    assert (codes[:-1] - codes[:-1].round()).abs().max() < 1e-3  # on the grid (γ/127)·integer
    expected = (xd * 127 / (gamma + ref.EPS)).round().clamp(-128, 127) * gamma / 127
    assert (y - expected).abs().max() <= 1e-6 * gamma.max()
    assert torch.equal(y[-1], torch.zeros_like(y[-1]))  # all-zero token: zeros, no NaN
    assert codes[:-1].abs().max() <= 127


@pytest.mark.parametrize("shape", SHAPES)
def test_int4_matches_float64_formula(shape):
    x = rows(shape, seed=1)
    y = ref.quantize_int4(x).double()
    xd = x.double()
    beta = xd.abs().mean(-1, keepdim=True)
    expected = (math.sqrt(7) * xd / (beta + ref.EPS)).round().clamp(-8, 7) * beta / math.sqrt(7)
    assert (y - expected).abs().max() <= 1e-5 * beta.max()
    codes = (y[:-1] * math.sqrt(7) / beta[:-1]).round()
    assert codes.min() >= -8 and codes.max() <= 7
    assert not torch.isnan(y).any() and torch.equal(y[-1], torch.zeros_like(y[-1]))
    # the all-INT4 ablation's β = 2·mean|x| for the FFN-down input
    y2 = ref.quantize_int4(x, beta_scale=2.0).double()
    expected2 = (math.sqrt(7) * xd / (2 * beta + ref.EPS)).round().clamp(-8, 7) * 2 * beta / math.sqrt(7)
    assert (y2 - expected2).abs().max() <= 1e-5 * beta.max()


@pytest.mark.parametrize("shape", SHAPES)
def test_fp4_values_lie_on_the_e2m1_grid(shape):
    x = rows(shape, seed=2)
    y = ref.quantize_fp4(x).double()
    gamma = x.double().abs().amax(-1, keepdim=True)
    v = (y[:-1] * 6 / gamma[:-1]).abs()
    dist = (v[..., None] - E2M1).abs().min(-1).values
    assert dist.max() < 1e-4
    # nearest grid point of the float64 scaled value (ties aside)
    scaled = (x.double() * 6 / (gamma + ref.EPS)).abs()[:-1]
    nearest = E2M1[(scaled[..., None] - E2M1).abs().argmin(-1)]
    assert ((v - nearest).abs() > 1e-4).sum() == 0
    assert torch.equal(y[-1], torch.zeros_like(y[-1]))
    assert torch.equal(ref.round_e2m1(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -5.0])),
                       torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -4.0]))  # ties to even mantissa


@pytest.mark.parametrize("shape", SHAPES)
def test_topk_keeps_the_largest_half_then_int8(shape):
    x = rows(shape, seed=3)
    y = ref.quantize_topk_int8(x)
    k = math.ceil(shape[1] / 2)
    for t in range(shape[0] - 1):
        kept = x[t].abs().topk(k).indices
        mask = torch.zeros(shape[1], dtype=torch.bool)
        mask[kept] = True  # random values: no ties
        assert torch.equal(y[t][~mask], torch.zeros_like(y[t][~mask]))
        assert torch.equal(y[t], ref.quantize_int8(torch.where(mask, x[t], 0.0)))
    assert torch.equal(y[-1], torch.zeros_like(y[-1]))


def test_ternary_weights_one_alpha_per_sub_matrix():
    g = torch.Generator().manual_seed(4)
    w = torch.cat([torch.randn(6, 9, generator=g) * s for s in (0.1, 1.0, 5.0)])
    q = ref.quantize_weight_ternary(w, (6, 6, 6)).double()
    for part, wp in zip(q.split(6), w.double().split(6)):
        alpha = wp.abs().mean()
        assert set((part / alpha).round().unique().tolist()) <= {-1.0, 0.0, 1.0}
        assert torch.allclose(part, (wp / (alpha + ref.EPS)).round().clamp(-1, 1) * alpha, atol=1e-6)
    one_alpha = ref.quantize_weight_ternary(w)
    assert not torch.allclose(one_alpha, q.float())  # a shared α would differ
    assert torch.equal(ref.quantize_weight_ternary(torch.zeros(3, 5)), torch.zeros(3, 5))


def test_nan_in_a_token_gives_nan_out():
    x = rows((3, 9))
    x[1, 4] = float("nan")
    for kind in ("int8", "int4", "fp4", "topk_int8"):
        y = ref.quantize_activation(x, kind)
        assert torch.isnan(y[1]).all() and not torch.isnan(y[0]).any(), kind


def test_ste_gradient_is_the_identity():
    x = rows((4, 10)).requires_grad_()
    g = torch.randn(4, 10)
    for kind in ("int8", "int4", "fp4", "topk_int8"):
        x.grad = None
        (ref.ste(x, ref.quantize_activation(x.detach(), kind)) * g).sum().backward()
        assert torch.equal(x.grad, g), kind


# ------------------------------------------------------------------------------------------ BitLinear

@pytest.mark.parametrize("activation", ["int8", "int4", "fp4", "topk_int8", "none"])
@pytest.mark.parametrize("sub_norm", [False, True])
def test_bitlinear_forward_is_the_explicit_float_math(activation, sub_norm):
    torch.manual_seed(0)
    layer = BitLinear(13, 7, activation=activation, sub_norm=sub_norm, bias=True)
    with torch.no_grad():
        layer.bias.normal_()
        if sub_norm:
            layer.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 13)
    y = layer(x)
    # float64 of the same quantized operands: Q_a(norm(x)) · Q_w(W)ᵀ + b
    xn = x if not sub_norm else layer.norm(x)
    xq = ref.quantize_activation(xn, activation).double()
    w = layer.weight.double()
    alpha = w.abs().mean()
    wq = (w / (alpha + ref.EPS)).round().clamp(-1, 1) * alpha
    expected = xq @ wq.T + layer.bias.double()
    assert (y.double() - expected).abs().max() < 1e-4
    assert layer.last_path == ("none" if activation == "none" else "reference")
    norm_w = layer.norm.weight if sub_norm else None
    same = ref.bitlinear_reference(x, layer.weight, activation=activation, bias=layer.bias, norm_weight=norm_w)
    assert torch.equal(y, same)


def test_bitlinear_gradients_are_straight_through():
    torch.manual_seed(1)
    layer = BitLinear(11, 5, activation="topk_int8")
    x = torch.randn(3, 11, requires_grad=True)
    g = torch.randn(3, 5)
    (layer(x) * g).sum().backward()
    xq = ref.quantize_topk_int8(x.detach())
    wq = ref.quantize_weight_ternary(layer.weight.detach())
    assert torch.allclose(x.grad, g @ wq, atol=1e-6)            # dL/dx through the identity of the STE
    assert torch.allclose(layer.weight.grad, g.T @ xq, atol=1e-6)  # latent fp32 weight gets the quantized grad
    assert layer.weight.dtype == torch.float32


def test_strength_zero_is_the_plain_linear():
    torch.manual_seed(2)
    plain = nn.Linear(9, 4)
    layer = BitLinear.from_linear(plain, activation="int4", sub_norm=True, strength=0.0)
    x = torch.randn(5, 9)
    assert torch.equal(layer(x), plain(x))
    layer.configure(strength=1.0)
    assert not torch.allclose(layer(x), plain(x))


# ------------------------------------------------------------------------------------------ fused kernels

@pytest.mark.parametrize("kind", ["int8", "int4", "topk_int8"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_kernel_matches_reference_under_interpreter(kind, shape):
    from thrifty.bitnet import quant_kernel

    x = rows(shape, seed=5)
    y = quant_kernel.quantize_rows(x, kind)
    expected = ref.quantize_activation(x, kind)
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-6)
    # INT8/TopK: identical; INT4: the mean is summed in another order, a code may differ at an exact half
    assert ((y - expected).abs() / scale).max() <= (0.0 if kind != "int4" else 1e-6), kind
    assert torch.equal(y[-1], torch.zeros_like(y[-1]))


def test_fused_kernel_bf16_nan_ties_and_backward():
    from thrifty.bitnet import quant_kernel

    x = rows((4, 33), seed=6).to(torch.bfloat16)
    for kind in ("int8", "int4", "topk_int8"):
        y = quant_kernel.quantize_rows(x, kind)
        assert y.dtype == torch.bfloat16
        assert (y.float() - ref.quantize_activation(x, kind).float()).abs().max() <= 0.02 * x.float().abs().max()
    ties = torch.tensor([[0.5, 1.0, -1.0, 2.0, 1.0, 1.0, 0.25]])  # k = 4 of 7: 2.0, then the first three ±1.0
    kept = quant_kernel.quantize_rows(ties, "topk_int8")
    assert torch.equal(kept, ref.quantize_topk_int8(ties))
    assert kept.ne(0).tolist() == [[False, True, True, True, True, False, False]]
    nan = rows((3, 9))
    nan[0, 2] = float("nan")
    for kind in ("int8", "int4", "topk_int8"):
        y = quant_kernel.quantize_rows(nan, kind)
        assert torch.isnan(y[0]).all() and not torch.isnan(y[1:]).any()
    x = rows((2, 7)).requires_grad_()
    g = torch.randn(2, 7)
    (quant_kernel.FusedQuantizeSTE.apply(x, None, "int4", 1.0, 0.5, 0.0, None) * g).sum().backward()
    assert torch.equal(x.grad, g)
    with pytest.raises(ValueError, match="kind"):
        quant_kernel.quantize_rows(x, "fp4")


@pytest.mark.cuda
def test_reference_quantizers_give_the_cpu_bits_on_cuda():
    """The spec divides (γ/127, γ/6): on CUDA the reference must not multiply by a reciprocal instead (PyTorch does
    for a Python-number divisor: one ulp off for ~6% of tokens), and the packed path's codes and scales equal the
    CPU's too. (INT4's mean|x| is a sum, added in another order on the GPU: not compared here.)"""
    from thrifty.bitnet.packed import activation_codes

    x = rows((512, 1000), seed=3) * torch.logspace(-3, 3, 512)[:, None]
    for fn in (ref.quantize_int8, ref.quantize_fp4):
        assert torch.equal(fn(x.cuda()).cpu(), fn(x)), fn.__name__
    for kind in ("int8", "topk_int8"):
        (codes, scale), (c_cpu, s_cpu) = activation_codes(x.cuda(), kind), activation_codes(x, kind)
        assert torch.equal(codes.cpu(), c_cpu) and torch.equal(scale.cpu(), s_cpu), kind


@pytest.mark.cuda
def test_bitlinear_runs_the_fused_kernel_on_cuda():
    torch.manual_seed(3)
    for activation in ("int8", "int4", "topk_int8"):
        layer = BitLinear(257, 64, activation=activation, sub_norm=True).cuda()
        x = torch.randn(4, 9, 257, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        assert layer.last_path == "triton"
        y.float().sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
        xn = layer.norm(x.detach())
        fused = layer.quantize_input(x.detach())
        expected = ref.quantize_activation(xn, activation)
        scale = xn.abs().amax(-1, keepdim=True)
        # GPU fp32 division and fused multiply-add may move a value across a rounding half: one code step
        step = scale / (7 if activation == "int4" else 127)
        assert ((fused - expected).abs() <= step * 1.01 + 1e-6).all()
        assert ((fused - expected).abs() > 1e-6).float().mean() < 1e-3
        layer.configure(impl="reference")
        layer(x)
        assert layer.last_path == "reference"


@pytest.mark.cuda
def test_a48_model_step_on_cuda_runs_every_quantizer_fused():
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("cuda"):
        model = bitnet.convert(LlamaForCausalLM(cfg).init_weights(seed=0), "a4.8")
    ids = torch.randint(0, 128, (2, 33), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids, labels=ids)
    loss.backward()
    paths = {m.last_path for m in model.modules() if isinstance(m, BitLinear)}
    assert paths == {"triton"} and torch.isfinite(loss)


# ------------------------------------------------------------------------------------------ recipes and models

@needs_corpus
@pytest.mark.parametrize("recipe", ["fp", "b1.58", "a4.8", "a4.8-fp4", "int4-all"])
def test_each_recipe_trains_on_real_text(recipe):
    from thrifty.data import TokenDataset

    corpus = data_dir() / "corpus"
    train = TokenDataset(corpus, "train", verify_checksum=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(preset("tiny")).init_weights(seed=0)
    schedule = bitnet.build_for_pretraining(model, recipe, stage1_share=0.5)
    cfg = TrainConfig(steps=10, batch_size=2, seq_len=32, lr=4e-3, warmup_steps=2)
    trainer = Trainer(model, train, None, cfg, schedule=schedule)
    history = trainer.fit(progress=False)
    first, last = sum(h["loss"] for h in history[:3]) / 3, sum(h["loss"] for h in history[-3:]) / 3
    assert last < first - 0.8, (recipe, first, last)  # ~10.7 -> ~9.5 nats in 10 steps
    assert bitnet.current_recipe(model) == recipe


def test_linear_seam_and_convert_build_the_same_model():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    seam = LlamaForCausalLM(cfg, linear=bitnet.linear_factory("a4.8"), activation=bitnet.mlp_activation("a4.8"))
    seam.init_weights(seed=1)
    converted = bitnet.convert(LlamaForCausalLM(cfg).init_weights(seed=1), "a4.8")
    assert isinstance(seam.model.layers[0].self_attn.o_proj, BitLinear)
    assert seam.model.layers[0].self_attn.o_proj.activation == "topk_int8"
    assert seam.model.layers[0].mlp.down_proj.norm is not None and seam.model.layers[0].mlp.up_proj.norm is None
    assert not isinstance(seam.lm_head, BitLinear) and not isinstance(converted.lm_head, BitLinear)
    ids = torch.randint(0, 64, (2, 11))
    assert torch.allclose(seam(ids), converted(ids), atol=1e-5)
    assert bitnet.current_recipe(seam) == bitnet.current_recipe(converted) == "a4.8"


def hf_tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_convert_a_transformers_llama():
    model = hf_tiny_llama()
    ids = torch.randint(0, 96, (2, 9))
    before = model(ids).logits
    # λ = 0: converted, and still exactly the pretrained function
    bitnet.convert(model, BitNetConfig("b1.58", strength=0.0))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, BitLinear))}
    assert all(isinstance(m, BitLinear) for n, m in linears.items() if n != "lm_head")
    assert type(linears["lm_head"]) is nn.Linear and len(linears) == 2 * 7 + 1
    assert torch.allclose(model(ids).logits, before, atol=1e-5)
    bitnet.set_strength(model, 1.0)
    assert model.model.layers[0].mlp.act_fn(torch.tensor([-1.0, 2.0])).tolist() == [0.0, 4.0]  # ReLU²
    params = {n: p for n, p in model.named_parameters()}
    bitnet.convert(model, "a4.8")  # stage switch: same parameters, new quantizers
    assert {n: p for n, p in model.named_parameters()}.keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())
    assert model.model.layers[1].self_attn.o_proj.activation == "topk_int8"
    out = model(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.model.layers[0].self_attn.q_proj.weight.grad is not None
    stats = bitnet.measure_sparsity(model, [ids])
    assert stats["out"] >= 0.5 and 0 < stats["overall"] < 1
    with pytest.raises(ValueError, match="recipe"):
        bitnet.convert(model, "fp")


def test_revert_undoes_convert_bit_for_bit():
    model = hf_tiny_llama().to(torch.bfloat16)
    ids = torch.randint(0, 96, (2, 9))
    before = {n: p.clone() for n, p in model.state_dict().items()}
    logits = model(ids).logits
    act_fn = model.model.layers[0].mlp.act_fn
    bitnet.revert(bitnet.convert(model, "a4.8"))
    assert not any(isinstance(m, BitLinear) for m in model.modules())
    assert model.model.layers[0].mlp.act_fn is act_fn
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n], p) and after[n].dtype == p.dtype for n, p in before.items())
    assert torch.equal(model(ids).logits, logits)
    born = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2),
                            linear=bitnet.linear_factory("b1.58"))
    with pytest.raises(ValueError, match="built as a BitLinear"):
        bitnet.revert(born)


def test_sparsity_table_shape():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = bitnet.convert(LlamaForCausalLM(cfg).init_weights(seed=0), "a4.8")
    ids = torch.randint(0, 64, (3, 17))
    s = bitnet.measure_sparsity(model, [ids, ids])
    for key in ("qkv", "out", "up", "gate", "down", "overall", "activated_params", "gate_output", "up_input"):
        assert key in s
    assert s["out"] >= 0.5 and s["gate"] == s["up_input"]
    assert s["up"] >= max(s["up_input"], s["gate_output"]) - 1e-9
    assert s["activated_params"] == pytest.approx(s["projection_params"] * (1 - s["overall"]))
    assert "| a4.8 |" in bitnet.format_table({"a4.8": s})


def test_sparsity_counts_match_a_manual_count():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4)
    model = bitnet.convert(LlamaForCausalLM(cfg).init_weights(seed=3), "a4.8")
    seen = {}
    mlp, attn = model.model.layers[0].mlp, model.model.layers[0].self_attn
    hooks = [mod.register_forward_hook(lambda m, i, o, k=k: seen.__setitem__(k, (i[0], o)))
             for k, mod in (("o", attn.o_proj), ("gate", mlp.gate_proj), ("down", mlp.down_proj))]
    ids = torch.randint(0, 64, (1, 23))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    s = bitnet.measure_sparsity(model, [ids])
    o_in = ref.quantize_topk_int8(attn.o_proj.norm(seen["o"][0]))
    down_in = ref.quantize_int8(mlp.down_proj.norm(seen["down"][0]))
    gate_in = ref.quantize_int4(seen["gate"][0])
    gate_nz = (torch.relu(seen["gate"][1]) ** 2 != 0).float().mean(-1)
    assert s["out"] == pytest.approx(float((o_in == 0).float().mean()))
    assert s["down"] == pytest.approx(float((down_in == 0).float().mean()))
    assert s["gate"] == pytest.approx(float((gate_in == 0).float().mean()))
    assert s["up"] == pytest.approx(float((1 - (gate_in != 0).float().mean(-1) * gate_nz).mean()))


# ------------------------------------------------------------------------------------------ two-stage training

class TokenWindows:
    def __init__(self, n=4000, vocab=64):
        self.tokens = (torch.arange(n) * 7 % 61) % vocab

    def batch(self, batch_size, seq_len, generator=None):
        starts = torch.randint(0, len(self.tokens) - seq_len - 1, (batch_size,), generator=generator)
        w = self.tokens[starts[:, None] + torch.arange(seq_len + 1)]
        return w[:, :-1], w[:, 1:]


def small_bitnet(recipe="b1.58"):
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    return bitnet.convert(LlamaForCausalLM(cfg).init_weights(seed=0), recipe)


def test_two_stage_switches_recipe_weight_decay_and_lr(tmp_path):
    model = small_bitnet()
    schedule = TwoStageSchedule(stage1_share=0.5)
    cfg = TrainConfig(steps=8, batch_size=2, seq_len=16, lr=1.5e-3, warmup_steps=1, weight_decay=0.1,
                      checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=6)
    trainer = Trainer(model, TokenWindows(), None, cfg, schedule=schedule)
    for _ in range(4):
        trainer.train_step()
    assert bitnet.current_recipe(model) == "b1.58" and trainer.optimizer.param_groups[0]["weight_decay"] == 0.1
    moments = {id(p): s["exp_avg"].clone() for p, s in trainer.optimizer.state.items()}
    row = trainer.train_step()
    assert bitnet.current_recipe(model) == "a4.8" and trainer.optimizer.param_groups[0]["weight_decay"] == 0.0
    assert row["lr"] == pytest.approx(1e-3)  # the stage-2 peak: 1.5e-3 · 2/3
    assert set(moments) == {id(p) for p in trainer.optimizer.state}  # same parameters, moments kept
    assert schedule.lr(0, cfg) == pytest.approx(1.5e-3) and schedule.lr(7, cfg) < 1e-3
    trainer.fit(progress=False)  # writes a checkpoint at step 6 (stage 2) and at the end

    fresh = small_bitnet("b1.58")  # built for stage 1, as a restarted job would
    resumed = Trainer(fresh, TokenWindows(), None, cfg, schedule=TwoStageSchedule(stage1_share=0.5))
    resumed.load_checkpoint(tmp_path / "ck")
    assert resumed.step == 8
    resumed.cfg.steps = 10
    resumed.train_step()
    assert bitnet.current_recipe(fresh) == "a4.8" and resumed.optimizer.param_groups[0]["weight_decay"] == 0.0


def test_schedule_refuses_an_fp_model():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    trainer = Trainer(LlamaForCausalLM(cfg), TokenWindows(), None, TrainConfig(steps=2, batch_size=1, seq_len=8),
                      schedule=TwoStageSchedule())
    with pytest.raises(ValueError, match="model"):
        trainer.train_step()


# ------------------------------------------------------------------------------------------ bad input

def test_bad_names_and_fractions_are_rejected():
    with pytest.raises(ValueError, match="recipe"):
        BitNetConfig(recipe="a4.16")
    with pytest.raises(ValueError, match="recipe"):
        bitnet.convert(nn.Sequential(nn.Linear(2, 2)), "b2")
    with pytest.raises(TypeError, match="recipe"):
        bitnet.convert(nn.Sequential(nn.Linear(2, 2)), 3)
    with pytest.raises(ValueError, match="activation"):
        BitLinear(4, 4, activation="int3")
    with pytest.raises(ValueError, match="activation"):
        ref.quantize_activation(torch.ones(2, 2), "int2")
    with pytest.raises(ValueError, match="stage1_share"):
        TwoStageSchedule(stage1_share=0.0)
    with pytest.raises(ValueError, match="stage1_share"):
        TwoStageSchedule(stage1_share=1.5)
    with pytest.raises(ValueError, match="stage2_recipe"):
        TwoStageSchedule(stage2_recipe="fp")
    with pytest.raises(ValueError, match="topk_ratio"):
        BitNetConfig(topk_ratio=0.0)
    with pytest.raises(ValueError, match="strength"):
        BitNetConfig(strength=1.5)
    with pytest.raises(ValueError, match="weight_splits"):
        BitLinear(4, 6, weight_splits=(2, 2))
    with pytest.raises(ValueError, match="recipe"):
        bitnet.build_for_pretraining(nn.Linear(2, 2), "b1.59")


@needs_corpus
def test_pretrain_cli_takes_a_recipe(tmp_path):
    import json

    from thrifty.cli import main

    out = tmp_path / "run"
    assert main(["pretrain", "--preset", "tiny", "--steps", "4", "--batch-size", "2", "--seq-len", "32",
                 "--eval-every", "0", "--device", "cpu", "--recipe", "a4.8", "--stage1-share", "0.5",
                 "--out", str(out)]) == 0
    history = json.loads((out / "history.json").read_text())
    assert len(history) == 4 and (out / "model.safetensors").is_file()


# ----------------------------------------------------------------------------------- found by the fuzz suite

def test_empty_tokens_and_inf_rows_reference_and_kernel():
    from thrifty.bitnet import quant_kernel

    for kind in ("int8", "int4", "fp4", "topk_int8"):  # zero features: the empty result (amax used to raise)
        assert ref.quantize_activation(torch.randn(3, 0), kind).shape == (3, 0)
    for kind in ("int8", "int4", "topk_int8"):
        assert quant_kernel.quantize_rows(torch.randn(3, 0), kind).shape == (3, 0)
        x = rows((3, 9))
        x[0, 4] = -math.inf  # an infinity: the token is NaN on both paths (the kernel flags it, not min/max)
        for y in (quant_kernel.quantize_rows(x, kind), ref.quantize_activation(x, kind)):
            assert y[0].isnan().all() and y[1:].isfinite().all()


def test_bitlinear_refuses_bad_input_and_none_settings():
    m = BitLinear(5, 3)
    for x, err in ((torch.randn(2, 4), ValueError), (torch.ones(2, 5, dtype=torch.int64), TypeError),
                   ([[1.0] * 5], TypeError)):
        with pytest.raises(err, match="x"):
            m(x)  # an int tensor used to give zeros silently, the others a deep RuntimeError/AttributeError
    for name in ("activation", "beta_scale", "topk_ratio", "strength", "fused"):
        with pytest.raises(TypeError, match=name):
            BitLinear(5, 3, **{name: None})
    for kw, name in ((dict(weight_splits=3), "weight_splits"), (dict(norm_eps=math.nan), "norm_eps"),
                     (dict(bias="yes"), "bias"), (dict(sub_norm=1), "sub_norm")):
        with pytest.raises((TypeError, ValueError), match=name):
            BitLinear(5, 3, **kw)
    for bad in (None, 3):
        with pytest.raises(TypeError, match="exclude"):
            BitNetConfig(exclude=bad)
