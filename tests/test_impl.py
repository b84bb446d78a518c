"""One implementation-choice rule (issue #30): every public entry point that picks kernels takes ``impl`` with the
library's vocabulary (``thrifty._checks.IMPLS``: "auto", "triton", "reference"; a few add kernel names of their
own), refuses anything else with an error naming ``impl``, and ``"reference"`` / ``"triton"`` run the path they
name (CPU: ``"triton"`` under TRITON_INTERPRET=1, set by conftest)."""

from __future__ import annotations

import inspect

import pytest
import torch

import thrifty
from thrifty import bitnet, neuzip
from thrifty._checks import IMPLS
from thrifty.attention import sage_seam
from thrifty.bitnet import BitLinear, BitNetConfig, PackedBitLinear
from thrifty.bitnet.recipes import checkpoint_record, from_checkpoint_record
from thrifty.kv import decode_attention, quantize_kv_cache
from thrifty.kvcache import ShadowKVCache, ShadowKVConfig, ShadowKVEngine
from thrifty.models import LlamaConfig, LlamaForCausalLM, generate, preset
from thrifty.neuzip.encode import encode_on_device
from thrifty.optim import FusedOptimizer, LomoConfig
from thrifty.triton_utils import kernels_available

needs_kernels = pytest.mark.skipif(not kernels_available("cpu") and not torch.cuda.is_available(),
                                   reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_llama(recipe=None, impl="auto"):
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).init_weights(seed=1)
    return model if recipe is None else bitnet.convert(model, BitNetConfig(recipe=recipe, impl=impl))


def _qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 32, 64, generator=g) for _ in range(3)]


def _ce_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 16, generator=g), torch.randn(40, 16, generator=g), torch.randint(0, 40, (6,), generator=g)


def _shadowkv_model():
    return LlamaForCausalLM(preset("tiny", vocab_size=97)).init_weights(std=0.2, seed=0).eval()


def _kv_config():
    return ShadowKVConfig(rank=16, chunk_size=4, sparse_budget=16, outlier_chunks=2, local_chunks=2,
                          min_prompt_len=20, max_generated=16)


# every public entry point that chooses kernels, called with impl=value
ENTRY_POINTS = {
    "sage_attention": lambda impl: thrifty.sage_attention(*_qkv(), impl=impl),
    "sage_seam": lambda impl: sage_seam(impl=impl),
    "decode_attention": lambda impl: decode_attention(
        torch.randn(1, 2, 1, 64), quantize_kv_cache(*_qkv()[:2]), impl=impl),
    "linear_cross_entropy": lambda impl: thrifty.linear_cross_entropy(*_ce_inputs(), impl=impl),
    "BitLinear": lambda impl: BitLinear(8, 4, impl=impl),
    "BitLinear.configure": lambda impl: BitLinear(8, 4).configure(impl=impl),
    "BitNetConfig": lambda impl: BitNetConfig(impl=impl),
    "PackedBitLinear.from_bitlinear": lambda impl: PackedBitLinear.from_bitlinear(BitLinear(64, 16), impl=impl),
    "bitnet.pack": lambda impl: bitnet.pack(tiny_llama("b1.58"), impl=impl),
    "NeuZipConfig": lambda impl: neuzip.NeuZipConfig(impl=impl),
    "neuzip.encode_on_device": lambda impl: encode_on_device(torch.randn(64, dtype=torch.bfloat16), impl=impl),
    "CompressedTensor.decompress": lambda impl: neuzip.compress(torch.randn(64, dtype=torch.bfloat16)).decompress(impl=impl),
    "LomoConfig": lambda impl: LomoConfig(impl=impl),
    "OptimizeConfig": lambda impl: thrifty.OptimizeConfig(cce=True, impl=impl),
    "ShadowKVCache": lambda impl: ShadowKVCache(_shadowkv_model(), _kv_config(), impl=impl),
    "ShadowKVEngine.impl": lambda impl: setattr(ShadowKVCache(_shadowkv_model(), _kv_config()).engine, "impl", impl),
}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("impl", IMPLS)
def test_every_entry_point_accepts_the_shared_vocabulary(name, impl):
    if impl == "triton" and not (kernels_available("cpu") or torch.cuda.is_available()) and name in (
            "sage_attention", "decode_attention", "linear_cross_entropy"):
        pytest.skip("no Triton device")
    ENTRY_POINTS[name](impl)


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_every_entry_point_refuses_a_bad_impl_by_name(name):
    with pytest.raises(ValueError, match="impl"):
        ENTRY_POINTS[name]("fast")
    with pytest.raises((TypeError, ValueError), match="impl"):  # the old spelling of BitLinear's, fused=True
        ENTRY_POINTS[name](True)


def test_signatures_name_the_choice_impl_with_auto_by_default():
    for fn in (thrifty.sage_attention, decode_attention, thrifty.linear_cross_entropy, BitLinear.__init__,
               PackedBitLinear.from_bitlinear, bitnet.pack, bitnet.packed_factory, LlamaForCausalLM.from_packed,
               ShadowKVCache.__init__, ShadowKVEngine.__init__, encode_on_device, neuzip.CompressedTensor.decompress):
        params = inspect.signature(fn).parameters
        assert params["impl"].default == "auto", fn
        assert not {"fused", "backend"} & set(params), fn
    for cls in (BitNetConfig, thrifty.OptimizeConfig, neuzip.NeuZipConfig, LomoConfig):
        assert cls.__dataclass_fields__["impl"].default == "auto", cls


def test_from_packed_refuses_a_bad_impl(tmp_path):
    path = bitnet.export(tiny_llama("b1.58"), tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match="impl"):
        LlamaForCausalLM.from_packed(path, impl="torch")  # the old word for "reference"
    assert LlamaForCausalLM.from_packed(path, impl="reference") is not None


# ------------------------------------------------------------------------------------------ the path that ran

@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_lomo_runs_the_path_it_names(impl, monkeypatch):
    if impl == "triton" and not kernels_available(DEVICE):
        pytest.skip("no Triton device")
    from thrifty.optim import lomo_kernel as LK

    calls = []
    real = LK.adamw_update
    monkeypatch.setattr(LK, "adamw_update", lambda *a, **k: calls.append(1) or real(*a, **k))
    opt = FusedOptimizer(LomoConfig(impl=impl))
    opt.update("w", torch.zeros(4, 8, device=DEVICE), torch.ones(4, 8, device=DEVICE))
    assert len(calls) == (impl == "triton")


def _bitlinear_paths(model):
    return {m.last_path for m in model.modules() if isinstance(m, BitLinear)}


def test_bitnet_reference_runs_the_plain_path():
    model = tiny_llama("a4.8", impl="reference")
    model(torch.randint(0, 64, (2, 7)))
    assert _bitlinear_paths(model) == {"reference"}
    layer = BitLinear(16, 8, impl="reference")
    layer(torch.randn(3, 16))
    assert layer.last_path == "reference"


@needs_kernels
def test_bitnet_triton_runs_the_kernels(monkeypatch):
    from thrifty.bitnet import quant_kernel as QK

    calls = []
    real = QK._launch
    monkeypatch.setattr(QK, "_launch", lambda *a: calls.append(a[1]) or real(*a))
    model = tiny_llama("a4.8", impl="triton").to(DEVICE)
    model(torch.randint(0, 64, (2, 7), device=DEVICE))
    assert _bitlinear_paths(model) == {"triton"} and calls
    layer = BitLinear(16, 8, device=DEVICE).configure(impl="triton")
    layer(torch.randn(3, 16, device=DEVICE))
    assert layer.last_path == "triton"


def test_bitnet_auto_runs_the_reference_on_the_cpu():
    layer = BitLinear(16, 8)  # impl="auto": Triton on CUDA only, even under the interpreter
    layer(torch.randn(3, 16))
    assert layer.last_path == "reference"


def test_bitnet_checkpoint_records_impl_and_refuses_the_old_fused_field():
    model = tiny_llama("b1.58", impl="reference")
    record = checkpoint_record(model)
    assert record["impl"] == "reference" and "fused" not in record
    rebuilt = from_checkpoint_record(tiny_llama(), record)
    assert {m.impl for m in rebuilt.modules() if isinstance(m, BitLinear)} == {"reference"}
    # `fused` (before it became `impl`) was never in a released file: an unknown field, refused by name
    old = {**{k: v for k, v in record.items() if k != "impl"}, "fused": False}
    with pytest.raises(ValueError, match=r"unknown fields \['fused'\].*'impl'"):
        from_checkpoint_record(tiny_llama(), old)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_shadowkv_impl_runs_the_path_it_names(impl):
    if impl == "triton" and not (kernels_available("cpu") or torch.cuda.is_available()):
        pytest.skip("no Triton device")
    model = _shadowkv_model()
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(4))
    caches = []

    def factory():
        caches.append(ShadowKVCache(model, _kv_config(), impl=impl))
        return caches[-1]

    generate(model, ids, 3, cache_factory=factory)
    stats = caches[0].engine.stats
    assert caches[0].engine.impl == impl
    assert stats["kernel_steps" if impl == "triton" else "reference_steps"] > 0
    assert stats["reference_steps" if impl == "triton" else "kernel_steps"] == 0

