"""``thrifty demo``: the five techniques on the real SmolLM2 and the real corpus, each measured against the plain
model in the same run, through :func:`thrifty.optimize` only. One table at the end, its header naming the commit;
plots and JSON in ``--out`` (the JSON also records the thrifty and torch versions and the UTC date).

The stages:

1. **train** a small Llama from scratch (SmolLM2's vocabulary) twice on the same batches: plain, and with the
   ``"train-bitnet"`` preset (BitNet a4.8 + cut cross-entropy). A pretrained model cannot be converted to BitNet
   without retraining (thrifty.bitnet.convert says why), so the BitNet model learns here from scratch.
   **bitnet-packed**: that trained BitNet model served with the ``"serve-bitnet"`` preset (its BitLinears packed
   2-bit, q/k/v and gate/up stacked) against itself unpacked (``thrifty.undo`` gives the BitLinears back): weight
   bytes, validation loss on the same rows, greedy tokens and decode speed.
2. **cce**: one training step of SmolLM2 with and without cut cross-entropy (same loss; no logits).
3. **neuzip**: the plain model trained in stage 1, in bf16, lossless-compressed (same outputs, fewer weight bytes). The
   BitNet model is not compressed: thrifty.optimize refuses BitNet with NeuZip and says why.
4. **attention**: SmolLM2's validation loss with quantized attention against exact attention, on rows long
   enough (on a GPU: 4 x 8192 tokens) that the quantized path runs; the stage fails if it did not
   (``thrifty.attention.hf.routes``).
5. **serve**: SmolLM2 generating from a long prompt with quantized attention + ShadowKV (``"serve-long-context"``)
   against a plain KV cache: cache bytes on the device, decode speed, agreement of the greedy tokens, and in how
   many layers the prompt went through the quantized path (on a GPU a one-sequence 8000-token SmolLM2 prompt is
   too little work per call: transformers' SDPA takes it).

Sizes: the whole SmolLM2 at short lengths on the CPU (a minute or two on 2 cores), longer ones on a GPU.
``--quick`` (tests) keeps only SmolLM2's first two decoder layers: real weights, but a model whose losses mean
little; its figures still compare each technique with the same truncated model.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class DemoSize:
    smol_layers: Optional[int]  # SmolLM2 decoder layers kept (None: all 30)
    seq_len: int  # tokens per training / evaluation row
    batch: int
    train_steps: int
    prompt_len: int  # the long prompt of the serving stage
    new_tokens: int
    tiny_hidden: int  # width of the model trained from scratch
    # the attention stage's evaluation rows (batch, tokens): on CUDA, long enough that transformers' calls carry
    # the work the quantized path needs (attention.routing.HF_MIN_PREFILL_WORK; shorter ones take SDPA)
    attention_rows: tuple = (2, 128)


SIZES = {
    "quick": DemoSize(smol_layers=2, seq_len=64, batch=2, train_steps=4, prompt_len=192, new_tokens=4, tiny_hidden=64,
                      attention_rows=(2, 64)),
    "cpu": DemoSize(smol_layers=None, seq_len=128, batch=2, train_steps=30, prompt_len=512, new_tokens=8,
                    tiny_hidden=128, attention_rows=(2, 128)),
    "gpu": DemoSize(smol_layers=None, seq_len=1024, batch=8, train_steps=300, prompt_len=8000, new_tokens=64,
                    tiny_hidden=512, attention_rows=(4, 8192)),
}


# ------------------------------------------------------------------------------------------- measuring
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable, device: torch.device):
    """(result, seconds, peak bytes allocated during fn — GPU only, None on the CPU)."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        start_bytes = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    result = fn()
    _sync(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) - start_bytes if device.type == "cuda" else None
    return result, seconds, peak


def _mb(n_bytes) -> str:
    if n_bytes is None:
        return "-"
    return f"{n_bytes / 2**10:,.0f} KB" if n_bytes < 2**20 else f"{n_bytes / 2**20:,.1f} MB"


@dataclass
class DemoRun:
    """What every stage reads (and ``results``, what earlier stages left for later ones)."""

    smol: torch.nn.Module
    train: object
    val: object
    size: DemoSize
    device: torch.device
    results: dict


def require(condition: bool, message: str) -> None:
    """The table must be true: a technique whose path did not run is an error, not a row."""
    if not condition:
        raise RuntimeError(f"thrifty demo: {message}")


def row(technique: str, what: str, memory: str, speed: str, quality: str, **figures) -> dict:
    return dict(technique=technique, what=what, memory=memory, speed=speed, quality=quality, figures=figures)


# ------------------------------------------------------------------------------------------- models
def load_smollm2(size: DemoSize, device: torch.device):
    """SmolLM2-135M from the converted checkpoint, its first ``size.smol_layers`` decoder layers kept."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from . import pretrained

    path = pretrained.ensure_converted(progress=False)
    config = AutoConfig.from_pretrained(path)
    if size.smol_layers is not None:
        config.num_hidden_layers = size.smol_layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[: size.smol_layers]
    from transformers.utils import logging

    logging.set_verbosity_error()  # the dropped layers' weights are "unused": expected here
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)
    return model.to(device).eval()


def tiny_llama(size: DemoSize, device: torch.device, seed: int = 0):
    """A small Llama for training from scratch, with SmolLM2's vocabulary (the corpus's tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    heads = max(2, size.tiny_hidden // 64)
    config = LlamaConfig(vocab_size=49152, hidden_size=size.tiny_hidden, intermediate_size=3 * size.tiny_hidden,
                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=4 * size.seq_len, tie_word_embeddings=True)
    return LlamaForCausalLM(config).to(device)


def validation_loss(model, val, size: DemoSize, device, batches: int = 2) -> float:
    losses = []
    model.eval()
    with torch.no_grad():
        for x, _ in val.iter_eval_batches(size.batch, size.seq_len, batches, device=device):
            losses.append(float(model(x, labels=x).loss))
    return sum(losses) / len(losses)


# ------------------------------------------------------------------------------------------- stages
def stage_train(run: DemoRun) -> list:
    """Plain vs "train-bitnet" (a4.8 + CCE), from scratch on the same batches."""
    import thrifty

    train, val, size, device, results = run.train, run.val, run.size, run.device, run.results
    runs = {}
    for name in ("plain", "bitnet a4.8 + cce"):
        model = tiny_llama(size, device)
        if name != "plain":
            thrifty.optimize(model, "train-bitnet")
        curve, seconds = train_steps(model, train, size, device)
        runs[name] = dict(model=model, curve=curve, seconds=seconds, val=validation_loss(model, val, size, device))
    results["curves"] = {name: r["curve"] for name, r in runs.items()}
    results["trained_plain"] = runs["plain"]["model"]
    results["trained_bitnet"] = runs["bitnet a4.8 + cce"]["model"]
    plain, bit = runs["plain"], runs["bitnet a4.8 + cce"]
    tokens = size.train_steps * size.batch * size.seq_len
    linears = [m for m in bit["model"].modules() if type(m).__name__ == "BitLinear"]
    latent = sum(m.weight.numel() for m in linears)
    return [row("bitnet", f"train {size.train_steps} steps from scratch (a4.8, with cce)",
                f"{_mb(latent * 4)} of fp32 latent linear weights (served packed: next row)",
                f"{tokens / bit['seconds']:,.0f} vs {tokens / plain['seconds']:,.0f} tokens/s",
                f"val loss {bit['val']:.3f} vs {plain['val']:.3f}",
                val_loss=bit["val"], val_loss_plain=plain["val"], tokens_per_s=tokens / bit["seconds"],
                tokens_per_s_plain=tokens / plain["seconds"], linear_params=latent)]


def stage_bitnet_packed(run: DemoRun) -> list:
    """The BitNet model trained in stage 1 served packed ("serve-bitnet") against itself unpacked."""
    import thrifty

    model, val, size, device = run.results["trained_bitnet"], run.val, run.size, run.device
    prompt, _ = val.batch(1, size.seq_len, seed=3, device=device)
    figures = {}
    for name in ("packed", "unpacked"):
        if name == "packed":
            thrifty.optimize(model, "serve-bitnet")  # ends training: the CCE of "train-bitnet" comes off
        else:
            thrifty.undo(model)  # the trained BitLinears again, bit for bit
        loss = validation_loss(model, val, size, device)
        tokens, seconds, _ = measure(lambda: greedy_tokens(model, prompt, size.new_tokens), device)
        figures[name] = dict(val=loss, tokens=tokens, seconds=seconds, linear=_linear_weight_bytes(model),
                             model=_state_bytes(model), layers=_layer_types(model))
    packed, unpacked = figures["packed"], figures["unpacked"]
    require(packed["layers"].get("PackedBitLinear", 0) > 0 and "BitLinear" not in packed["layers"],
            "serve-bitnet did not pack the BitLinear layers")
    require(unpacked["layers"].get("BitLinear", 0) > 0 and "PackedBitLinear" not in unpacked["layers"],
            "thrifty.undo did not give the BitLinear layers back")
    latent, bf16 = unpacked["linear"]
    agree = float((packed["tokens"] == unpacked["tokens"]).float().mean())
    steps = size.new_tokens
    return [row("bitnet-packed", f"the a4.8 model above served packed (\"serve-bitnet\"), {steps} greedy tokens",
                f"linear weights {_mb(packed['linear'][0])} vs {_mb(bf16)} bf16, {_mb(latent)} fp32 (2-bit, rows "
                "padded to 256)",
                f"{steps / packed['seconds']:.1f} vs {steps / unpacked['seconds']:.1f} tokens/s (with prefill)",
                f"val loss {packed['val']:.4f} vs {unpacked['val']:.4f} unpacked; {agree:.0%} of greedy tokens",
                val_loss=packed["val"], val_loss_unpacked=unpacked["val"], linear_bytes_packed=packed["linear"][0],
                linear_bytes_latent=latent, linear_bytes_bf16=bf16, model_bytes_packed=packed["model"],
                model_bytes_unpacked=unpacked["model"], tokens_per_s=steps / packed["seconds"],
                tokens_per_s_unpacked=steps / unpacked["seconds"], token_agreement=agree,
                packed_layers=packed["layers"].get("PackedBitLinear", 0))]


def greedy_tokens(model, prompt, new_tokens: int):
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)[0, prompt.shape[1]:]


def _layer_types(model) -> dict:
    """{class name: count} of the model's linear layers (nn.Linear, BitLinear, PackedBitLinear)."""
    counts: dict = {}
    for m in model.modules():
        name = type(m).__name__
        if name in ("Linear", "BitLinear", "PackedBitLinear"):
            counts[name] = counts.get(name, 0) + 1
    return counts


def _linear_weight_bytes(model) -> tuple:
    """(bytes of the BitNet layers' weights as stored now, the same weights' bytes in bf16): the latent weight of a
    BitLinear, the 2-bit codes and fp32 scales of a PackedBitLinear (the LM head and embeddings stay as they are)."""
    stored = bf16 = 0
    for m in model.modules():
        if type(m).__name__ == "BitLinear":
            stored += m.weight.numel() * m.weight.element_size()
            bf16 += m.weight.numel() * 2
        elif type(m).__name__ == "PackedBitLinear":
            stored += m.packed.numel() * m.packed.element_size() + m.alpha.numel() * m.alpha.element_size()
            bf16 += m.out_features * m.in_features * 2
    return stored, bf16


def _state_bytes(model) -> int:
    """Bytes of the model's parameters and buffers, each storage once (tied embeddings count once)."""
    seen = {(t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape)): t.numel() * t.element_size()
            for t in model.state_dict().values()}
    return sum(seen.values())


def train_steps(model, train, size, device):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)  # the same batches for every model
    curve = []

    def run():
        for _ in range(size.train_steps):
            x, _ = train.batch(size.batch, size.seq_len, generator=generator, device=device)
            loss = model(x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            curve.append(float(loss.detach()))

    _, seconds, _ = measure(run, device)
    return curve, seconds


def stage_cce(run: DemoRun) -> list:
    """One SmolLM2 training step (forward + backward) with and without cut cross-entropy."""
    import thrifty

    smol, size, device = run.smol, run.size, run.device
    x, _ = run.train.batch(size.batch, size.seq_len, seed=1, device=device)
    figures = {}
    for name in ("plain", "cce"):
        model = copy.deepcopy(smol)
        if name == "cce":
            thrifty.optimize(model, thrifty.OptimizeConfig(cce=True))
        model.train()

        def step():
            out = model(x, labels=x)
            out.loss.backward()
            return float(out.loss), out.logits is None

        (loss, no_logits), seconds, peak = measure(step, device)
        figures[name] = dict(loss=loss, seconds=seconds, peak=peak, no_logits=no_logits)
    logits_bytes = x.numel() * smol.config.vocab_size * 4
    memory = (f"peak {_mb(figures['cce']['peak'])} vs {_mb(figures['plain']['peak'])}" if device.type == "cuda"
              else f"{_mb(logits_bytes)} of fp32 logits not made")
    cce, plain = figures["cce"], figures["plain"]
    require(cce["no_logits"], "cut cross-entropy did not run (the step returned logits)")
    return [row("cce", f"SmolLM2 train step, {x.shape[0]}x{x.shape[1]} tokens", memory,
                f"{cce['seconds']:.2f} s vs {plain['seconds']:.2f} s",
                f"loss {cce['loss']:.4f} vs {plain['loss']:.4f}",
                loss=cce["loss"], loss_plain=plain["loss"], seconds=cce["seconds"], seconds_plain=plain["seconds"],
                peak_bytes=cce["peak"], peak_bytes_plain=plain["peak"], logits_bytes_avoided=logits_bytes)]


def stage_neuzip(run: DemoRun) -> list:
    """The plain model trained in stage 1, lossless NeuZip: the same validation loss from fewer weight bytes."""
    import thrifty

    val, size, device = run.val, run.size, run.device
    # in bf16, the dtype NeuZip is built for: its exponents are what entropy coding saves (fp32 mantissas are noise)
    plain = copy.deepcopy(run.results["trained_plain"]).to(torch.bfloat16)
    model = copy.deepcopy(plain)
    base_loss, base_seconds, _ = measure(lambda: validation_loss(plain, val, size, device), device)
    thrifty.optimize(model, thrifty.OptimizeConfig(neuzip="lossless"))
    loss, seconds, _ = measure(lambda: validation_loss(model, val, size, device), device)
    mem = model.neuzip.memory()
    require(model.neuzip.stats["block_runs"] > 0 and loss == base_loss, "lossless NeuZip did not run or changed the loss")
    return [row("neuzip", "lossless, the model trained above in bf16 (block weights)",
                f"{_mb(mem['original_bytes'])} -> {_mb(mem['compressed_bytes'])} (x{mem['ratio_vs_original']:.3f})",
                f"eval {seconds:.2f} s vs {base_seconds:.2f} s", f"val loss {loss:.4f} vs {base_loss:.4f} (exact)",
                compressed_bytes=mem["compressed_bytes"], original_bytes=mem["original_bytes"],
                val_loss=loss, val_loss_plain=base_loss, seconds=seconds, seconds_plain=base_seconds)]


def stage_attention(run: DemoRun) -> list:
    """SmolLM2's validation loss with quantized attention against exact attention."""
    import thrifty
    from .attention.hf import routes

    smol, val, device = run.smol, run.val, run.device
    batch, tokens = run.size.attention_rows
    size = dataclasses.replace(run.size, batch=batch, seq_len=tokens)
    model = copy.deepcopy(smol)
    base_loss, base_seconds, _ = measure(lambda: validation_loss(smol, val, size, device), device)
    thrifty.optimize(model, thrifty.OptimizeConfig(attention=True))
    loss, seconds, _ = measure(lambda: validation_loss(model, val, size, device), device)
    calls = routes(model).get("sage", 0)
    require(calls > 0, "quantized attention did not run (every call took another route: "
                       f"{routes(model)})")
    return [row("attention", f"SmolLM2 eval, {batch}x{tokens}-token rows, INT8 QK / FP8 PV", "-",
                f"{seconds:.2f} s vs {base_seconds:.2f} s", f"val loss {loss:.4f} vs {base_loss:.4f}",
                val_loss=loss, val_loss_plain=base_loss, seconds=seconds, seconds_plain=base_seconds,
                quantized_calls=calls)]


def stage_serve(run: DemoRun) -> list:
    """SmolLM2 generating after a long prompt: quantized attention + ShadowKV against a plain KV cache."""
    import thrifty
    from transformers import DynamicCache

    smol, size, device = run.smol, run.size, run.device
    prompt, _ = run.val.batch(1, size.prompt_len, seed=2, device=device)
    config = shadowkv_config(size)

    def greedy(model, cache):
        with torch.no_grad():
            return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=size.new_tokens,
                                  do_sample=False, past_key_values=cache, pad_token_id=0)[0, prompt.shape[1]:]

    dense_cache = DynamicCache(config=smol.config)
    base_tokens, base_seconds, _ = measure(lambda: greedy(smol, dense_cache), device)
    from .attention.hf import routes

    model = thrifty.optimize(copy.deepcopy(smol), thrifty.OptimizeConfig(attention=True, kv_cache=config))
    tokens, seconds, _ = measure(lambda: greedy(model, None), device)
    quantized_prefill = routes(model).get("sage", 0)  # SDPA where the prompt is too little work (HF_MIN_PREFILL_WORK)
    cache = model._thrifty_last_cache
    require(not cache.dense, "ShadowKV did not compress the prompt")
    device_bytes = sum(s.bytes_on_device_per_sequence() for s in cache.engine.states)
    dense_bytes = sum(k.numel() * k.element_size() * 2 for k in (layer.keys for layer in dense_cache.layers))
    agree = float((tokens == base_tokens).float().mean())
    steps = size.new_tokens
    layers = smol.config.num_hidden_layers
    return [row("shadowkv", f"SmolLM2 + ShadowKV (quantized prefill in {quantized_prefill} of {layers} layers), "
                f"{size.prompt_len}-token prompt, {steps} new tokens",
                f"KV on device {_mb(device_bytes)} vs {_mb(dense_bytes)} (+{_mb(cache.host_bytes_per_sequence())} "
                "host values)",
                f"{steps / seconds:.1f} vs {steps / base_seconds:.1f} tokens/s (with prefill)",
                f"{agree:.0%} of greedy tokens as plain",
                kv_device_bytes=device_bytes, kv_dense_bytes=dense_bytes, host_bytes=cache.host_bytes_per_sequence(),
                tokens_per_s=steps / seconds, tokens_per_s_plain=steps / base_seconds, token_agreement=agree,
                quantized_prefill_layers=quantized_prefill)]


def shadowkv_config(size: DemoSize):
    """ShadowKV scaled to the prompt: a budget of a quarter of it (the paper: 2048 of 64K+ tokens)."""
    from .kvcache import ShadowKVConfig

    chunk = 8
    budget = max(chunk, size.prompt_len // 4 // chunk * chunk)
    return ShadowKVConfig(rank=160, chunk_size=chunk, sparse_budget=budget, outlier_chunks=max(1, budget // 64),
                          local_chunks=4, min_prompt_len=size.prompt_len // 2, max_generated=size.new_tokens + 8)


# ------------------------------------------------------------------------------------------- the run
STAGES = (("bitnet + cce from scratch", stage_train), ("bitnet served packed", stage_bitnet_packed),
          ("cut cross-entropy", stage_cce), ("NeuZip", stage_neuzip),
          ("quantized attention", stage_attention), ("ShadowKV serving", stage_serve))


def run_demo(device: torch.device, size: DemoSize, out_dir: Path, *, corpus_dir=None, progress: bool = True) -> dict:
    """Runs every stage, writes ``demo.json``, ``loss_curves.png`` and ``memory.png`` to ``out_dir``; returns
    the report (``rows``: one per technique)."""
    from tqdm.auto import tqdm

    from .data import TokenDataset
    from .data.locate import corpus_path

    t0, made_by = time.perf_counter(), provenance()
    corpus = corpus_path(corpus_dir, reuse=True)
    run = DemoRun(smol=load_smollm2(size, device), train=TokenDataset(corpus, "train"),
                  val=TokenDataset(corpus, "validation"), size=size, device=device, results={})
    rows = []
    bar = tqdm(STAGES, desc="thrifty demo", disable=not progress)
    for label, stage in bar:
        bar.set_postfix_str(label)
        rows += stage(run)
    model = "SmolLM2-135M-Instruct (Q4_1 dequantized)"
    if size.smol_layers:
        model += f", first {size.smol_layers} of 30 layers"
    report = dict(**made_by, device=str(device), size=asdict(size), seconds=time.perf_counter() - t0, model=model,
                  rows=rows, loss_curves=run.results["curves"])
    write_outputs(report, out_dir)
    return report


def provenance() -> dict:
    """What makes a report: the commit (``$THRIFTY_COMMIT``, else the checkout's HEAD, None when neither), the
    thrifty and torch versions and the UTC date and time now (run_demo asks as it starts)."""
    from . import __version__
    from .bench import git_commit

    return dict(commit=git_commit(), thrifty=__version__, torch=torch.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def format_table(report: dict) -> str:
    columns = ("technique", "what", "memory", "speed", "quality")
    rows = [columns] + [tuple(r[c] for c in columns) for r in report["rows"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    head = (f"thrifty demo · {report['model']} · {report['device']} · {report['seconds']:.0f} s · "
            f"commit {report['commit'] or 'unknown'}")
    return "\n".join([head, "(each figure: with the technique vs the plain model, measured in this run)"] + lines)


def write_outputs(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "demo.json").write_text(json.dumps(report, indent=1))
    plot_loss_curves(report["loss_curves"], out_dir / "loss_curves.png")
    plot_memory(report["rows"], out_dir / "memory.png")


def plot_loss_curves(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats/token)")
    ax.set_title("training from scratch on the corpus")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


MEMORY_BARS = {  # technique: (figure with it, figure without it, label)
    "bitnet-packed": ("linear_bytes_packed", "linear_bytes_bf16", "linear weights vs bf16"),
    "neuzip": ("compressed_bytes", "original_bytes", "block weights"),
    "shadowkv": ("kv_device_bytes", "kv_dense_bytes", "KV cache on device"),
}


def plot_memory(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, plain, thrifty_ = [], [], []
    for r in rows:
        f = r["figures"]
        if r["technique"] in MEMORY_BARS:
            with_, without, label = MEMORY_BARS[r["technique"]]
            labels.append(f"{r['technique']}: {label}")
            plain.append(f[without])
            thrifty_.append(f[with_])
        elif r["technique"] == "cce":
            labels.append("cce: logits of a step")
            plain.append(f["logits_bytes_avoided"])
            thrifty_.append(0)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ratios = [t / p for t, p in zip(thrifty_, plain)]  # techniques differ by orders of magnitude in bytes
    bars = ax.barh(labels, ratios, color="tab:orange")
    for bar, t, p in zip(bars, thrifty_, plain):
        ax.text(bar.get_width() + 0.02, bar.get_y() + bar.get_height() / 2, f"{t / 2**20:.2f} of {p / 2**20:.2f} MB",
                va="center", fontsize=8)
    ax.axvline(1.0, color="tab:blue", linestyle="--", label="plain model")
    ax.set_xlim(0, 1.5)
    ax.set_xlabel("bytes with the technique / bytes of the plain model")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
