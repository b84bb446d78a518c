"""The 3- and 4-bit KV cache of BitNet a4.8 (``thrifty.kv.quantized``): memory, validation perplexity
and greedy output, on real weights and real text.

* ppl     teacher-forced validation perplexity of SmolLM2-135M (fp32, the reference model loaded from the
          converted Q4_1 GGUF) on the corpus validation split, every attention reading the quantized cache
          (``QuantizedKVCache``: a prompt attends to its own quantized K/V, exactly what token-by-token
          decoding over the cache computes); fp K/V vs 8, 4 and 3 bits, and 3 bits with the first token at 3
          bits too (the ablation of the paper's 4-bit BOS, by setting ``quantized.SINK_BITS`` to 3).
          transformers' own forward on the same windows checks that the reference model is SmolLM2.
* greedy  greedy continuations of validation prompts, quantized cache vs fp cache: the reference model's
          ``generate`` with ``QuantizedKVCache`` (every attention on the cache) and transformers'
          ``generate`` with ``thrifty_kv_cache`` (prompt on its fp K/V, decode steps on the cache).
          Agreement = share of generated tokens equal to the fp cache's at the same position; prefix = tokens
          before the first difference, over the tokens generated.
* memory  cache bytes per token (codes + per-token-per-head scales) vs bf16, for SmolLM2 and a Llama-7B
          shape (32 layers, 32 kv heads, head_dim 128), KV memory at 32K context; the bytes a filled cache
          holds (``QuantizedKV.nbytes``) checked against the formula.

    python benchmarks/bitnet_kv.py             # CPU: writes benchmarks/results/bitnet_kv_cpu.json
    python benchmarks/bitnet_kv.py --smoke     # tiny sizes, results to a temp folder
No model trained here is in data/ at the time of writing; the script measures one if ``--trained DIR`` (a HF
Llama folder) is given.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import tempfile
import time

import torch
import torch.nn.functional as F

from thrifty import bench
from thrifty.kv import QuantizedKVCache, quantized, thrifty_kv_cache
from thrifty.kv.quantized import bytes_per_token
from thrifty.models import LlamaForCausalLM
from thrifty.models.generate import generate
from thrifty.models.llama import KVCache

LLAMA_7B = dict(layers=32, kv_heads=32, head_dim=128)
MODES = {"fp": None, "kv8": 8, "kv4": 4, "kv3": 3, "kv3_nosink": 3}


@contextlib.contextmanager
def first_token_at(bits: int):
    """The ablation: the 3-bit mode without its 4-bit first token (``has_sink`` reads SINK_BITS)."""
    saved = quantized.SINK_BITS
    quantized.SINK_BITS = bits
    try:
        yield
    finally:
        quantized.SINK_BITS = saved


def cache_for(mode: str):
    return KVCache() if MODES[mode] is None else QuantizedKVCache(MODES[mode])


def mode_context(mode: str):
    return first_token_at(3) if mode == "kv3_nosink" else contextlib.nullcontext()


def perplexity(model, hf_model, windows, rows, summary, tag):
    ppl, held = {}, {}
    for mode in MODES:
        t, nll = time.perf_counter(), []
        with mode_context(mode), torch.no_grad():
            for x, y in windows:
                cache = cache_for(mode)
                logits = model(x, cache=cache).float()
                nll.append(F.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
                held[mode] = cache.nbytes() if MODES[mode] else None
        ppl[mode] = math.exp(sum(nll) / len(nll))
        rows.append(dict(section="ppl", model=tag, mode=mode, ppl=ppl[mode], delta_pct=100 * (ppl[mode] / ppl["fp"] - 1),
                         cache_bytes_one_window=held[mode], seconds=time.perf_counter() - t))
    if hf_model is not None:
        with torch.no_grad():
            nll = [F.cross_entropy(hf_model(x).logits.float().flatten(0, 1), y.flatten()).item() for x, y in windows]
        summary[f"ppl_transformers_fp_{tag}"] = math.exp(sum(nll) / len(nll))
    summary[f"ppl_fp_{tag}"] = ppl["fp"]
    for mode in MODES:
        if MODES[mode]:
            summary[f"{mode}_ppl_{tag}"] = ppl[mode]
            summary[f"{mode}_ppl_delta_pct_{tag}"] = 100 * (ppl[mode] / ppl["fp"] - 1)
    return held


def _agreement(out, ref, prompt_len):
    new, want = out[:, prompt_len:], ref[:, prompt_len:]
    same = new == want
    prefix = torch.where(~same, torch.arange(same.shape[1]), same.shape[1]).amin(1).float()
    return same.float().mean().item(), (prefix / same.shape[1]).mean().item()


def greedy(model, hf_model, prompts, n_new, rows, summary, tag):
    with torch.no_grad():
        ref = generate(model, prompts, n_new)
        hf_ref = hf_model.generate(prompts, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False) \
            if hf_model is not None else None
        for mode in MODES:
            if not MODES[mode]:
                continue
            with mode_context(mode):
                out = generate(model, prompts, n_new, cache_factory=lambda: cache_for(mode))
                agree, prefix = _agreement(out, ref, prompts.shape[1])
                rows.append(dict(section="greedy", model=tag, path="reference model", mode=mode, agreement=agree,
                                 prefix=prefix, prompts=prompts.shape[0], new_tokens=n_new))
                summary[f"greedy_agree_{mode}_{tag}"] = agree
                if hf_ref is not None and mode != "kv3_nosink":
                    hf_out = hf_model.generate(prompts, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                               past_key_values=thrifty_kv_cache(hf_model, bits=MODES[mode]))
                    agree, prefix = _agreement(hf_out, hf_ref, prompts.shape[1])
                    rows.append(dict(section="greedy", model=tag, path="transformers generate", mode=mode,
                                     agreement=agree, prefix=prefix, prompts=prompts.shape[0], new_tokens=n_new))
                    summary[f"greedy_agree_{mode}_hf_{tag}"] = agree


def memory(model_shape, held, window, rows, summary, name="smollm2"):
    shapes = {name: model_shape, "llama7b": LLAMA_7B}
    for shape_name, s in shapes.items():
        per_token_bf16 = 2 * s["layers"] * s["kv_heads"] * bytes_per_token(s["head_dim"], None)
        for bits in (None, 8, 4, 3):
            per_token = 2 * s["layers"] * s["kv_heads"] * bytes_per_token(s["head_dim"], bits)
            gib_32k = 32768 * per_token / 2 ** 30
            mode = "bf16" if bits is None else f"kv{bits}"
            rows.append(dict(section="memory", model=shape_name, mode=mode, bytes_per_token=per_token,
                             ratio_vs_bf16=per_token / per_token_bf16, gib_at_32k=gib_32k))
            summary[f"kv_bytes_per_token_{mode}_{shape_name}"] = per_token
            summary[f"kv_gib_32k_{mode}_{shape_name}"] = gib_32k
            if bits:
                summary[f"kv_bytes_ratio_vs_bf16_{mode}_{shape_name}"] = per_token / per_token_bf16
    s = model_shape
    for mode, bits in MODES.items():  # what a filled cache held, against the formula (+ the 3-bit first token)
        if bits and mode in held:
            formula = window * 2 * s["layers"] * s["kv_heads"] * bytes_per_token(s["head_dim"], bits)
            sink = 2 * s["layers"] * s["kv_heads"] * s["head_dim"] // 8 if mode == "kv3" else 0
            rows.append(dict(section="memory", model=f"{name} (filled cache)", mode=mode, held_bytes=held[mode],
                             formula_bytes=formula + sink, tokens=window))


def run_model(path, tag, args, rows, summary, with_hf=True):
    import transformers

    from thrifty.data import TokenDataset
    from thrifty.paths import data_dir

    model = LlamaForCausalLM.from_pretrained(path).eval()
    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                             attn_implementation="sdpa").eval() if with_hf else None
    cfg = model.config
    ds = TokenDataset(data_dir() / "corpus", "validation")
    windows = list(ds.iter_eval_batches(1, args.seq, max_batches=args.windows))
    held = perplexity(model, hf_model, windows, rows, summary, tag)
    prompts = torch.cat([x[:, :args.prompt] for x, _ in ds.iter_eval_batches(1, args.prompt * 4,
                                                                              max_batches=args.prompts)])
    greedy(model, hf_model, prompts, args.new_tokens, rows, summary, tag)
    return dict(layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim), held


def _trained_config(path):
    """The trained model's config.json (its size and, for BitNet, the recipe), recorded beside its figures."""
    if not path:
        return None
    import json
    from pathlib import Path

    return json.loads((Path(path) / "config.json").read_text())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, results to a temp folder")
    ap.add_argument("--windows", type=int, default=4, help="validation windows for perplexity")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per window")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--trained", default=None, help="a HF Llama folder of a model trained here, measured too (a "
                    "BitNet checkpoint loads as BitNet: its config records the recipe)")
    ap.add_argument("--skip-smollm2", action="store_true",
                    help="measure only --trained (a box without the staged SmolLM2); its figures become the headline")
    ap.add_argument("--label", default=None, help="result file suffix: bitnet_kv_<label>.json (default: the device)")
    args = ap.parse_args()
    if args.skip_smollm2 and not args.trained:
        ap.error("--skip-smollm2: needs --trained (nothing would be measured)")
    if args.smoke:
        args.windows, args.seq, args.prompts, args.prompt, args.new_tokens = 1, 64, 2, 16, 4
    torch.manual_seed(0)
    from thrifty.pretrained import ensure_converted

    rows, summary = [], {}
    t = time.perf_counter()
    if not args.skip_smollm2:
        shape, held = run_model(ensure_converted(progress=False), "smollm2", args, rows, summary)
    if args.trained:
        trained_shape, trained_held = run_model(args.trained, "trained", args, rows, summary, with_hf=False)
        if args.skip_smollm2:
            shape, held = trained_shape, trained_held
    memory(shape, held, args.seq, rows, summary, name="trained" if args.skip_smollm2 else "smollm2")
    # The headline keys: the model trained here when given (BitNet a4.8 is what the 3-bit cache is for;
    # SmolLM2 is an fp model with Q4_1-distorted weights), else SmolLM2.
    head = "trained" if args.trained else "smollm2"
    for key in ("kv3", "kv4", "kv8", "kv3_nosink"):
        summary[f"{key}_ppl_delta_pct"] = summary[f"{key}_ppl_delta_pct_{head}"]
    for key in ("kv3", "kv4"):
        summary[f"greedy_agree_{key}"] = summary[f"greedy_agree_{key}_{head}"]
        summary[f"kv_bytes_ratio_vs_bf16_{key}"] = summary[f"kv_bytes_ratio_vs_bf16_{key}_llama7b"]
    summary["headline_model"] = head
    extra = dict(smoke=args.smoke, windows=args.windows, seq=args.seq, prompts=args.prompts, prompt=args.prompt,
                 new_tokens=args.new_tokens, seconds=time.perf_counter() - t,
                 model="SmolLM2-135M (Q4_1 GGUF dequantized to fp32), thrifty reference model + transformers",
                 trained_model=args.trained or "none in data/",
                 trained_config=_trained_config(args.trained),
                 quantization="post-RoPE K and V, per-token-per-head absmax, unsigned codes (all 2^bits levels over "
                              "[-absmax, absmax]), packed; 3-bit mode: first token at 4 bits",
                 decode_path="CPU: reference attention on the dequantized cache (the kernel matches it: tests)")
    results_dir = tempfile.mkdtemp(prefix="bitnet_kv_smoke_") if args.smoke else None
    path = bench.write_result("bitnet_kv", rows, summary, extra=extra, results_dir=results_dir, device=args.label)
    bench.print_table(rows)
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()})
    print(path)


if __name__ == "__main__":
    main()
