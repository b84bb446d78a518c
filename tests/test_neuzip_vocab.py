"""NeuZip's coded vocabulary (``NeuZipConfig(vocab=True)``): the embedding and lm_head in row chunks, for serving.
CPU (reference decoder, and the block kernel under the Triton interpreter) and, marked cuda, the GPU."""

import copy
import os

import pytest
import torch

from thrifty.models import LlamaConfig, LlamaForCausalLM
from thrifty.neuzip import NeuZipConfig, compress_model, decompress_model, load_compressed, save_compressed
from thrifty.optim import LomoConfig
from thrifty.neuzip import reference as R

VOCAB = 1001  # odd, and several chunks of a block buffer each: the last chunk is short


def tiny(tied=True, dtype=torch.bfloat16, hidden=32, layers=2):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).init_weights(seed=0).to(dtype)


def ids(seed=0, b=2, t=13):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (b, t), generator=g)
    x[0, :3] = torch.tensor([0, VOCAB - 1, 50])  # the first and last rows of the matrix
    return x


def rounded(model, k):
    """The plain model with every vocabulary matrix rounded like the codec rounds it (the lossy spec)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for w in {id(p): p for p in (out.model.embed_tokens.weight, out.lm_head.weight)}.values():
            w.copy_(R.round_mantissa(w, k))
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_lossless_vocab_logits_bit_identical(tied):
    base = tiny(tied)
    model = compress_model(copy.deepcopy(base), config=NeuZipConfig(vocab=True))
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x), base(x))
        assert torch.equal(model(x, logits_to_keep=1), base(x, logits_to_keep=1))
    assert type(model.model.embed_tokens).__name__ == "CompressedEmbedding"
    assert type(model.lm_head).__name__ == "CompressedHead"
    assert len(model.neuzip.vocab[next(iter(model.neuzip.vocab))].packs) > 1  # several chunks ran


@pytest.mark.parametrize("k", [3, 0])
def test_lossy_vocab_equals_rounded_weights(k):
    base = tiny()
    model = compress_model(copy.deepcopy(base), config=NeuZipConfig(mode="lossy", mantissa_bits=k, vocab=True))
    spec = compress_model(rounded(base, k), "lossy", k)  # blocks rounded by the codec, vocabulary by the spec
    x = ids(1)
    with torch.no_grad():
        assert torch.equal(model(x), spec(x))


def test_loss_seam_and_whole_weight():
    base = tiny()
    model = compress_model(copy.deepcopy(base), config=NeuZipConfig(vocab=True))
    x = ids(2)
    with torch.no_grad():
        assert torch.equal(model(x, labels=x), base(x, labels=x))
        assert torch.equal(model.lm_head.weight, base.lm_head.weight)


@pytest.mark.parametrize("tied", [True, False])
def test_decompress_restores_vocab_and_tie(tied):
    base = tiny(tied, dtype=torch.float32)
    model = decompress_model(compress_model(copy.deepcopy(base), config=NeuZipConfig(vocab=True)))
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding) and isinstance(model.lm_head, torch.nn.Linear)
    assert torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert torch.equal(model.lm_head.weight, base.lm_head.weight)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in base.named_parameters()}


def test_memory_counts_the_coded_vocabulary():
    base = tiny(hidden=64)
    models = [compress_model(copy.deepcopy(base), "lossy", 3),  # kept alive: memory() walks the live model
              compress_model(copy.deepcopy(base), config=NeuZipConfig(mode="lossy", mantissa_bits=3, vocab=True))]
    plain, coded = (m.neuzip.memory() for m in models)
    vocab_bf16 = VOCAB * 64 * 2
    assert plain["uncompressed_param_bytes"] - coded["uncompressed_param_bytes"] == vocab_bf16  # tied: once
    assert 0 < coded["vocab_compressed_bytes"] < 0.6 * vocab_bf16
    assert coded["total_weight_bytes"] < plain["total_weight_bytes"]
    assert coded["buffer_bytes"] == plain["buffer_bytes"]  # the chunks borrow the block buffers


def test_refusals_leave_the_model_unchanged(tmp_path):
    base = tiny()
    with pytest.raises(ValueError, match="train"):
        compress_model(copy.deepcopy(base), config=NeuZipConfig(vocab=True), train=LomoConfig())
    with pytest.raises(TypeError, match="vocab"):
        NeuZipConfig(vocab="yes")
    fp32 = tiny(dtype=torch.float32)
    fp32.model.layers.to(torch.bfloat16)  # bf16 blocks, fp32 vocabulary: lossy cannot code it
    with pytest.raises(ValueError, match="mantissa_bits"):
        compress_model(fp32, config=NeuZipConfig(mode="lossy", mantissa_bits=3, vocab=True))
    assert getattr(fp32, "neuzip", None) is None and isinstance(fp32.lm_head, torch.nn.Linear)


@pytest.mark.parametrize("tied,mode", [(True, "lossless"), (False, "lossy")])
def test_save_load_round_trip_keeps_the_coded_vocabulary(tmp_path, tied, mode):
    """A vocab-coded model saves and loads as it is: the same logits, the same coded bytes, the embedding and
    lm_head still coded (one matrix when tied)."""
    config = NeuZipConfig(mode=mode, mantissa_bits=3 if mode == "lossy" else None, vocab=True)
    model = compress_model(tiny(tied), config=config)
    path = save_compressed(model, tmp_path / "ckpt")
    loaded = load_compressed(path)
    x = ids(2)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert loaded.neuzip.config == model.neuzip.config
    assert loaded.neuzip.memory()["vocab_compressed_bytes"] == model.neuzip.memory()["vocab_compressed_bytes"]
    assert type(loaded.lm_head).__name__ == "CompressedHead"
    assert (loaded.neuzip.vocab["lm_head"] is loaded.neuzip.vocab["model.embed_tokens"]) == tied


def test_load_refuses_a_vocabulary_that_does_not_match(tmp_path):
    import json

    path = save_compressed(compress_model(tiny(), config=NeuZipConfig(vocab=True)), tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    for name, change in [("rows", lambda c: c["thrifty_neuzip_vocab"]["matrices"]["model.embed_tokens.weight"]
                          .update(chunk_rows=7)),
                         ("layout", lambda c: c.pop("thrifty_neuzip_vocab")),
                         ("chunks", lambda c: c["thrifty_neuzip_vocab"]["matrices"]["model.embed_tokens.weight"]
                          .update(chunks=99))]:
        bad = tmp_path / name
        bad.mkdir()
        (bad / "neuzip.safetensors").write_bytes((path / "neuzip.safetensors").read_bytes())
        edited = copy.deepcopy(config)
        change(edited)
        (bad / "config.json").write_text(json.dumps(edited))
        with pytest.raises(ValueError, match="vocab"):
            load_compressed(bad)


def test_transformers_llama_generates_with_coded_vocab():
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    cfg = HFConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    hf = HFLlama(cfg).to(torch.bfloat16).eval()
    x = torch.randint(0, 120, (1, 5))
    coded = compress_model(copy.deepcopy(hf), config=NeuZipConfig(vocab=True))
    assert set(coded.neuzip.vocab) == {"model.embed_tokens", "lm_head"}
    assert torch.equal(coded.generate(x, max_new_tokens=6, do_sample=False),
                       hf.generate(x, max_new_tokens=6, do_sample=False))


def test_block_kernel_runs_the_chunks_under_the_interpreter(monkeypatch):
    """impl="triton" on the CPU (interpreter): the chunks decode through the block kernel (asserted by its launch
    counter) and the logits stay bit-identical."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    base = tiny(hidden=16, layers=1)
    model = compress_model(copy.deepcopy(base), config=NeuZipConfig(vocab=True, impl="triton"))
    vocab = model.neuzip.vocab["model.embed_tokens"]
    x = ids(3, b=1, t=5)
    with torch.no_grad():
        assert torch.equal(model(x, logits_to_keep=1), base(x, logits_to_keep=1))
    assert all(p.launches == 2 for p in vocab.packs)  # once for the lookup, once for the head


@pytest.mark.cuda
def test_cuda_coded_vocab_logits_and_launches():
    with torch.device("cuda"):
        base = tiny(hidden=256, layers=2)
    model = compress_model(copy.deepcopy(base), config=NeuZipConfig(mode="lossy", mantissa_bits=3, vocab=True))
    spec = compress_model(rounded(base, 3), "lossy", 3)
    x = ids(4).cuda()
    with torch.no_grad():
        assert torch.equal(model(x), spec(x))
    vocab = model.neuzip.vocab["model.embed_tokens"]
    assert all(p.launches == 2 for p in vocab.packs)
