"""Every pair of techniques that ``thrifty.optimize`` allows, together on one tiny model (a transformers Llama and
thrifty's reference model, CPU): both stay on, and each technique's outputs match its own reference, measured on
the paired model. Refused pairs raise with the reason.

The six techniques: BitNet (b1.58), NeuZip (lossless), cut cross-entropy, quantized attention, ShadowKV and the
int8 KV cache. Refused: BitNet with NeuZip (see ``thrifty.compose.config``); ShadowKV with the int8 cache cannot
even be written (``kv_cache`` holds one cache). That leaves 13 pairs on the transformers Llama and the same 13 on
the reference model (the int8 cache: a transformers Cache on the one, a ``thrifty.kv.QuantizedKVCache`` on the
other).

Each technique's reference, and the tolerance it is held to:

* BitNet: every BitLinear's output equals ``bitnet.reference.bitlinear_reference`` on the same input (1e-5);
* NeuZip lossless: every CompressedLinear's output equals ``F.linear`` with the original weight, bit for bit;
* CCE: the loss equals cross-entropy over the materialised logits of the same model (1e-5);
* quantized attention: every call is within ``ATTN_COS`` cosine similarity of exact attention on the same inputs,
  and the model's logits are bit-equal to the other technique alone with ``enable_hf`` put on by hand;
* ShadowKV at full budget and rank: the greedy tokens of ``generate`` are the dense cache's, and every step's
  logits are within ``SHADOWKV_ATOL`` of them;
* int8 KV cache: the greedy tokens are the dense cache's and every step's logits within ``INT8_ATOL``;
* and the forward logits are those of the technique(s) that change them alone (BitNet, quantized attention),
  whatever joins: the others change no forward logit (NeuZip is lossless, CCE only the loss, caches only
  ``generate``).
"""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

import thrifty
from thrifty import OptimizeConfig, ShadowKVConfig

VOCAB = 101
PROMPT_LEN = 40
NEW_TOKENS = 3
LAYERS = 2
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down
# full budget and full rank (2 KV heads x 16): ShadowKV then selects every token, so its decode is exact up to
# rounding; min_prompt_len below the prompt so the cache really compresses
EXACT_SHADOWKV = ShadowKVConfig(rank=32, chunk_size=4, sparse_budget=400, outlier_chunks=2, local_chunks=2,
                                min_prompt_len=20, max_generated=16)

ATTN_COS = 0.999  # quantized attention (INT8 Q·K, FP8 P·V) vs exact attention, per call (measured ~0.99998)
SHADOWKV_ATOL = 1e-4  # logits per decode step, ShadowKV at full budget/rank vs the dense cache (measured ~1e-6)
INT8_ATOL = 1e-2  # logits per decode step, int8 K/V vs the dense cache (measured <= 7e-3 with attention)
EXACT_ATOL = 1e-5  # what an exact technique may move a logit or a loss by (reassociation only)

SINGLE = {"bitnet": dict(bitnet="b1.58"), "neuzip": dict(neuzip="lossless"), "cce": dict(cce=True),
          "attention": dict(attention=True), "shadowkv": dict(kv_cache=EXACT_SHADOWKV), "int8": dict(kv_cache="int8")}
REFUSED = {("bitnet", "neuzip"): (ValueError, "bitnet, neuzip: cannot go together")}
UNWRITABLE = {("shadowkv", "int8")}  # one kv_cache field
CHANGES_LOGITS = ("bitnet", "attention")  # the others leave the forward's logits as they were
KV = ("shadowkv", "int8")

HF_PAIRS = [p for p in itertools.combinations(SINGLE, 2) if p not in REFUSED and p not in UNWRITABLE]
REFERENCE_PAIRS = HF_PAIRS  # the reference model's int8 cache is a QuantizedKVCache behind its own cache seam


def pair_config(pair) -> OptimizeConfig:
    return OptimizeConfig(**SINGLE[pair[0]], **SINGLE[pair[1]])


# ------------------------------------------------------------------------------------------------ models
def tiny_hf():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def tiny_reference():
    from thrifty.models import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).init_weights(seed=0).eval()


class HF:
    """What the checks need from a transformers causal LM."""

    kind = "transformers"

    @staticmethod
    def logits(model, ids):
        with torch.no_grad():
            return model(ids).logits.float()

    @staticmethod
    def loss_and_reference(model, ids):
        """(the model's training loss with labels, cross-entropy over the logits it materialises without them)."""
        model.train()
        try:
            out = model(ids, labels=ids)
            assert out.logits is None  # CCE: the loss came without logits
            logits = model(ids).logits.float()
        finally:
            model.eval()
        reference = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        return out.loss.detach(), reference.detach()

    @staticmethod
    def generate(model, ids, dense=False):
        """(greedy tokens, logits of every step); ``dense``: with transformers' own DynamicCache instead of the
        cache thrifty.optimize configured."""
        from transformers import DynamicCache

        extra = dict(past_key_values=DynamicCache()) if dense else {}
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                                 **extra)
        return out.sequences[:, ids.shape[1]:], torch.stack(out.scores).float()


class Reference:
    """The same for thrifty's reference LlamaForCausalLM."""

    kind = "reference"

    @staticmethod
    def logits(model, ids):
        with torch.no_grad():
            return model(ids).float()

    @staticmethod
    def loss_and_reference(model, ids):
        from thrifty.models.llama import logits_cross_entropy

        labels = ids.roll(-1, 1)
        with torch.no_grad():
            loss = model(ids, labels=labels)
            reference = logits_cross_entropy(model.model(ids, torch.arange(ids.shape[1])), model.lm_head.weight,
                                             labels)
        assert model.loss_fn is not logits_cross_entropy  # CCE is the model's loss
        return loss, reference

    @staticmethod
    def generate(model, ids, dense=False):
        """thrifty.models.generate's greedy loop, keeping every step's logits."""
        from thrifty.models.generate import CACHE_FACTORY_ATTR
        from thrifty.models.llama import KVCache

        cache = KVCache() if dense else model.__dict__[CACHE_FACTORY_ATTR]()
        tokens, scores = [], []
        with torch.no_grad():
            logits = model(ids, cache=cache, logits_to_keep=1)
            for _ in range(NEW_TOKENS):
                last = logits[:, -1].float()
                scores.append(last)
                tokens.append(last.argmax(-1, keepdim=True))
                logits = model(tokens[-1], cache=cache)
        return torch.cat(tokens, 1), torch.stack(scores)


KINDS = {"transformers": (HF, tiny_hf), "reference": (Reference, tiny_reference)}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models are tiny: a second thread only waits (on a busy 2-core box it made this file 8x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def bases():
    return {kind: make() for kind, (_, make) in KINDS.items()}


@pytest.fixture(scope="module")
def alone_logits(bases, ids):
    """Forward logits of each model with nothing, or with one technique that changes them, on it."""
    out = {}
    for kind, (api, _) in KINDS.items():
        out[kind, None] = api.logits(bases[kind], ids)
        for t in CHANGES_LOGITS:
            out[kind, t] = api.logits(thrifty.optimize(copy.deepcopy(bases[kind]), OptimizeConfig(**SINGLE[t])), ids)
    return out


def record_io(modules: dict, seen: dict) -> list:
    """Forward hooks keeping each module's first (input, output) in ``seen``; returns the hook handles."""
    def hook(name):
        def record(module, args, out):
            seen.setdefault(name, (args[0], out))  # returns None: the output is left as it is
        return record
    return [m.register_forward_hook(hook(n)) for n, m in modules.items()]


def named(model, cls_name):
    return {n: m for n, m in model.named_modules() if type(m).__name__ == cls_name}


# ------------------------------------------------------------------------------------ each technique's checks
def check_bitnet(api, model, base, ids):
    from thrifty.bitnet.reference import bitlinear_reference

    layers = named(model, "BitLinear")
    assert len(layers) == LINEARS_PER_LAYER * LAYERS and named(model, "RampedReLUSquared")
    seen = {}
    hooks = record_io(layers, seen)
    try:
        for m in layers.values():
            m.last_path = None
        api.logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    assert seen.keys() == layers.keys() and all(m.last_path for m in layers.values())  # every one ran
    for n, (x, out) in seen.items():
        m = layers[n]
        expected = bitlinear_reference(
            x, m.weight, activation=m.activation, bias=m.bias, norm_weight=m.norm.weight if m.norm else None,
            norm_eps=m.norm.eps if m.norm else 1e-5, weight_splits=m.weight_splits, beta_scale=m.beta_scale,
            topk_ratio=m.topk_ratio)
        torch.testing.assert_close(out, expected, atol=EXACT_ATOL, rtol=0, msg=lambda s, n=n: f"{n}: {s}")


def check_neuzip(api, model, base, ids):
    layers = named(model, "CompressedLinear")
    assert len(layers) == LINEARS_PER_LAYER * LAYERS
    original = dict(base.named_modules())
    seen = {}
    hooks = record_io(layers, seen)
    runs = model.neuzip.stats["block_runs"]
    try:
        api.logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    assert seen.keys() == layers.keys() and model.neuzip.stats["block_runs"] > runs  # decoded while running
    for n, (x, out) in seen.items():
        linear = original[n]
        assert isinstance(linear, torch.nn.Linear), n
        assert torch.equal(out, F.linear(x, linear.weight, linear.bias)), f"{n}: not the original weight's output"


def check_cce(api, model, base, ids):
    loss, reference = api.loss_and_reference(model, ids)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, reference, atol=EXACT_ATOL, rtol=0)


def check_attention(api, model, base, ids, monkeypatch):
    from thrifty.attention import accuracy_metrics, exact_attention

    if api.kind == "transformers":
        import thrifty.attention.hf as where
        from thrifty.attention.hf import OPTIONS_ATTR
        from thrifty.compose.dispatch import attention_calls

        assert model.config._attn_implementation == "thrifty"
        assert all(OPTIONS_ATTR in layer.self_attn.__dict__ for layer in model.model.layers)
    else:
        import thrifty.attention.seam as where

        for layer in model.model.layers:  # a sage seam (or a ShadowKV cache's dispatch wrapping one)
            fn = getattr(layer.self_attn.attention, "inner", layer.self_attn.attention)
            assert fn.options["config"].qk_bits == 8, fn
    real, calls = where.sage_attention, []

    def spy(q, k, v, **kw):
        out = real(q, k, v, **kw)
        calls.append((q, k, v, kw["causal"], kw["sm_scale"], out))
        return out

    monkeypatch.setattr(where, "sage_attention", spy)
    before = attention_calls(model).get("quantized", 0) if api.kind == "transformers" else 0
    api.logits(model, ids)
    assert len(calls) == LAYERS  # every layer ran quantized attention
    if api.kind == "transformers":
        assert attention_calls(model)["quantized"] == before + LAYERS
    for q, k, v, causal, scale, out in calls:
        cos = accuracy_metrics(out, exact_attention(q, k, v, causal=causal, sm_scale=scale))["cos_sim"]
        assert cos >= ATTN_COS, cos


def check_kv(api, model, base, ids, name):
    from thrifty.compose.apply import CACHE_ATTR

    tokens, scores = api.generate(model, ids)
    cache = model.__dict__[CACHE_ATTR]
    if name == "shadowkv":
        assert type(cache).__name__.endswith("ShadowKVCache") and cache.dense is False
        assert cache.engine.stats["reference_steps"] > 0  # its decode ran (CPU: the reference path)
        atol = SHADOWKV_ATOL
    elif api.kind == "transformers":
        layer = cache.layers[0]
        assert type(layer).__name__ == "QuantizedKVLayer" and layer.kv.length == PROMPT_LEN + NEW_TOKENS - 1
        atol = INT8_ATOL
    else:  # the reference model's generate feeds its last token back too
        assert type(cache).__name__ == "QuantizedKVCache" and len(cache) == PROMPT_LEN + NEW_TOKENS
        atol = INT8_ATOL
    dense_tokens, dense_scores = api.generate(model, ids, dense=True)
    assert torch.equal(tokens, dense_tokens)
    torch.testing.assert_close(scores, dense_scores, atol=atol, rtol=0)
    return scores


def check_logits(api, model, pair, bases, ids, alone_logits):
    """The forward logits are those of the techniques in the pair that change them, alone (or by hand)."""
    changing = [t for t in pair if t in CHANGES_LOGITS]
    logits = api.logits(model, ids)
    if len(changing) < 2:
        expected = alone_logits[api.kind, changing[0] if changing else None]
        torch.testing.assert_close(logits, expected, atol=EXACT_ATOL, rtol=0)
        if "neuzip" in pair and not changing:
            assert torch.equal(logits, expected)  # lossless: the same weights, the same bits
    else:  # BitNet and quantized attention: optimize gives the bits of composing them by hand
        by_hand = thrifty.optimize(copy.deepcopy(bases[api.kind]), OptimizeConfig(bitnet="b1.58"))
        if api.kind == "transformers":
            from thrifty.attention import SageConfig, enable_hf

            enable_hf(by_hand, config=SageConfig(qk_bits=8, pv="fp8"))
        else:
            from thrifty.attention import SageConfig, sage_seam

            for layer in by_hand.model.layers:
                layer.self_attn.attention = sage_seam(config=SageConfig(qk_bits=8, pv="fp8"))
        assert torch.equal(logits, api.logits(by_hand, ids))
    if "attention" in pair:  # quantized: close to the logits without it, not equal
        other = alone_logits[api.kind, "bitnet" if "bitnet" in pair else None]
        assert not torch.equal(logits, other)
        assert (logits - other).abs().max() < 0.05 * other.abs().max()


def run_pair(kind, pair, bases, ids, alone_logits, monkeypatch):
    api, _ = KINDS[kind]
    base = bases[kind]
    model = thrifty.optimize(copy.deepcopy(base), pair_config(pair))
    assert model.thrifty_config.techniques == pair_config(pair).techniques
    check_logits(api, model, pair, bases, ids, alone_logits)
    for t in pair:
        if t == "bitnet":
            check_bitnet(api, model, base, ids)
        elif t == "neuzip":
            check_neuzip(api, model, base, ids)
        elif t == "cce":
            check_cce(api, model, base, ids)
        elif t == "attention":
            check_attention(api, model, base, ids, monkeypatch)
    kv = [t for t in pair if t in KV]
    if kv:
        calls_before = _calls(model)
        check_kv(api, model, base, ids, kv[0])
        if "attention" in pair and kind == "transformers":
            # the prompt of a generate ran quantized attention, and a later forward still does
            assert _calls(model).get("quantized", 0) > calls_before.get("quantized", 0)
            assert model.config._attn_implementation == "thrifty"
        if "attention" in pair:
            check_attention(api, model, base, ids, monkeypatch)
    for t in ("bitnet", "neuzip"):  # the weights' technique is still on after everything ran
        if t in pair:
            assert named(model, "BitLinear" if t == "bitnet" else "CompressedLinear")
    thrifty.undo(model)
    assert torch.equal(api.logits(model, ids), alone_logits[kind, None])
    if kind == "reference":  # the attention functions themselves, not wrappers of them
        assert [layer.self_attn.attention for layer in model.model.layers] == \
            [layer.self_attn.attention for layer in base.model.layers]


def _calls(model):
    from thrifty.compose.dispatch import attention_calls

    return attention_calls(model)


@pytest.mark.parametrize("pair", HF_PAIRS, ids="+".join)
def test_pair_on_a_transformers_llama(pair, bases, ids, alone_logits, monkeypatch):
    run_pair("transformers", pair, bases, ids, alone_logits, monkeypatch)


@pytest.mark.parametrize("pair", REFERENCE_PAIRS, ids="+".join)
def test_pair_on_the_reference_model(pair, bases, ids, alone_logits, monkeypatch):
    run_pair("reference", pair, bases, ids, alone_logits, monkeypatch)


def test_the_pairs_are_every_pair():
    assert len(HF_PAIRS) == 13 and len(REFERENCE_PAIRS) == 13
    written = {tuple(sorted(p)) for p in HF_PAIRS} | {tuple(sorted(p)) for p in REFUSED} | \
        {tuple(sorted(p)) for p in UNWRITABLE}
    assert written == {tuple(sorted(p)) for p in itertools.combinations(SINGLE, 2)}


# ------------------------------------------------------------------------------------------------ refused
@pytest.mark.parametrize("pair", sorted(REFUSED), ids="+".join)
def test_refused_pairs_raise_with_the_reason(pair, bases):
    error, match = REFUSED[pair]
    with pytest.raises(error, match=match):
        pair_config(pair)
    model = copy.deepcopy(bases["transformers"])
    with pytest.raises(error, match=match):
        thrifty.optimize(model, OptimizeConfig(**SINGLE[pair[0]], **SINGLE[pair[1]]))
    assert not {"thrifty_config", "_thrifty_undo"} & set(model.__dict__)


def test_two_caches_cannot_be_asked_for():
    with pytest.raises(TypeError, match="kv_cache: expected None, a ShadowKVConfig, a LowBitKVConfig"):
        OptimizeConfig(kv_cache=("shadowkv", "int8"))


# ----------------------------------------------------------------------------------- skipped layers and caches
@pytest.mark.parametrize("kv", KV)
def test_a_skipped_layer_decodes_over_the_whole_cache(kv, bases, ids):
    """With quantized attention skipping a layer, that layer's decode steps run exact SDPA over every cached
    token: the int8 cache hands it its dequantized K/V (the dispatcher once gave SDPA the new token only)."""
    model = thrifty.optimize(copy.deepcopy(bases["transformers"]),
                             OptimizeConfig(attention=True, skip_layers=(0,), **SINGLE[kv]))
    check_kv(HF, model, bases["transformers"], ids, kv)
    calls = _calls(model)
    assert calls.get("quantized", 0) > 0 and calls.get("sdpa" if kv == "int8" else "shadowkv", 0) > 0


def test_a_skipped_layer_of_the_reference_model_decodes_over_the_whole_int8_cache(bases, ids):
    """On the reference model the sage seams read the int8 codes in decode; with a layer skipped the cache hands
    every layer its dequantized K/V instead, so the skipped layer's exact attention sees every cached token."""
    from thrifty.compose.apply import CACHE_ATTR

    model = thrifty.optimize(copy.deepcopy(bases["reference"]),
                             OptimizeConfig(attention=True, skip_layers=(0,), **SINGLE["int8"]))
    check_kv(Reference, model, bases["reference"], ids, "int8")
    assert model.__dict__[CACHE_ATTR].reads_codes is False
