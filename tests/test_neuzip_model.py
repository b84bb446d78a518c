"""NeuZip in models (CPU): compressed logits, bit-identical LOMO training, checkpointing, transformers generate,
the per-block decode kernel (interpreter) vs the reference, memory accounting, save/load, bad arguments."""

import copy
import os

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from thrifty.models import LlamaConfig, LlamaForCausalLM
from thrifty.neuzip import NeuZipConfig, compress_model, load_compressed, save_compressed
from thrifty.optim import LomoConfig, lomo
from thrifty.neuzip import reference as R
from thrifty.neuzip.block_decode import pack_tensors
from thrifty.neuzip.tensor import CompressedTensor
from thrifty.neuzip.encode import encode_lossless, encode_on_device

VOCAB = 97


def tiny(dtype=torch.float32, layers=3, seed=0):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).init_weights(seed=seed).to(dtype)


def batch(seed=0, b=2, t=11):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, t), generator=g), torch.randint(0, VOCAB, (b, t), generator=g)


def int_bits(x):
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lossless_logits_equal(dtype):
    base = tiny(dtype)
    x, _ = batch()
    model = compress_model(copy.deepcopy(base))
    assert sum(isinstance(m, torch.nn.Linear) for m in model.model.layers.modules()) == 0  # every block linear
    assert torch.equal(model(x), base(x))
    for name, w in model.neuzip.decoded_weights().items():
        assert torch.equal(int_bits(w), int_bits(base.get_parameter(name)))


def test_decompress_model_restores_the_linears_bit_for_bit():
    from thrifty.neuzip import decompress_model

    base = tiny(torch.bfloat16)
    base.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    x, _ = batch()
    model = decompress_model(compress_model(copy.deepcopy(base)))
    assert not hasattr(model, "neuzip") and all(not b._forward_pre_hooks for b in model.model.layers)
    assert [type(m) for m in model.modules()] == [type(m) for m in base.modules()]
    for name, p in base.named_parameters():
        q = model.get_parameter(name)
        assert torch.equal(int_bits(q), int_bits(p)) and q.requires_grad == p.requires_grad
    assert torch.equal(model(x), base(x))
    with pytest.raises(ValueError, match="not NeuZip-compressed"):
        decompress_model(model)
    lossy = compress_model(copy.deepcopy(base), "lossy", mantissa_bits=3)
    with pytest.raises(ValueError, match="lossy NeuZip .* cannot be restored"):
        decompress_model(lossy)


@pytest.mark.parametrize("k", [7, 3, 1, 0])
def test_lossy_logits_within_bound(k):
    base = tiny(torch.bfloat16)
    x, _ = batch()
    model = compress_model(copy.deepcopy(base), "lossy", k)
    rounded = copy.deepcopy(base)  # the plain model with each block weight rounded to k bits (RNE)
    for name, w in model.neuzip.decoded_weights().items():
        orig = base.get_parameter(name).detach()
        assert torch.equal(int_bits(w), int_bits(R.round_mantissa(orig, k)))
        rel = ((w.float() - orig.float()).abs() / orig.float().abs().clamp_min(1e-30)).max()
        assert rel <= 2.0 ** -(k + 1)
        rounded.get_parameter(name).data.copy_(w)
    assert torch.equal(model(x), rounded(x))  # so the logits differ from bf16 only through the weight bound


def _train(model, opt, steps, ckpt=False):
    losses = []
    for s in range(steps):
        x, y = batch(seed=s)
        opt.set_lr(1e-2 / (1 + s))  # a schedule, as a trainer would set it
        loss = model(x, labels=y)
        loss.backward()
        losses.append(loss.detach())
    return losses


def _state(model):
    out = {k: v for k, v in model.state_dict().items()}
    if getattr(model, "neuzip", None) is not None:
        out.update(model.neuzip.decoded_weights())
    return out


@pytest.mark.parametrize("optimizer, state_dtype", [("sgd", torch.float32), ("adamw", torch.float32),
                                                    ("adamw", "int8")])
def test_lomo_lossless_training_bit_identical(optimizer, state_dtype):
    cfg = LomoConfig(optimizer=optimizer, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, state_block=64)
    plain = tiny()
    packed = compress_model(copy.deepcopy(plain), train=cfg)
    opt_plain = lomo(plain, cfg)
    opt_packed = packed.neuzip.optimizer
    for step in range(4):  # compare after every step: losses and every weight
        la = _train(plain, opt_plain, 1)[0]
        lb = _train(packed, opt_packed, 1)[0]
        assert torch.equal(la, lb), step
        a, b = _state(plain), _state(packed)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(int_bits(a[name]), int_bits(b[name])), (step, name)
    assert packed.neuzip.stats["reencodes"] == 4 * len(packed.model.layers)
    assert all(p.grad is None for p in plain.parameters())  # gradients freed by the fused update
    sizes = [p.numel() for p in plain.parameters()]
    want = {"sgd": 0, "adamw": 8 * sum(sizes)}[optimizer]
    if state_dtype == "int8":  # a 1-byte code per value and state, a float32 scale per 64 values and state
        want = 2 * sum(sizes) + 2 * 4 * sum(-(-n // 64) for n in sizes)
        assert {st["exp_avg"].dtype for st in opt_packed.state.values()} == {torch.int8}  # the 8-bit path ran
    assert opt_packed.state_bytes == opt_plain.state_bytes == want


def test_observe_sees_every_decode_and_reencode_and_changes_nothing():
    """model.neuzip.observe(around): around(phase, block) wraps each block decode and re-encode inside the block
    (the stats count the same calls), the training is bit for bit the same, and nothing is left behind."""
    import contextlib

    cfg = LomoConfig(optimizer="adamw", lr=1e-2)
    plain = tiny()
    watched, control = compress_model(copy.deepcopy(plain), train=cfg), compress_model(copy.deepcopy(plain), train=cfg)
    st = watched.neuzip
    seen, depth = [], []

    @contextlib.contextmanager
    def around(phase, block):
        depth.append(block)
        seen.append((phase, block))
        try:
            yield
        finally:
            depth.pop()

    before = dict(st.stats)
    with st.observe(around) as same:
        assert same is st
        la = _train(watched, st.optimizer, 1)[0]
        assert not depth  # every call entered is left
    lb = _train(control, control.neuzip.optimizer, 1)[0]
    assert torch.equal(la, lb)
    for name, w in st.decoded_weights().items():
        assert torch.equal(int_bits(w), int_bits(control.neuzip.decoded_weights()[name])), name
    decodes = [b for phase, b in seen if phase == "decode"]
    reencodes = [b for phase, b in seen if phase == "reencode"]
    assert len(decodes) == st.stats["decodes"] - before["decodes"] > 0
    assert sorted(reencodes) == list(range(len(watched.model.layers)))  # on the CPU: each block once, at once
    assert "_decode" not in vars(st) and "_reencode" not in vars(st)  # the methods again
    n = len(seen)
    _train(watched, st.optimizer, 1)
    assert len(seen) == n  # outside the block: not called
    outer, inner = [], []  # nested blocks: both see the calls while the inner one is open

    def record(log):
        return lambda phase, block: (log.append((phase, block)), contextlib.nullcontext())[1]

    x, _ = batch()
    with torch.no_grad(), st.observe(record(outer)):
        with st.observe(record(inner)):
            watched(x)
        assert inner and outer == inner
        watched(x)
    assert len(outer) > len(inner) and "_decode" not in vars(st) and "_reencode" not in vars(st)
    with pytest.raises(TypeError, match="around must be callable"):
        with st.observe("not callable"):
            pass


def test_lomo_with_activation_checkpointing():
    cfg = LomoConfig(optimizer="adamw", lr=1e-2)
    plain = tiny()
    packed = compress_model(copy.deepcopy(plain), train=cfg)
    opt = lomo(plain, cfg)

    class Checkpointed(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, *args):
            return checkpoint(self.block, *args, use_reentrant=False)

    for i, layer in enumerate(packed.model.layers):  # recompute in backward: the block is decoded again
        packed.model.layers[i] = Checkpointed(layer)
    runs = packed.neuzip.stats["block_runs"]
    assert [float(v) for v in _train(plain, opt, 3)] == [float(v) for v in _train(packed, packed.neuzip.optimizer, 3)]
    a, b = _state(plain), _state(packed)
    b = {k.replace(".block.", "."): v for k, v in b.items()}
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert packed.neuzip.stats["block_runs"] - runs == 3 * 2 * len(packed.model.layers)  # forward + recompute


def test_transformers_llama_generates():
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    cfg = HFConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64)
    hf = HFLlama(cfg).to(torch.bfloat16).eval()
    x = torch.randint(0, 120, (1, 5))
    packed = compress_model(copy.deepcopy(hf))
    assert torch.equal(packed.generate(x, max_new_tokens=6, do_sample=False),
                       hf.generate(x, max_new_tokens=6, do_sample=False))
    lossy = compress_model(copy.deepcopy(hf), "lossy", 3)
    assert lossy.generate(x, max_new_tokens=4, do_sample=False).shape == (1, 9)
    assert lossy.neuzip.memory()["compressed_bytes"] < packed.neuzip.memory()["compressed_bytes"]


@pytest.mark.parametrize("shape", ["wide", "narrow"])
def test_block_kernel_interpreter_matches_reference(shape, monkeypatch):
    """The one-launch multi-tensor kernel (Triton interpreter) vs the reference, odd sizes, lossless and lossy,
    in both launch shapes (a small block launches NARROW; MIN_PROGRAMS_PER_SM = 0 forces WIDE)."""
    from thrifty.neuzip import block_decode as BD

    if shape == "wide":
        monkeypatch.setattr(BD, "MIN_PROGRAMS_PER_SM", 0)
    g = torch.Generator().manual_seed(3)
    big = (R.GROUP * R.STEPS * 4 + 5,)  # one unmasked program (4 groups) and a masked one
    for dtype, k, shapes in ((torch.bfloat16, None, [(33, 17), big, (5, 3)]), (torch.bfloat16, 3, [(7, 9), (130,)]),
                             (torch.float32, None, [(3,), (70, 3)])):
        ts = [(torch.randn(s, generator=g) * 0.02).to(dtype) for s in shapes]
        ts[-1].view(-1)[:5] = torch.exp(torch.randn(5, generator=g) * 6).to(dtype)  # long codes too
        pack = pack_tensors(ts, k)
        ref = torch.empty(pack.total_numel, dtype=dtype)
        pack.decode_into(ref, "reference")
        out = torch.full((pack.total_numel,), float("nan"), dtype=dtype)
        pack.decode_into(out, "triton")
        assert pack.launches == 1
        assert pack.launch_table("cpu")[2:] == (BD.WIDE if shape == "wide" else BD.NARROW)
        assert torch.equal(int_bits(out), int_bits(ref))
        if k == 3:  # a second decode into the same buffer takes the cached launch arguments
            out.fill_(float("nan"))
            pack.decode_into(out, "triton")
            assert pack.launches == 2 and len(pack._launches) == 1
            assert torch.equal(int_bits(out), int_bits(ref))
        want = torch.cat([(R.round_mantissa(t, k) if k is not None else t).reshape(-1) for t in ts])
        assert torch.equal(int_bits(ref), int_bits(want))


def test_block_kernel_real_weights_matches_reference():
    """The block kernel (interpreter, both launch shapes) on real weights: the 7 matrices of a SmolLM2-135M block
    (odd row counts, so every tensor ends in a masked program), bf16 and fp32."""
    from safetensors import safe_open

    from thrifty.neuzip import block_decode as BD
    from thrifty.paths import data_dir

    path = data_dir() / "smollm2-135m" / "model.safetensors"
    if not path.is_file():
        pytest.skip("SmolLM2 not converted (thrifty setup)")
    with safe_open(str(path), "pt") as f:
        names = sorted(n for n in f.keys() if "layers.7." in n and n.endswith("proj.weight"))
        ws = [f.get_tensor(n)[: 11 + 2 * i] for i, n in enumerate(names)]
    assert len(ws) == 7
    for dtype, min_programs in ((torch.bfloat16, 0), (torch.bfloat16, BD.MIN_PROGRAMS_PER_SM), (torch.float32, 0)):
        pack = pack_tensors([w.to(dtype) for w in ws])
        pack._meta.clear()
        old = BD.MIN_PROGRAMS_PER_SM
        BD.MIN_PROGRAMS_PER_SM = min_programs
        try:
            out = torch.full((pack.total_numel,), float("nan"), dtype=dtype)
            pack.decode_into(out, "triton")
        finally:
            BD.MIN_PROGRAMS_PER_SM = old
        assert pack.launches == 1 and pack.launch_table("cpu")[2:] == (BD.WIDE if min_programs == 0 else BD.NARROW)
        want = torch.cat([w.to(dtype).reshape(-1) for w in ws])
        assert torch.equal(int_bits(out), int_bits(want))


def test_model_runs_block_kernel_once_per_block():
    """A compressed model with impl='triton' (interpreter here) decodes each block in exactly one launch."""
    base = tiny(torch.bfloat16, layers=2)
    model = compress_model(copy.deepcopy(base), config=NeuZipConfig(impl="triton"))
    x, _ = batch(t=5, b=1)
    assert torch.equal(model(x), base(x))
    assert [p.launches for p in model.neuzip.packs] == [1, 1]
    assert model.neuzip.stats["decodes"] == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_encoder_matches_reference(dtype):
    g = torch.Generator().manual_seed(5)
    cases = ((1, 64, 1 << 20), (1000, 64, 1 << 20), (R.GROUP * 128 * 5 + 77, 128, R.GROUP * 128 * 2))  # 3 chunks
    for n, steps, chunk in cases:
        x = (torch.randn(n, generator=g) * 0.02).to(dtype)
        x[: n // 3] = torch.exp(torch.randn(n // 3, generator=g) * 8).to(dtype)
        _same_streams(R.encode(x, None, steps), encode_lossless(x, steps, chunk_elements=chunk))
    # pair symbols (chosen for these: plain N(0, 0.02) bf16/fp32), across chunk boundaries, odd end
    if dtype != torch.float16:
        x = (torch.randn(R.GROUP * 64 * 9 + 77, generator=g) * 0.02).to(dtype)
        assert _same_streams(R.encode(x, None, 64), encode_lossless(x, 64, chunk_elements=R.GROUP * 64 * 2))


def test_memory_accounting():
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = compress_model(LlamaForCausalLM(cfg).init_weights(seed=1).to(torch.bfloat16))
    mem = model.neuzip.memory()
    assert len(mem["blocks"]) == 2
    per_tensor = model.neuzip.compressed_tensors()
    assert mem["compressed_bytes"] == sum(ct.nbytes for ct in per_tensor.values())
    block_params = sum(ct.numel for ct in per_tensor.values())
    assert mem["bf16_bytes"] == 2 * block_params == sum(b["bf16_bytes"] for b in mem["blocks"])
    assert 0.6 < mem["ratio_vs_bf16"] < 0.72  # N(0, 0.02) init: ~0.67 plus the small tensors' code tables
    assert mem["buffer_bytes"] == 2 * 2 * max(b["params"] for b in mem["blocks"])
    other = sum(p.numel() * p.element_size() for p in model.parameters())
    assert mem["uncompressed_param_bytes"] == other
    lossy = compress_model(LlamaForCausalLM(cfg).init_weights(seed=1).to(torch.bfloat16), "lossy", 0)
    assert lossy.neuzip.memory()["ratio_vs_bf16"] < 0.3


def test_save_load_round_trip_and_refusals(tmp_path):
    base = tiny(torch.bfloat16)
    x, _ = batch()
    model = compress_model(copy.deepcopy(base), "lossy", 3)
    path = save_compressed(model, tmp_path / "ck")
    loaded = load_compressed(path)
    assert loaded.neuzip.config == model.neuzip.config
    assert torch.equal(loaded(x), model(x))
    with pytest.raises(ValueError, match="overwrite"):
        save_compressed(model, path)
    blob = (path / "neuzip.safetensors").read_bytes()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((path / "config.json").read_bytes())
    (bad / "neuzip.safetensors").write_bytes(blob[: len(blob) - 100])  # truncated
    with pytest.raises(ValueError):
        load_compressed(bad)
    flipped = bytearray(blob)
    flipped[-50] ^= 0x10  # a bit flip inside the streams
    (bad / "neuzip.safetensors").write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="checksum|corrupt|inconsistent"):
        load_compressed(bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="mantissa_bits"):
        NeuZipConfig(mode="lossless", mantissa_bits=3)
    with pytest.raises(ValueError, match="mantissa_bits"):
        NeuZipConfig(mode="lossy", mantissa_bits=2)
    with pytest.raises(ValueError, match="mantissa_bits"):
        NeuZipConfig(mode="lossy")
    with pytest.raises(TypeError, match="mantissa_bits"):
        NeuZipConfig(mode="lossy", mantissa_bits=3.0)
    with pytest.raises(ValueError, match="mode"):
        NeuZipConfig(mode="zip")
    with pytest.raises(ValueError, match="steps"):
        NeuZipConfig(steps=100)
    with pytest.raises(ValueError, match="impl"):
        NeuZipConfig(impl="cuda")
    with pytest.raises(TypeError, match="impl"):
        NeuZipConfig(impl=None)
    with pytest.raises(TypeError, match="reuse_code"):
        NeuZipConfig(reuse_code=1)
    with pytest.raises(ValueError, match="mantissa_bits"):  # lossy needs bf16 weights
        compress_model(tiny(torch.float32), "lossy", 3)
    with pytest.raises(ValueError, match="train"):  # lossy weights cannot be trained
        compress_model(tiny(torch.bfloat16), "lossy", 3, train=LomoConfig())
    lossy = compress_model(tiny(torch.bfloat16), "lossy", 1)
    with pytest.raises(ValueError, match="train"):
        lomo(lossy, LomoConfig())
    with pytest.raises(ValueError, match="model"):
        compress_model(lossy)
    with pytest.raises(TypeError, match="model"):
        compress_model("not a model")
    with pytest.raises(ValueError, match="model"):
        compress_model(torch.nn.Sequential(torch.nn.Linear(4, 4)))



def test_eval_cli_compressed_and_plain(tmp_path, capsys):
    from thrifty.cli import main
    from thrifty.paths import data_dir

    if not (data_dir() / "corpus" / "manifest.json").is_file():
        pytest.skip("needs the corpus built by `thrifty setup`")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).init_weights(seed=0)
    model.save_pretrained(tmp_path / "plain")
    save_compressed(compress_model(model), tmp_path / "packed")
    args = ["--batches", "1", "--batch-size", "1", "--seq-len", "16", "--device", "cpu"]
    ppl = []
    for path in ("plain", "packed"):
        assert main(["eval", str(tmp_path / path), *args]) == 0
        out = capsys.readouterr().out
        assert ("NeuZip lossless" in out) == (path == "packed")
        ppl.append(out.split("perplexity ")[1].split()[0])
    assert ppl[0] == ppl[1]  # lossless: the same perplexity to the last digit
    assert main(["eval", str(tmp_path / "missing"), *args]) == 2


def _same_streams(s, t):
    from thrifty.neuzip.tensor import code_streams

    code = code_streams(s.lengths)  # the stored code: 256 lengths, or the pairs that occur and theirs
    assert set(t) == {"words", "lane_units", "group_offsets", "raw", *code}
    assert np.array_equal(s.words.view(np.int32), t["words"].numpy())
    assert np.array_equal(s.lane_len, t["lane_units"].numpy())
    assert np.array_equal(s.group_offsets, t["group_offsets"].numpy())
    assert np.array_equal(s.raw, t["raw"].numpy())
    assert all(torch.equal(v, t[k].cpu()) for k, v in code.items())
    return s.pairs


def test_triton_encoder_interpreter_matches_reference():
    """The encoder kernels (LOMO's GPU re-encode) under the interpreter: same streams as the reference."""
    g = torch.Generator().manual_seed(6)
    for dtype, n in ((torch.bfloat16, R.GROUP * R.STEPS + 17), (torch.float32, 300)):
        x = (torch.randn(n, generator=g) * 0.02).to(dtype)
        x[:40] = torch.exp(torch.randn(40, generator=g) * 8).to(dtype)  # long codes
        x[0], x[1] = float("nan"), -0.0
        _same_streams(R.encode(x, None, R.STEPS), encode_on_device(x, R.STEPS, impl="triton"))
        y = (torch.randn(R.GROUP * R.STEPS * 8 + 3, generator=g) * 0.02).to(dtype)  # pair symbols, odd end
        assert _same_streams(R.encode(y, None, R.STEPS), encode_on_device(y, R.STEPS, impl="triton"))


def test_triton_block_encoder_two_host_reads(monkeypatch):
    """The block encoder (LOMO's re-encode of a whole block): every tensor's streams equal the reference's, the
    returned host codes are the stored ones, and the block costs exactly two device-to-host reads (``_to_host``)
    and no other host read of a tensor (those would sync on a GPU; nor ``torch.bincount``, which reads its
    input's min and max)."""
    from thrifty.neuzip import encode_kernel as EK

    g = torch.Generator().manual_seed(12)
    xs = [(torch.randn(n, generator=g) * 0.02).bfloat16() for n in (R.GROUP * R.STEPS * 4 + 3, 500, 4100)]
    xs[1][:60] = torch.exp(torch.randn(60, generator=g) * 8).bfloat16()  # long codes, ~every pair distinct
    host_reads, reads = _count_reads(monkeypatch, EK)
    streams, codes = EK.encode_block_triton(xs, R.STEPS)
    assert len(host_reads) == 2 and not reads, (host_reads, reads)
    monkeypatch.undo()
    pairs = [_same_streams(R.encode(x, None, R.STEPS), t) for x, t in zip(xs, streams)]
    assert set(pairs) == {True, False}  # both kinds of code in one block
    for x, t, code in zip(xs, streams, codes):
        assert np.array_equal(code, CompressedTensor(t, x.dtype, x.shape, steps=R.STEPS).code_lengths())


def test_triton_block_encoder_profile_same_bytes(monkeypatch):
    """With an EncodeProfile (the benchmark's per-stage split) the encoder gives the same streams and codes, still
    two host reads, and records every stage once (host ms; GPU ms only on CUDA)."""
    from thrifty.neuzip import encode_kernel as EK

    g = torch.Generator().manual_seed(14)
    xs = [(torch.randn(n, generator=g) * 0.02).bfloat16() for n in (R.GROUP * R.STEPS * 2 + 5, 700)]
    plain, plain_codes = EK.encode_block_triton(xs, R.STEPS)
    host_reads = []
    original_to_host = EK._to_host
    monkeypatch.setattr(EK, "_to_host", lambda t: (host_reads.append(t.shape), original_to_host(t))[1])
    prof = EK.EncodeProfile(xs[0].device)
    streams, codes = EK.encode_block_triton(xs, R.STEPS, profile=prof)
    monkeypatch.undo()
    assert len(host_reads) == 2
    for a, b in zip(plain, streams):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(np.array_equal(a, b) for a, b in zip(plain_codes, codes))
    rows = prof.rows()
    names = [r[0] for r in rows]
    assert names == ["setup", "sym_hist", "ranks", "pair_hist", "read1", "code_lengths", "pair_code", "canonical",
                     "code_streams", "upload_tables", "lane_bits", "cumsum", "read2", "pack", "outputs"]
    assert all(h >= 0 and gpu is None for _, h, gpu in rows)  # CPU: no events


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_block_encoder_views_odd_sizes(dtype):
    """Tensors that are views of one buffer (LOMO's block buffer: encoded in place, no copy) at odd offsets and
    of odd, tiny and empty sizes, specials, > WINDOW distinct symbols (the pair histogram's escape path) and two
    lane lengths: byte for byte the reference's streams."""
    from thrifty.neuzip.encode_kernel import WINDOW, encode_block_triton

    g = torch.Generator().manual_seed(13)
    sizes = (R.GROUP * 64 * 2 + 7, 1, 0, 129, 3001)
    buf = (torch.randn(sum(sizes), generator=g) * 0.02).to(dtype)
    buf[:300] = torch.exp(torch.randn(300, generator=g) * 10).to(dtype)  # wide exponents: > WINDOW symbols
    buf[300:310] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40, 0.0, 0.0, 0.0]).to(dtype)
    views, at = [], 0
    for n in sizes:
        views.append(buf[at: at + n])
        at += n
    assert len(np.unique(R.split_symbols(R._uint_view(buf), dtype)[0])) > WINDOW
    for steps in (R.STEPS, 128):
        streams, _ = encode_block_triton(views, steps)
        for v, t in zip(views, streams):
            _same_streams(R.encode(v, None, steps), t)


def test_triton_block_encoder_real_weights():
    """Real weights, both encoders byte for byte: a trained MLP's (300 Adam steps) and, when converted, a
    SmolLM2-135M block's q, k and up projections (cut to ~12K elements each so the interpreter stays quick)."""
    from thrifty.neuzip.encode_kernel import encode_block_triton

    g = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 63))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(300):
        x = torch.randn(64, 64, generator=g)
        loss = (net(x) - torch.tanh(x[:, :63])).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    xs = [p.detach().bfloat16() for p in net.parameters()]
    path = os.path.join(os.environ.get("THRIFTY_DATA", os.path.join(os.path.dirname(__file__), "..", "data")),
                        "smollm2-135m", "model.safetensors")
    if os.path.exists(path):
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            names = [k for k in f.keys() if ".layers.3." in k and k.endswith(("q_proj.weight", "k_proj.weight",
                                                                                "up_proj.weight"))]
            xs += [f.get_tensor(k).bfloat16().reshape(-1)[: 12_000 + 3 * i] for i, k in enumerate(sorted(names))]
    streams, _ = encode_block_triton(xs, R.STEPS)
    pairs = [_same_streams(R.encode(x, None, R.STEPS), t) for x, t in zip(xs, streams)]
    assert any(pairs)


def _block_views(dtype, sizes, seed):
    """Views of one buffer (as LOMO's block buffer) of N(0, 0.02) weights with a few long codes."""
    g = torch.Generator().manual_seed(seed)
    buf = (torch.randn(sum(sizes), generator=g) * 0.02).to(dtype)
    buf[:30] = torch.exp(torch.randn(30, generator=g) * 3).to(dtype)
    views, at = [], 0
    for n in sizes:
        views.append(buf[at: at + n])
        at += n
    return buf, views


def _drift(buf, seed, scale=2e-3):
    """An optimizer-like step in place: every weight moves by ~scale of itself (no new exponent this small)."""
    g = torch.Generator().manual_seed(seed)
    buf.copy_((buf.float() * (1 + scale * torch.randn(buf.shape, generator=g))).to(buf.dtype))


def _decodes_to(streams, views, pack=None):
    """Each tensor's streams decode (NumPy reference) to its view's bits; with ``pack`` also the one-launch block
    decode (interpreter) of the pack those streams were put in."""
    for v, t in zip(views, streams):
        got = CompressedTensor(t, v.dtype, v.shape, steps=R.STEPS).decompress(impl="reference")
        assert torch.equal(int_bits(got), int_bits(v))
    if pack is not None:
        out = torch.empty(pack.total_numel, dtype=pack.dtype)
        pack.decode_into(out, impl="triton")
        assert torch.equal(int_bits(out), int_bits(torch.cat([v.reshape(-1) for v in views])))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reencode_reusing_the_code_is_lossless(dtype):
    """A drifted block re-encoded with its previous code (LOMO's default): reused, the same stored code, new
    word streams (odd, tiny and empty sizes), and both decoders give back the
    drifted weights bit for bit, the block decode through the pack's kept tables. The codes built for reuse are
    single-symbol (covering) codes, also where the fresh reference code of a tensor is a pair code."""
    from thrifty.neuzip.block_decode import BlockPack
    from thrifty.neuzip.encode_kernel import encode_block_triton, reencode_block_triton

    sizes = (R.GROUP * R.STEPS * 2 + 7, 1, 0, 129, 3001, 24_001)
    buf, views = _block_views(dtype, sizes, seed=21)
    reference_pairs = [len(c) == R.PAIR_SYMBOLS for c in encode_block_triton(views)[1]]
    assert any(reference_pairs) and not all(reference_pairs)  # the fresh codes mix pair and single tensors
    streams, lengths, code, reused = reencode_block_triton(views, None)
    assert not reused and all(len(c) == 256 for c in lengths)
    pack = BlockPack([CompressedTensor(s, v.dtype, v.shape, steps=R.STEPS) for s, v in zip(streams, views)])
    pack.replace(streams, lengths)
    tables = pack.kernel_tables(pack.device)
    _drift(buf, seed=22)
    new, new_lengths, new_code, reused = reencode_block_triton(views, code)
    assert reused and new_code is code and new_lengths is lengths
    assert all(torch.equal(new[i][k], streams[i][k]) for i in range(len(sizes)) for k in ("lengths", "pair_syms")
               if k in streams[i])  # the old code is stored with the new streams
    assert any(not torch.equal(a["words"], b["words"]) for a, b in zip(new, streams))  # the weights did change
    pack.replace(new, new_lengths, keep_tables=True)
    assert pack.kernel_tables(pack.device) is tables  # not rebuilt
    for k in ("words", "lane_units", "group_offsets", "raw"):  # the encoder's buffers taken as they are, no copy
        assert pack.streams[k].untyped_storage().data_ptr() == new[0][k].untyped_storage().data_ptr(), k
    _decodes_to(new, views, pack)
    assert not any(pack.pairs)


def test_reencode_reuses_the_code_when_weights_reach_new_small_exponents():
    """Weights that a step takes towards zero (new small exponents, zero, a subnormal: what AdamW does to weights
    near zero, whatever their size) stay covered by the reused code: no fresh build, lossless."""
    from thrifty.neuzip.encode_kernel import reencode_block_triton

    buf, views = _block_views(torch.bfloat16, (R.GROUP * R.STEPS * 4 + 5, 129), seed=33)
    _, _, code, _ = reencode_block_triton(views, None)
    for value in (1e-30, 0.0, -1e-39, 3e-12):  # 1e-39 is subnormal in bf16
        views[0][41] = value
        views[1][7] = -value
        streams, _, code, reused = reencode_block_triton(views, code)
        assert reused, value
        _decodes_to(streams, views)


def test_reencode_falls_back_to_a_fresh_code_on_a_new_exponent():
    """A weight whose exponent lies above the code's headroom (in either tensor): a fresh code (lossless, not the
    reference's bytes) that covers it; the code after it is reused again."""
    from thrifty.neuzip.encode_kernel import reencode_block_triton

    sizes = (R.GROUP * R.STEPS * 4 + 5, 129)  # the second tensor's fresh reference code is a pair code
    for slot in range(len(sizes)):
        buf, views = _block_views(torch.bfloat16, sizes, seed=31)
        _, _, code, _ = reencode_block_triton(views, None)
        assert [c.size for c in code.lengths] == [256, 256]
        views[slot][40] = 3.0e38  # exponent 254: in no N(0, 0.02) block, far above the headroom
        streams, _, new_code, reused = reencode_block_triton(views, code)
        assert not reused and new_code is not code
        _decodes_to(streams, views)
        _drift(buf, seed=32, scale=1e-4)
        again, _, _, reused = reencode_block_triton(views, new_code)
        assert reused
        _decodes_to(again, views)


def test_reencode_rebuilds_a_code_whose_bits_grew():
    """A reused code whose block needs more than REBUILD_GROWTH more bits than at its fresh build is marked stale
    and replaced at the next encode (no extra read: the sizes are read anyway)."""
    import dataclasses

    from thrifty.neuzip import encode_kernel as EK

    _, views = _block_views(torch.bfloat16, (R.GROUP * R.STEPS + 5, 700), seed=41)
    _, _, code, _ = EK.reencode_block_triton(views, None)
    _, _, same, reused = EK.reencode_block_triton(views, code)
    assert reused and same is code and not same.stale  # no growth: kept as is
    shrunk = dataclasses.replace(code, fresh_bits=int(code.fresh_bits / (1 + 2 * EK.REBUILD_GROWTH)))
    streams, _, stale, reused = EK.reencode_block_triton(views, shrunk)
    assert reused and stale.stale
    _decodes_to(streams, views)
    _, _, fresh, reused = EK.reencode_block_triton(views, stale)
    assert not reused and not fresh.stale and fresh.fresh_bits == code.fresh_bits


def test_reencode_bad_previous():
    from thrifty.neuzip.encode_kernel import reencode_block_triton

    _, views = _block_views(torch.bfloat16, (300, 200), seed=51)
    _, _, code, _ = reencode_block_triton(views, None)
    with pytest.raises(TypeError, match="previous"):
        reencode_block_triton(views, {"code": 1})
    with pytest.raises(ValueError, match="previous"):
        reencode_block_triton(views[:1], code)


def _count_reads(monkeypatch, EK):
    """(list of ``_to_host`` reads, list of other host reads) while the monkeypatches hold."""
    host_reads, reads = [], []
    original_to_host = EK._to_host
    monkeypatch.setattr(EK, "_to_host", lambda t: (host_reads.append(t.shape), original_to_host(t))[1])
    monkeypatch.setattr(torch, "bincount", lambda *a, **k: reads.append("bincount"))
    for name in ("cpu", "item", "tolist", "__int__", "__index__", "__bool__", "__float__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _f=original, _n=name, **k: (reads.append(_n), _f(self, *a, **k))[1])
    return host_reads, reads


def test_reencode_reusing_the_code_reads_the_host_once(monkeypatch):
    """The reuse path costs one device-to-host read (the stream sizes with the coverage counts; the fresh encode
    two) and no other host read of a tensor; the fallback three (its check, then the fresh encode's two)."""
    from thrifty.neuzip import encode_kernel as EK

    buf, views = _block_views(torch.bfloat16, (R.GROUP * R.STEPS * 2 + 3, 500, 4100), seed=61)
    _, _, code, _ = EK.reencode_block_triton(views, None)
    _drift(buf, seed=62)
    host_reads, reads = _count_reads(monkeypatch, EK)
    streams, _, _, reused = EK.reencode_block_triton(views, code)
    assert reused and len(host_reads) == 1 and not reads, (host_reads, reads)
    views[1][7] = 3.0e38  # a new exponent
    host_reads.clear()
    streams, _, _, reused = EK.reencode_block_triton(views, code)
    assert not reused and len(host_reads) == 3 and not reads, (host_reads, reads)
    monkeypatch.undo()
    _decodes_to(streams, views)


def test_lomo_triton_reuses_codes_bit_identical():
    """Three LOMO steps with the Triton encoder (interpreter): the first re-encode builds a code, both later
    ones reuse it (stats: the covering code keeps AdamW's new small exponents), and the training stays bit-identical to the plain model; reuse_code=False builds every time, with the same weights."""
    cfg = LomoConfig(optimizer="adamw", lr=1e-5)
    plain = tiny(torch.bfloat16, layers=1)
    reusing = compress_model(copy.deepcopy(plain), config=NeuZipConfig(impl="triton", reuse_code=True), train=cfg)
    building = compress_model(copy.deepcopy(plain), config=NeuZipConfig(impl="triton", reuse_code=False), train=cfg)
    opt = lomo(plain, cfg)
    for step in range(3):
        x, y = batch(seed=step, t=4, b=1)
        losses = [m(x, labels=y) for m in (plain, reusing, building)]
        for loss in losses:
            loss.backward()
        assert torch.equal(losses[0], losses[1]) and torch.equal(losses[0], losses[2])
    assert reusing.neuzip.stats["code_builds"] == 1 and reusing.neuzip.stats["code_reuses"] == 2
    assert building.neuzip.stats["code_builds"] == 3 and building.neuzip.stats["code_reuses"] == 0
    for model in (reusing, building):
        for n, w in model.neuzip.decoded_weights().items():
            assert torch.equal(int_bits(w), int_bits(plain.get_parameter(n)))


def test_lomo_reencode_with_triton_kernels():
    """LOMO with impl='triton' (decode and re-encode kernels, interpreter): bit-identical to the plain model."""
    cfg = LomoConfig(optimizer="sgd", lr=1e-2)
    plain = tiny(torch.bfloat16, layers=1)
    packed = compress_model(copy.deepcopy(plain), config=NeuZipConfig(impl="triton"), train=cfg)
    opt = lomo(plain, cfg)
    x, y = batch(t=4, b=1)
    la, lb = plain(x, labels=y), packed(x, labels=y)
    la.backward()
    lb.backward()
    assert torch.equal(la, lb)
    assert packed.neuzip.stats["reencodes"] == 1
    with torch.no_grad():  # the updated, re-encoded weights give the same loss
        assert torch.equal(plain(x, labels=y), packed(x, labels=y))
    weights = packed.neuzip.decoded_weights()
    assert all(torch.equal(int_bits(w), int_bits(plain.get_parameter(n))) for n, w in weights.items())


def test_transformers_llama_lomo_bit_identical_with_hf_checkpointing():
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    cfg = HFConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    plain = HFLlama(cfg)
    packed = compress_model(copy.deepcopy(plain), train=LomoConfig(lr=1e-2))
    packed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    packed.train()
    lomo(plain, LomoConfig(lr=1e-2))
    x = torch.randint(0, 120, (2, 7))
    for _ in range(2):
        a, b = plain(input_ids=x, labels=x).loss, packed(input_ids=x, labels=x).loss
        a.backward()
        b.backward()
        assert torch.equal(a, b)
    assert packed.neuzip.stats["block_runs"] == 2 * 2 * 2  # forward + recompute, 2 blocks, 2 steps


@pytest.mark.parametrize("extra, says", [(["--batches", "0"], "--batches"), (["--seq-len", "-1"], "--seq-len"),
                                         (["--device", "tpu"], "--device")])
def test_eval_cli_user_errors_are_one_line(tmp_path, capsys, extra, says):
    """Once, --batches 0 printed a perplexity of 1.0 over no tokens, and a bad --device gave a traceback."""
    from thrifty.cli import main

    assert main(["eval", str(tmp_path / "missing"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err and "Traceback" not in err


def test_load_compressed_refuses_a_config_that_does_not_match_the_weights(tmp_path):
    """A config.json edited (or damaged) to other layer sizes loaded, and failed only in forward."""
    import json

    save_compressed(compress_model(tiny()), tmp_path / "ckpt")
    cfg_path = tmp_path / "ckpt" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "intermediate_size": 40}))
    with pytest.raises(ValueError, match="config.json"):
        load_compressed(tmp_path / "ckpt")
    cfg_path.write_bytes(b"\xfb" + cfg_path.read_bytes())  # not UTF-8
    with pytest.raises(ValueError, match="config.json"):
        load_compressed(tmp_path / "ckpt")


def test_deferred_reencode_is_bit_identical_and_lazy():
    """``defer`` (the CUDA default): a block is re-encoded when its buffer is next taken, not at its last
    update. Same losses and weights as the plain model; after a backward the last blocks wait in their buffers
    (fewer re-encodes than blocks) until a decode needs the buffer or flush() writes them back."""
    cfg = LomoConfig(optimizer="adamw", lr=1e-2, weight_decay=0.1)
    plain = tiny(layers=4)
    packed = compress_model(copy.deepcopy(plain), train=cfg)
    packed.neuzip.defer = True
    opt = lomo(plain, cfg)
    for step in range(3):
        assert torch.equal(_train(plain, opt, 1)[0], _train(packed, packed.neuzip.optimizer, 1)[0]), step
        st = packed.neuzip
        assert st.stats["reencodes"] < (step + 1) * len(packed.model.layers) and any(st.dirty), step
    a, b = _state(plain), _state(packed)  # decoded_weights() flushes the blocks still waiting
    assert not any(packed.neuzip.dirty)
    assert packed.neuzip.stats["reencodes"] == 3 * len(packed.model.layers)
    assert all(torch.equal(int_bits(a[k]), int_bits(b[k])) for k in a)
