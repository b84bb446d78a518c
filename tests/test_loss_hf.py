"""thrifty.loss.hf: a patched HF Llama gives the stock loss and gradients without logits; and the filtered
kernels on the real SmolLM2's hidden states and classifier, against float64."""

import pytest
import torch

from thrifty.triton_utils import interpreting

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from thrifty.loss import CCEKernelConfig, linear_cross_entropy  # noqa: E402
from thrifty.loss.hf import patch_causal_lm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ["reference"] + (["triton"] if interpreting() or torch.cuda.is_available() else [])


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=301, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).to(DEVICE).float().train()


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("use_num_items", [False, True])
def test_patched_llama_matches_stock_loss_and_grads(impl, use_num_items):
    stock, patched = tiny_llama(), tiny_llama()
    patch_causal_lm(patched, impl=impl)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 301, (3, 17), generator=g).to(DEVICE)
    labels = ids.clone()
    labels[0, :5] = -100  # a masked prompt
    kw = dict(num_items_in_batch=torch.tensor(40)) if use_num_items else {}
    out_stock = stock(input_ids=ids, labels=labels, **kw)
    out_patched = patched(input_ids=ids, labels=labels, **kw)
    assert out_patched.logits is None and out_stock.logits is not None
    torch.testing.assert_close(out_patched.loss, out_stock.loss.float(), rtol=1e-5, atol=1e-6)
    out_stock.loss.backward()
    out_patched.loss.backward()
    gs, gp = grads(stock), grads(patched)
    assert gs.keys() == gp.keys()
    for name in gs:
        torch.testing.assert_close(gp[name], gs[name], rtol=1e-4, atol=1e-6, msg=name)


def test_patched_llama_eval_and_skip_logits_false_behave_like_stock():
    stock, patched = tiny_llama(), tiny_llama()
    patch_causal_lm(patched)
    ids = torch.randint(0, 301, (2, 9)).to(DEVICE)
    for m in (stock, patched):
        m.eval()
    with torch.no_grad():
        a, b = stock(input_ids=ids, labels=ids), patched(input_ids=ids, labels=ids)
    torch.testing.assert_close(b.logits, a.logits)
    torch.testing.assert_close(b.loss, a.loss)
    patched.train()
    assert patched(input_ids=ids, labels=ids, skip_logits=False).logits is not None
    with pytest.raises(ValueError, match="skip_logits"):
        patched(input_ids=ids, skip_logits=True)


def test_patching_twice_replaces_the_options_and_keeps_the_logits_path():
    stock, patched = tiny_llama(), tiny_llama()
    patch_causal_lm(patched, z_loss=1e-3)
    patch_causal_lm(patched)  # the second call's options win; the stock forward is still the original one
    ids = torch.randint(0, 301, (2, 9)).to(DEVICE)
    out = patched(input_ids=ids, labels=ids, skip_logits=False)
    assert out.logits is not None
    torch.testing.assert_close(out.logits, stock(input_ids=ids, labels=ids).logits)
    skipped = patched(input_ids=ids, labels=ids)
    assert skipped.logits is None
    torch.testing.assert_close(skipped.loss, stock(input_ids=ids, labels=ids).loss.float(), rtol=1e-5, atol=1e-6)


def test_patch_takes_a_kernel_config_and_refuses_loose_kernel_options():
    stock, patched = tiny_llama(), tiny_llama()
    with pytest.raises(TypeError, match="filter_eps.*CCEKernelConfig"):
        patch_causal_lm(patched, filter_eps="auto")
    with pytest.raises(TypeError, match="config"):  # at patch time, not at the first training step
        patch_causal_lm(patched, config={"scratch_in_dc": False})
    patch_causal_lm(patched, impl=IMPLS[-1], config=CCEKernelConfig(scratch_in_dc=False))
    ids = torch.randint(0, 301, (2, 9)).to(DEVICE)
    torch.testing.assert_close(patched(input_ids=ids, labels=ids).loss,
                               stock(input_ids=ids, labels=ids).loss.float(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- real model, real text

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a screw press adapted from winemaking. Within a few decades, "
        "printing shops had opened in most large European cities, and the price of books fell sharply. Scholars "
        "could compare identical copies of a text, which changed how knowledge was checked and shared. Pamphlets "
        "spread news and arguments quickly, and literacy rose as reading material became cheaper and more common.")


@pytest.fixture(scope="module")
def smollm2_hidden():
    pretrained = pytest.importorskip("thrifty.pretrained")
    try:
        path = pretrained.ensure_converted(progress=False)
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 weights unavailable: {err}")
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = tok(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    h = out.hidden_states[-1][0]
    # in HF Llama the last hidden_states entry is after the final norm: lm_head(h) are the logits
    torch.testing.assert_close(model.lm_head(h), out.logits[0], rtol=1e-4, atol=1e-3)
    return h, model.lm_head.weight.detach(), ids[0]


@pytest.mark.skipif(not (interpreting() or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1")
def test_filtered_kernels_on_real_smollm2_hidden_states(smollm2_hidden, monkeypatch):
    h, w, ids = smollm2_hidden
    e = h.bfloat16().to(DEVICE).requires_grad_()
    c = w.bfloat16().to(DEVICE).requires_grad_()
    t = ids.to(DEVICE)
    if not torch.cuda.is_available():
        # big blocks under the interpreter, whose cost is per block operation, not per element: the fused
        # forward with 128 x 1024 tiles, the backward with 128 x 512, cuBLAS GEMMs for every chunk (filtered
        # tiles are zeros there too; the sparse GEMMs: test_loss.py)
        from thrifty.loss import backward, cce, forward

        monkeypatch.setattr(cce, "_gemm_forward_scratch", lambda c_, nv: None)
        monkeypatch.setattr(forward, "forward_config", lambda interp: dict(
            BLOCK_N=128, BLOCK_V=1024, BLOCK_D=64, num_warps=4, num_stages=1))
        monkeypatch.setattr(backward, "backward_config", lambda interp: dict(
            BLOCK_N=128, BLOCK_V=512, BLOCK_D_TILE=64, BLOCK_D_DC=64, BLOCK_D_DE=64, num_warps=4, num_stages=1))
        monkeypatch.setattr(backward, "DENSE_ABOVE", 0.0)
    loss = linear_cross_entropy(e, c, t, shift=True, impl="triton", config=CCEKernelConfig(filter_eps="auto"))
    loss.backward()
    e64 = e.detach().double().requires_grad_()
    c64 = c.detach().double().requires_grad_()
    ref = linear_cross_entropy(e64, c64, t, shift=True, impl="reference")
    ref.backward()
    assert 1.0 < ref.item() < 6.0  # a real model on real English text
    assert abs(loss.item() - ref.item()) / ref.item() <= 1e-3
    cos = torch.nn.functional.cosine_similarity
    assert cos(e.grad.double().flatten(), e64.grad.flatten(), dim=0) >= 0.999
    assert cos(c.grad.double().flatten(), c64.grad.flatten(), dim=0) >= 0.999
