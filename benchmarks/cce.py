"""Linear cross-entropy, loss and loss+grad, side by side in one run: naive torch, torch.compile, apple CCE
(cut-cross-entropy 25.1.1), Liger FLCE (liger-kernel 0.8.5) and thrifty; time, peak memory, accuracy vs float64.

    python benchmarks/cce.py --stage            # CPU, once: real SmolLM2 E and C into .stage/cce (carried)
    python benchmarks/cce.py --stage-trained data/trained-30m   # CPU: a model trained here -> .stage/cce_trained
    python benchmarks/cce.py --shapes 576x49152,2304x256000 --regimes random,realistic --out DIR
    python benchmarks/cce.py --train-step 1b --out DIR   # GPU: Llama-3.2-1B training step, stock/thrifty/Liger loss
    python benchmarks/cce.py --smoke --out DIR           # the same at a tiny shape, CPU OK (tests/)

Regimes: "random" = near-uniform logits (apple's best case); "realistic" = real SmolLM2-135M final hidden
states and lm_head on real text (D=576, V=49152), the 30m model trained in this project (`thrifty pretrain`,
D=384, V=49152, tied embedding) on the corpus validation split, or, for the large shapes, synthetic E, C whose logits have the
real entropy and top-1 probability (a Zipf-like per-token bias plus Gaussian per-row noise, two scales fitted;
targets sampled from the softmax itself, so the loss ~ the entropy, as with a trained model).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
STAGE = ROOT / ".stage" / "cce"
STAGE_TRAINED = ROOT / ".stage" / "cce_trained"
N_TOKENS = 8192


# ------------------------------------------------------------------------------------------- staging (CPU)
def stage():
    """Final (post-norm) hidden states of SmolLM2 on real English text + its lm_head, bf16, into .stage/cce."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from thrifty.pretrained import ensure_converted

    d = ensure_converted()
    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    corpus = ROOT / "data" / "corpus" / "text" / "python3.11-doc.jsonl"
    texts = [json.loads(line)["text"] for line in corpus.open()] if corpus.exists() else [FALLBACK_TEXT] * 400
    ids = tok("\n\n".join(texts[:400]), return_tensors="pt").input_ids[0][: N_TOKENS + 16]
    seq = 512
    hs, tg = [], []
    with torch.no_grad():
        for s in range(0, N_TOKENS, seq):
            chunk = ids[s: s + seq + 1]
            out = model(chunk[None, :-1], output_hidden_states=True)
            h = out.hidden_states[-1][0]
            # the last hidden_states entry must be post-norm: lm_head of it reproduces the logits
            assert torch.allclose(model.lm_head(h), out.logits[0], atol=1e-3), "hidden_states[-1] is not post-norm"
            hs.append(h)
            tg.append(chunk[1:])
    e = torch.cat(hs)[:N_TOKENS].bfloat16()
    t = torch.cat(tg)[:N_TOKENS]
    c = model.lm_head.weight.detach().bfloat16()
    save_staged(STAGE, e, t, c)  # bf16 C is 56.6 MB: byte planes, to fit the 64 MiB the device tool carries
    stage_train_tokens()
    z = e.float() @ c.float().T
    print("staged", e.shape, c.shape, "stats", logit_stats(z), "loss", F.cross_entropy(z, t).item())


def save_staged(folder, e, t, c):
    """bf16 E + targets as safetensors; C as its two byte planes, the high one (sign+exponent) compressed, so that
    a staged folder fits the 64 MiB the device tool carries."""
    import numpy as np
    from safetensors.torch import save_file  # never pickle, even for staging

    folder.mkdir(parents=True, exist_ok=True)
    raw = c.view(torch.int16).numpy().view(np.uint8).reshape(-1, 2)
    np.savez_compressed(folder / "c_hi.npz", hi=raw[:, 1])
    np.save(folder / "c_lo.npy", raw[:, 0])
    save_file({"e": e.contiguous(), "targets": t.contiguous()}, str(folder / "e_targets.safetensors"),
              metadata={"c_shape": json.dumps(list(c.shape))})


def stage_trained(checkpoint):
    """Final (post-norm) hidden states of a model trained here (`thrifty pretrain` folder) on N_TOKENS of the
    corpus validation split (text it was not trained on) + its classifier, bf16, into .stage/cce_trained."""
    from thrifty.data import TokenDataset
    from thrifty.models import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(checkpoint).eval()
    seq = min(512, model.config.max_position_embeddings)
    ds = TokenDataset(prepare_corpus_dir(), "validation")
    captured = {}

    def capture(hidden, weight, labels):  # the loss seam sees exactly what a fused loss would
        captured.setdefault("h", []).append(hidden.detach().reshape(-1, hidden.shape[-1]))
        captured.setdefault("t", []).append(labels.reshape(-1))
        captured["c"] = weight.detach()
        return hidden.sum() * 0

    model.set_loss(capture)
    with torch.no_grad():
        for i in range(N_TOKENS // seq):
            x, y = ds.batch(1, seq, seed=10_000 + i)
            model(x, labels=y)
    e = torch.cat(captured["h"])[:N_TOKENS].bfloat16()
    t = torch.cat(captured["t"])[:N_TOKENS]
    c = captured["c"].bfloat16()
    save_staged(STAGE_TRAINED, e, t, c)
    z = e.float() @ c.float().T
    print("staged", e.shape, c.shape, "stats", logit_stats(z), "loss", F.cross_entropy(z, t).item())


def stage_train_tokens(n_tokens: int = 3_000_000):
    """The first tokens of the corpus train split (int32, 12 MB) for `--train`, which runs without the corpus."""
    from safetensors.torch import save_file

    from thrifty.data import TokenDataset

    tokens = torch.from_numpy(TokenDataset(prepare_corpus_dir(), "train").tokens[:n_tokens].astype("int32"))
    save_file({"tokens": tokens}, str(STAGE / "train_tokens.safetensors"))


def prepare_corpus_dir():
    from thrifty.data import prepare_corpus

    return prepare_corpus(progress=False)


def load_staged(folder=STAGE):
    import numpy as np
    from safetensors import safe_open

    with safe_open(str(folder / "e_targets.safetensors"), framework="pt") as f:
        e, targets = f.get_tensor("e"), f.get_tensor("targets")
        shape = json.loads(f.metadata()["c_shape"])
    hi = np.load(folder / "c_hi.npz")["hi"]
    lo = np.load(folder / "c_lo.npy")
    raw = np.stack([lo, hi], axis=1).reshape(-1).view(np.int16).copy()
    c = torch.from_numpy(raw).view(torch.bfloat16).view(*shape)
    return e, c, targets


FALLBACK_TEXT = ("The quick brown fox jumps over the lazy dog. Language models predict the next token from the ones "
                 "before it, and the cross-entropy of that prediction is the loss they are trained on. ")


def logit_stats(z):
    """Mean per-row softmax entropy (nats) and mean top-1 probability."""
    p = torch.softmax(z.float(), -1)
    ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    return dict(entropy=ent.mean().item(), top1=p.max(-1).values.mean().item())


# ------------------------------------------------------------------------------------------- inputs (GPU)
def synthetic(D, V, entropy, top1, seed=0, device="cuda", n=N_TOKENS):
    """E, C (bf16) with logits z_ij = a*bias_j + s*noise_ij: bias_j = -log(rank_j) (Zipf over a random token
    order) in one coordinate, Gaussian noise in the others; (a, s) fitted on 256 rows to the target
    entropy and top-1. Returns E, C, targets sampled from softmax(z)."""
    g = torch.Generator(device=device).manual_seed(seed)
    rank = torch.randperm(V, generator=g, device=device).float() + 1
    zipf = -torch.log(rank)
    base_e = torch.randn(n, D - 1, generator=g, device=device) / math.sqrt(D - 1)
    base_c = torch.randn(V, D - 1, generator=g, device=device)

    def build(a, s):
        e = torch.cat([torch.ones(n, 1, device=device), base_e * s], 1)
        c = torch.cat([zipf[:, None] * a, base_c], 1)
        return e, c

    best = None
    for a in torch.linspace(0.5, 2.0, 16).tolist():
        for s in torch.linspace(0.5, 4.0, 15).tolist():
            e, c = build(a, s)
            st = logit_stats((e[:256].bfloat16() @ c.bfloat16().T).float())
            err = (st["entropy"] - entropy) ** 2 + (10 * (st["top1"] - top1)) ** 2
            if best is None or err < best[0]:
                best = (err, a, s, st)
    _, a, s, st = best
    e, c = build(a, s)
    e, c = e.bfloat16(), c.bfloat16()
    targets = torch.empty(n, dtype=torch.long, device=device)
    for i in range(0, n, 512):
        p = torch.softmax((e[i:i + 512] @ c.T).float(), -1)
        targets[i:i + 512] = torch.multinomial(p, 1, generator=g).squeeze(1)
    return e, c, targets, dict(a=a, s=s, **st)


def random_inputs(D, V, seed=0, device="cuda", n=N_TOKENS):
    g = torch.Generator(device=device).manual_seed(seed)
    e = torch.randn(n, D, generator=g, device=device).bfloat16()
    c = (torch.randn(V, D, generator=g, device=device) / math.sqrt(D)).bfloat16()  # logits ~ N(0, 1)
    t = torch.randint(0, V, (n,), generator=g, device=device)
    return e, c, t, logit_stats((e[:256] @ c.T).float())


# ------------------------------------------------------------------------------------------- implementations
def impls():
    from thrifty.loss import CCEKernelConfig, linear_cross_entropy as thrifty_lce

    out = {}
    out["torch"] = lambda e, c, t: F.cross_entropy((e @ c.T).float(), t)
    compiled = torch.compile(lambda e, c, t: F.cross_entropy((e @ c.T).float(), t), dynamic=False)
    out["torch.compile"] = compiled
    try:
        from cut_cross_entropy import linear_cross_entropy as apple

        out["apple_cce"] = lambda e, c, t: apple(e, c, t)
    except Exception as err:  # noqa: BLE001
        print("apple cce unavailable:", err)
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger

        out["liger"] = lambda e, c, t: liger(e, c, t)
    except Exception as err:  # noqa: BLE001
        print("liger unavailable:", err)
    # QuACK (CuTe DSL): quack-kernels + nvidia-cutlass-dsl with its libs-core (the cutlass Python package),
    # libs-base and libs-cu13 wheels, apache-tvm-ffi, torch-c-dlpack-ext. Installed with pip --target, the
    # folder's path must contain "/site-packages/" (QuACK fingerprints only non-installed code; elsewhere it walks
    # into cutlass's internals and refuses a ContextVar) and nvidia_cutlass_dsl/dsl_packages must be on
    # PYTHONPATH (the wheel's .pth is not read from a --target folder). loss NOTES, "QuACK".
    try:
        from quack.linear_cross_entropy import chunked_linear_cross_entropy as quack

        # QuACK 0.6.5 refuses chunk_size == D ("m == n makes row/col inference ambiguous"): at D = 4096 its
        # token chunks are 2048 instead of its default 4096
        out["quack"] = lambda e, c, t: quack(e, c, t, chunk_size=2048 if e.shape[-1] == 4096 else 4096)
    except Exception as err:  # noqa: BLE001
        print("quack unavailable:", err)
    variants = {
        # defaults: exact (no filter); gradient tiles + fp32 dE accumulator in dC's free rows, 8 MiB tail buffer
        "thrifty": {},
        # apple's eps/32 filter + vocabulary sorting (separate buffer)
        "thrifty_filter": dict(config=CCEKernelConfig(filter_eps="auto")),
        # the previous default (v5): separate 64 MiB gradient-tile buffer + separate fp32 dE scratch
        "thrifty_sep64": dict(config=CCEKernelConfig(scratch_in_dc=False)),
        # the forward kept on the fused kernel (the default before the GEMM forward), the rest the default path:
        # the two forwards in one run, the data behind the GEMM forward's thresholds
        "thrifty_fused_fwd": dict(config=CCEKernelConfig(forward="fused")),
        # the forward's rule before the Gluon LSE kernel (GEMM forward for training calls at D >= 2048, else the
        # fused kernel): the Gluon forward against it in one run
        "thrifty_gemm_fwd": dict(config=CCEKernelConfig(forward="gemm")),
        # the backward's gradient tiles kept on the Triton kernel (the default before the Gluon tile kernel): the
        # two tile kernels in one run
        "thrifty_triton_tiles": dict(config=CCEKernelConfig(tiles="triton")),
    }
    for name, kw in variants.items():
        out[name] = (lambda kw: lambda e, c, t: thrifty_lce(e, c, t, impl="triton", **kw))(kw)
    return out


def float64_reference(e, c, t):
    from thrifty.loss.reference import linear_cross_entropy as ref

    e64 = e.double().requires_grad_()
    c64 = c.double().requires_grad_()
    loss = ref(e64, c64, t, chunk_size=1024)
    loss.backward()
    return loss.item(), e64.grad.float(), c64.grad.float()


def cos(a, b):
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def kept_tile_fraction(e, c, t, lse, eps, sort, tile=128):
    """Fraction of 128x128 gradient tiles with some |g| >= eps (what thrifty's backward must multiply)."""
    from thrifty.loss.backward import vocab_order

    rows = torch.arange(e.shape[0], device=e.device)
    order = vocab_order(e, c, None, rows).long() if sort else torch.arange(c.shape[0], device=e.device)
    c_sorted = c[order]
    kept = total = 0
    for i in range(0, e.shape[0], tile):
        z = (e[i:i + tile] @ c_sorted.T).float()
        g = torch.exp(z - lse[i:i + tile, None])
        g[torch.arange(z.shape[0]), torch.argsort(order)[t[i:i + tile]]] -= 1
        nb = math.ceil(z.shape[1] / tile)
        gp = F.pad(g.abs(), (0, nb * tile - z.shape[1]))
        m = gp.view(z.shape[0], nb, tile).amax(dim=(0, 2))
        kept += int((m >= eps).sum())
        total += nb
    return kept / total


def same_shape_matmul_ms(e, c):
    """cuBLAS's time for the logits product E·Cᵀ (bf16 out) at this very shape: each of the exact form's four
    products has its FLOPs, so 4x this is what four cuBLAS calls would take, the shape's practical floor (the
    square 8192³ rate flatters thin or wide shapes)."""
    from thrifty.bench import time_fn

    out = torch.empty(e.shape[0], c.shape[0], dtype=e.dtype, device=e.device)
    ms = time_fn(lambda: torch.mm(e, c.T, out=out), warmup=3, reps=20).median_ms
    del out
    torch.cuda.empty_cache()
    return ms


def measure(name, fn, e, c, t, ref, rate_tflops, shape_info, budget_s=3.0):
    from thrifty.bench import peak_memory, time_fn

    N, D = e.shape
    V = c.shape[0]
    row = dict(shape=f"D={D} V={V}", impl=name, **shape_info)
    ec = [(e.clone().requires_grad_(), c.clone().requires_grad_(), t) for _ in range(2)]

    def loss_only(e_, c_, t_):
        with torch.no_grad():
            return fn(e_, c_, t_)

    def loss_grad(e_, c_, t_):
        e_.grad = c_.grad = None
        loss = fn(e_, c_, t_)
        loss.backward()
        return loss

    try:
        e_, c_, _ = ec[0]
        loss = loss_grad(e_, c_, t)
        torch.cuda.synchronize()
        l64, de64, dc64 = ref
        row.update(loss_rel_err=abs(loss.item() - l64) / abs(l64), de_cos=cos(e_.grad, de64), dc_cos=cos(c_.grad, dc64))
        row["loss_ms"] = time_fn(loss_only, ec, warmup=2, reps=20, budget_s=budget_s).median_ms
        row["loss_grad_ms"] = time_fn(loss_grad, ec, warmup=2, reps=20, budget_s=budget_s).median_ms
        for x in ec:
            x[0].grad = x[1].grad = None
        e_, c_, _ = ec[0]
        e_.grad = c_.grad = None
        # grads are allocated during the call, so this is peak over inputs (grads included)
        row["peak_mem_mib"] = peak_memory(loss_grad, e_, c_, t) / 2**20
        e_.grad = c_.grad = None
    except Exception as err:  # noqa: BLE001
        row["error"] = f"{type(err).__name__}: {err}"[:300]
    del ec
    torch.cuda.empty_cache()
    lower = (N * D + V * D) * 2 / 2**20
    row["lower_bound_mib"] = lower
    row["roofline_ms"] = 4 * 2 * N * D * V / (rate_tflops * 1e12) * 1e3
    return row


def profile(D, V, regime, entropy, top1):
    """Where thrifty's loss+grad time goes (kernel table), and the forward kernel's block configs."""
    from thrifty.bench import time_fn
    from thrifty.loss import linear_cross_entropy as lce
    from thrifty.loss.forward import lse_forward

    e, c, t, _ = random_inputs(D, V) if regime == "random" else synthetic(D, V, entropy, top1)
    e.requires_grad_()
    c.requires_grad_()
    for _ in range(2):
        lce(e, c, t).backward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            lce(e, c, t).backward()
        torch.cuda.synchronize()
    print(f"== profile D={D} V={V} {regime} (3 calls)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    rows = torch.arange(e.shape[0], device="cuda")
    for bn, bv, bd, w, st in [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3),
                              (256, 128, 64, 8, 3), (128, 256, 32, 8, 5), (64, 256, 64, 4, 4)]:
        cfg = dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, num_warps=w, num_stages=st)
        try:
            ms = time_fn(lambda: lse_forward(e.detach(), c.detach(), None, rows, t, None, config=cfg), warmup=2,
                         reps=10).median_ms
            print(f"  forward {cfg}: {ms:.2f} ms = {2 * e.shape[0] * D * V / ms / 1e9:.0f} TFLOP/s", flush=True)
        except Exception as err:  # noqa: BLE001
            print(f"  forward {cfg}: {type(err).__name__}", flush=True)


def train_compare(steps, preset_name, out, batch=16, seq=512):
    """The end effect: the reference model (thrifty.models) pre-trained from scratch on real tokens with the
    plain loss (logits + F.cross_entropy) and with thrifty's, same seed and data: loss curves, step time, memory."""
    from thrifty.bench import detect_device, write_result
    from thrifty.loss import CCEKernelConfig, lm_loss
    from thrifty.models.llama import LlamaForCausalLM, logits_cross_entropy
    from thrifty.models.presets import preset

    from safetensors.torch import load_file

    tokens = load_file(str(STAGE / "train_tokens.safetensors"))["tokens"].long()
    train, val = tokens[:-200_000], tokens[-200_000:]

    def batch_from(data, g):
        idx = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([data[i:i + seq + 1] for i in idx.tolist()]).cuda(non_blocking=True)
        return x[:, :-1], x[:, 1:]

    rows, summary = [], {}
    arms = (("torch", logits_cross_entropy), ("thrifty", lm_loss),
            ("thrifty_filter", lambda h, w, y: lm_loss(h, w, y, config=CCEKernelConfig(filter_eps="auto"))))
    for name, loss_fn in arms:
        torch.manual_seed(0)
        model = LlamaForCausalLM(preset(preset_name), loss=loss_fn).init_weights(seed=0).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        g = torch.Generator().manual_seed(1)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times, losses = [], []
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = 1e-3 * min(1.0, (step + 1) / 30)
            inputs, labels = batch_from(train, g)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(inputs, labels=labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
            losses.append(loss.item())
            rows.append(dict(impl=name, step=step, loss=losses[-1], step_ms=times[-1]))
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        model.eval()
        gv = torch.Generator().manual_seed(2)
        vals = []
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(10):
                x, y = batch_from(val, gv)
                vals.append(float(model(x, labels=y)))
        val_loss = sum(vals) / len(vals)
        summary[f"{name}_final_train_loss_mean_last50"] = sum(losses[-50:]) / 50
        summary[f"{name}_val_loss"] = val_loss
        summary[f"{name}_median_step_ms"] = sorted(times[5:])[len(times[5:]) // 2]
        summary[f"{name}_peak_mem_mib"] = peak
        print(name, {k: v for k, v in summary.items() if k.startswith(name)}, flush=True)
        del model, opt
        torch.cuda.empty_cache()
    dev = detect_device()
    path = write_result("cce_train", rows, summary, device=dev, results_dir=out,
                        extra=dict(preset=preset_name, batch=batch, seq=seq, steps=steps, lr=1e-3, autocast="bf16",
                                   data="SmolLM2-tokenised Debian/Python/PostgreSQL docs (data/corpus)"),
                        plot=dict(x="step", y="loss", hue="impl", kind="line",
                                  title=f"{preset_name} from scratch: plain CE vs thrifty CE ({dev})"))
    print("summary:", json.dumps(summary, indent=1), "->", path)


# ------------------------------------------------------------------------------------------- train step (model)
# issue #32: one training step of a transformers Llama-3.2-1B shape with the stock loss, thrifty's and Liger's.
# The real model's config, less its llama3 RoPE scaling (a few multiplies on the frequencies, no effect on the
# step's cost); random bf16 weights made on the device.
TRAIN_STEP_SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
}
TRAIN_STEP_SECTION = "train_step"
# the losses of the three arms on the same batch and weights must agree to bf16 rounding (eps 2^-8, relative)
TRAIN_STEP_LOSS_RTOL = 2.0 ** -8


def build_llama(shape: str, device: str, dtype=torch.bfloat16):
    """transformers LlamaForCausalLM of a TRAIN_STEP_SHAPES shape, random weights made in ``dtype`` on ``device``."""
    import transformers

    cfg = transformers.LlamaConfig(**TRAIN_STEP_SHAPES[shape], max_position_embeddings=131072,
                                   attn_implementation="sdpa")
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("lm_head and embed_tokens are not tied, unlike the real Llama-3.2-1B")
    return model.train()


class LossArm:
    """One loss of the comparison, put on the model for a round (``on``) and taken off after (``off``); the model,
    its weights, the optimizer and the batch are shared by all arms."""

    def __init__(self, name, on=lambda m: None, off=lambda m: None, path=""):
        self.name, self.on, self.off, self.path = name, on, off, path


def stock_arm():
    return LossArm("stock", path="transformers LlamaForCausalLM.forward: lm_head logits, then ForCausalLMLoss "
                                 "(fp32 upcast + F.cross_entropy)")


def thrifty_arm():
    import thrifty

    return LossArm("thrifty", on=lambda m: thrifty.optimize(m, thrifty.OptimizeConfig(cce=True, training=True)),
                   off=thrifty.undo, path="thrifty.optimize(model, OptimizeConfig(cce=True, training=True)) -> "
                                          "thrifty.loss.hf.patch_causal_lm (no logits in training)")


def liger_arms():
    """Liger's fused linear CE alone (its RoPE, RMSNorm, SwiGLU and plain CE off): first its own transformers patch
    of this instance's forward, then, should that fail on this transformers, a forward that runs the decoder and
    calls LigerFusedLinearCrossEntropyLoss on the hidden states. Raises ImportError without liger_kernel."""
    import liger_kernel
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss, apply_liger_kernel_to_llama

    version = getattr(liger_kernel, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("liger-kernel")

    def patch(m):
        apply_liger_kernel_to_llama(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=False,
                                    swiglu=False, model=m)

    def wrap(m):
        loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="mean")

        def forward(self, input_ids=None, labels=None, use_cache=None, **kwargs):
            from transformers.modeling_outputs import CausalLMOutputWithPast

            hidden = self.model(input_ids=input_ids, use_cache=use_cache, **kwargs).last_hidden_state
            targets = F.pad(labels, (0, 1), value=-100)[:, 1:]  # the HF shift: position t predicts t+1
            loss = loss_fn(self.lm_head.weight, hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1))
            return CausalLMOutputWithPast(loss=loss, logits=None)

        m.forward = types.MethodType(forward, m)

    off = lambda m: m.__dict__.pop("forward", None)  # noqa: E731 (both put a bound forward on the instance)
    return [LossArm("liger", patch, off, f"liger-kernel {version}: apply_liger_kernel_to_llama("
                                         "fused_linear_cross_entropy=True, rope/rms_norm/swiglu/cross_entropy=False, "
                                         "model=model) -> liger's lce_forward on this instance"),
            LossArm("liger", wrap, off, f"liger-kernel {version}: LigerFusedLinearCrossEntropyLoss on the decoder's "
                                        "hidden states in a wrapper forward (fallback)")]


def _grads(model):
    return [p.grad.detach().clone() if p.grad is not None else None for p in model.parameters()]


def _grad_cos(model, ref):
    """Cosine over all parameters of model's gradients against ``ref`` (one flat vector), and of the tied
    embedding / classifier weight alone (where the loss's gradient enters)."""
    dot = na = nb = 0.0
    for p, r in zip(model.parameters(), ref):
        if p.grad is None or r is None:
            continue
        a, b = p.grad.double(), r.double()
        dot, na, nb = dot + float((a * b).sum()), na + float((a * a).sum()), nb + float((b * b).sum())
    emb = model.model.embed_tokens.weight
    idx = next(i for i, p in enumerate(model.parameters()) if p is emb)
    return dot / math.sqrt(na * nb), cos(emb.grad, ref[idx])


def train_step_compare(args):
    """Stock vs thrifty vs Liger loss in a transformers Llama training step, alternating rounds; rows and summary
    keys merged into cce_<device>.json (its kernel rows and other summary keys kept)."""
    from thrifty.bench import detect_device, env_info, peak_memory, time_fn

    shape = "tiny" if args.smoke else args.train_step
    if shape not in TRAIN_STEP_SHAPES:
        raise SystemExit(f"--train-step: expected one of {sorted(TRAIN_STEP_SHAPES)}, got {shape!r}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.train_seq, args.train_rounds, args.train_reps = min(args.train_seq, 64), 2, 1
    B, S, sfx = args.train_batch, args.train_seq, shape
    t0 = time.time()
    torch.manual_seed(0)
    model = build_llama(shape, device)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (B, S), generator=g, device=device)
    if args.train_optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=args.train_lr, fused=device == "cuda")
    else:
        opt = torch.optim.SGD(model.parameters(), lr=args.train_lr)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    print(f"== train step {shape}: {n_params / 1e6:.1f} M params (bf16, tied classifier), batch {B} x {S} tokens, "
          f"{args.train_optimizer}; model made in {time.time() - t0:.1f} s", flush=True)

    def forward_backward():
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        return out

    def step_fb():
        forward_backward()
        model.zero_grad(set_to_none=True)

    def step_full():
        forward_backward()
        opt.step()
        model.zero_grad(set_to_none=True)

    rows, notes = [], {}
    arms = [stock_arm(), thrifty_arm()]
    try:
        candidates = liger_arms()
    except ImportError as err:
        candidates = []
        rows.append(dict(section=TRAIN_STEP_SECTION, shape=shape, impl="liger",
                         skipped=f"liger_kernel not installed ({err}); the GPU box installs it from .whl/"))
        print("liger: skipped,", rows[-1]["skipped"], flush=True)

    # 1. the same batch on the same weights (no optimizer step yet): losses and gradients against the stock loss;
    #    also every arm's warm-up (Triton compiles)
    checked, ref = {}, None

    def check(arm):
        arm.on(model)
        try:
            out = forward_backward()
            sync()
            loss = float(out.loss.detach())
            row = dict(section=TRAIN_STEP_SECTION, what="check", shape=shape, impl=arm.name, path=arm.path,
                       loss=loss, logits_materialized=out.logits is not None)
            if ref is not None:
                row["grad_cos_vs_stock"], row["embed_grad_cos_vs_stock"] = _grad_cos(model, ref[1])
                row["loss_rel_diff_vs_stock"] = abs(loss - ref[0]) / abs(ref[0])
            return row
        finally:
            arm.off(model)

    for arm in arms:
        row = check(arm)
        if arm.name == "stock":
            ref = (row["loss"], _grads(model))
        model.zero_grad(set_to_none=True)
        rows.append(row)
        checked[arm.name] = row
    for arm in candidates:  # liger: its patch, else the wrapper
        try:
            row = check(arm)
        except Exception as err:  # noqa: BLE001 - recorded; the next candidate (or none) runs
            model.zero_grad(set_to_none=True)
            notes.setdefault("liger_errors", []).append(f"{arm.path}: {type(err).__name__}: {err}"[:600])
            print("liger:", notes["liger_errors"][-1], flush=True)
            continue
        model.zero_grad(set_to_none=True)
        rows.append(row)
        checked[arm.name] = row
        arms.append(arm)
        break
    else:
        if candidates:
            rows.append(dict(section=TRAIN_STEP_SECTION, shape=shape, impl="liger",
                             error="; ".join(notes.get("liger_errors", []))[:900]))
    del ref
    for name, row in checked.items():
        print(f"  check {name:8s} loss {row['loss']:.6f}", {k: row[k] for k in row if k.endswith("_vs_stock")},
              f"logits materialized: {row['logits_materialized']}", flush=True)
        if name != "stock":
            if not row["loss_rel_diff_vs_stock"] <= TRAIN_STEP_LOSS_RTOL:
                raise AssertionError(f"{name}: loss {row['loss']} vs stock {checked['stock']['loss']} differs by "
                                     f"{row['loss_rel_diff_vs_stock']:.2e} relative (> bf16's {TRAIN_STEP_LOSS_RTOL})")
            if row["logits_materialized"]:
                raise AssertionError(f"{name}: the training forward returned logits; the fused loss was not used")

    # 2. one full step per arm (the optimizer's state is made here), then the peak memory of each kind of step over
    #    what lives between steps (weights + optimizer state; no gradients)
    peaks = {}
    for arm in arms:
        arm.on(model)
        try:
            step_full()
            for mode, fn in (("fwd+bwd", step_fb), ("fwd+bwd+opt", step_full)):
                peak = peak_memory(fn)
                peaks[arm.name, mode] = None if peak is None else peak / 2**20
        finally:
            arm.off(model)
    state_mib = None
    if device == "cuda":
        sync()
        state_mib = torch.cuda.memory_allocated() / 2**20

    # 3. alternating rounds: in each, every arm (order rotated) times fwd+bwd and fwd+bwd+opt steps
    times = {(arm.name, mode): [] for arm in arms for mode in ("fwd+bwd", "fwd+bwd+opt")}
    rounds = range(args.train_rounds)
    try:
        from tqdm import tqdm

        rounds = tqdm(rounds, desc="train-step rounds", file=sys.stdout, disable=args.smoke)
    except ImportError:
        pass
    for r in rounds:
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            arm.on(model)
            try:
                for mode, fn in (("fwd+bwd", step_fb), ("fwd+bwd+opt", step_full)):
                    t = time_fn(fn, warmup=1, reps=args.train_reps, min_reps=1, device=device)
                    times[arm.name, mode].append(t.median_ms)
            finally:
                arm.off(model)

    summary = {}
    for (name, mode), per_round in times.items():
        med = statistics.median(per_round)
        rows.append(dict(section=TRAIN_STEP_SECTION, what=mode, shape=shape, impl=name, batch=B, seq=S,
                         optimizer=args.train_optimizer if mode.endswith("opt") else None, ms=med,
                         spread_pct=100.0 * (max(per_round) - min(per_round)) / med, round_ms=per_round,
                         peak_mib=peaks.get((name, mode))))
    ms = {k: statistics.median(v) for k, v in times.items()}

    def ratio(other, mode):
        return ms[other, mode] / ms["thrifty", mode] if (other, mode) in ms else None

    summary[f"train_step_ratio_vs_stock_{sfx}"] = ratio("stock", "fwd+bwd+opt")
    summary[f"train_step_ratio_vs_liger_{sfx}"] = ratio("liger", "fwd+bwd+opt")
    summary[f"train_step_fwd_bwd_ratio_vs_stock_{sfx}"] = ratio("stock", "fwd+bwd")
    summary[f"train_step_fwd_bwd_ratio_vs_liger_{sfx}"] = ratio("liger", "fwd+bwd")
    for name in ("stock", "thrifty", "liger"):
        summary[f"train_step_ms_{name}_{sfx}"] = ms.get((name, "fwd+bwd+opt"))
        summary[f"train_step_peak_mib_{name}_{sfx}"] = peaks.get((name, "fwd+bwd+opt"))
    dev = detect_device()
    settings = dict(shape=shape, config=TRAIN_STEP_SHAPES[shape], params=n_params, batch=B, seq=S,
                    dtype="bfloat16 weights, gradients and optimizer state (no autocast, no master copy)",
                    optimizer=f"{args.train_optimizer} lr={args.train_lr}"
                              + (" fused" if args.train_optimizer == "adamw" and device == "cuda" else ""),
                    attention="sdpa", rounds=args.train_rounds, timed_steps_per_round=args.train_reps,
                    state_mib=state_mib, smoke=args.smoke, arms={a.name: a.path for a in arms},
                    timing="per round and arm: 1 untimed step, then train_reps timed steps (CUDA events), their "
                           "median; ms = median over rounds, spread = (max - min) / median over rounds; arms in "
                           "rotated order each round",
                    peak="max_memory_allocated during one step minus what was allocated before it (weights + "
                         "optimizer state); includes the gradients", meta=env_info(dev), wall_s=time.time() - t0,
                    **notes)
    path = merge_train_step(rows, summary, settings, dev, args)
    plot_train_step(rows, Path(args.out) / f"cce_train_step_{dev}.png", f"{shape} train step, batch {B}x{S} ({dev})")
    from thrifty.bench import print_table

    print_table([r for r in rows if r.get("what") in ("fwd+bwd", "fwd+bwd+opt")],
                ["what", "impl", "ms", "spread_pct", "peak_mib"])
    print("summary:", json.dumps(summary, indent=1), "->", path)


def previous_cce_result(dev, explicit=""):
    """The cce_<device>.json whose kernel rows a train-step run keeps (and whose train-step rows a kernel run keeps):
    ``explicit`` when given, else the one committed under benchmarks/results."""
    path = Path(explicit) if explicit else ROOT / "benchmarks" / "results" / f"cce_{dev}.json"
    return path if path.is_file() else None


def merge_train_step(rows, summary, settings, dev, args):
    """Writes cce_<device>.json under --out: the earlier file's rows of other sections, its summary and extra, with
    this run's train-step rows, keys and settings in their place. meta becomes this run's; the earlier meta
    (the kernel rows' run) is kept in extra.kernel_rows_meta."""
    from thrifty.bench import read_result, write_result

    previous = previous_cce_result(dev, args.merge_into) if not (args.smoke and not args.merge_into) else None
    extra = {}
    if previous is not None:
        old = read_result(previous)
        rows = [r for r in old["rows"] if r.get("section") != TRAIN_STEP_SECTION] + rows
        summary = {**old["summary"], **summary}
        extra = dict(old.get("extra", {}))
        extra.setdefault("kernel_rows_meta", old["meta"])
        print(f"merged into {previous} ({len(old['rows'])} rows there)", flush=True)
    else:
        print("no earlier cce result to merge into: the file holds the train-step rows only", flush=True)
    extra["train_step"] = settings
    return write_result("cce", rows, summary, device=dev, results_dir=args.out, extra=extra)


def plot_train_step(rows, path, title):
    """Two panels of bars: ms per step and peak MiB, per step kind and loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.get("what") in ("fwd+bwd", "fwd+bwd+opt")]
    if not timed:
        return None
    modes = list(dict.fromkeys(r["what"] for r in timed))
    impls = list(dict.fromkeys(r["impl"] for r in timed))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), dpi=120)
    for ax, key, label in ((axes[0], "ms", "ms per step (median of rounds)"),
                           (axes[1], "peak_mib", "peak MiB over weights + optimizer state")):
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            vals = [next((r.get(key) for r in timed if r["what"] == m and r["impl"] == impl), None) for m in modes]
            pos = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(modes))]
            bars = ax.bar(pos, [v or 0 for v in vals], width, label=impl)
            ax.bar_label(bars, labels=["" if v is None else f"{v:.0f}" for v in vals], fontsize=7, padding=2)
        ax.set_xticks(range(len(modes)), modes)
        ax.set_ylabel(label)
        if all(r.get(key) is None for r in timed):
            ax.text(0.5, 0.5, "not measured here (CUDA allocator statistics only)", ha="center",
                    transform=ax.transAxes, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.15)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", action="store_true")
    ap.add_argument("--stage-trained", default="", help="a `thrifty pretrain` checkpoint folder to stage (CPU)")
    ap.add_argument("--shapes", default="576x49152,2304x256000,4096x128256,3584x152064")
    ap.add_argument("--regimes", default="realistic,random")
    ap.add_argument("--random-shapes", default="", help="run the random regime only for these shapes (default all)")
    ap.add_argument("--impls", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--entropy", type=float, default=5.35, help="synthetic regime target (anchors' SmolLM2 figure)")
    ap.add_argument("--top1", type=float, default=0.17)
    ap.add_argument("--merge-rows", default="", help="cce_rows.json of an earlier call (same commit, same box "
                    "kind) whose rows this run extends: one result file from calls split by the carry limit")
    ap.add_argument("--budget", type=float, default=3.0, help="seconds of timing per implementation and mode")
    ap.add_argument("--train", default="", help="preset:steps, e.g. 30m:300 (the end effect in the model)")
    ap.add_argument("--tokens", default=str(N_TOKENS),
                    help="token counts for the synthetic and random inputs (the staged real ones have 8192)")
    ap.add_argument("--profile", default="", help="e.g. 2304x256000:realistic,2304x256000:random")
    ts = ap.add_argument_group("train step", "--train-step 1b: a transformers Llama-3.2-1B-shaped training step "
                               "with the stock loss, thrifty's and Liger's; merged into cce_<device>.json")
    ts.add_argument("--train-step", default="", help=f"shape: {' or '.join(TRAIN_STEP_SHAPES)}")
    ts.add_argument("--train-batch", type=int, default=1)
    ts.add_argument("--train-seq", type=int, default=4096)
    ts.add_argument("--train-rounds", type=int, default=6, help="alternating rounds (every arm once per round)")
    ts.add_argument("--train-reps", type=int, default=3, help="timed steps per arm, step kind and round")
    ts.add_argument("--train-optimizer", choices=("adamw", "sgd"), default="adamw")
    ts.add_argument("--train-lr", type=float, default=1e-5)
    ts.add_argument("--merge-into", default="", help="the cce_<device>.json to keep the other rows and keys of "
                    "(default: the committed benchmarks/results/cce_<device>.json); also read by a kernel run, "
                    "which keeps its train-step rows and keys")
    ts.add_argument("--smoke", action="store_true", help="with --train-step: the tiny shape, 64 tokens, 2 rounds "
                    "(CPU OK); merges only into --merge-into")
    args = ap.parse_args()
    if args.stage:
        return stage()
    if args.stage_trained:
        return stage_trained(args.stage_trained)
    if args.train_step or args.smoke:
        return train_step_compare(args)

    torch.manual_seed(0)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    from thrifty.bench import time_fn

    ms = time_fn(lambda: a @ a, warmup=3, reps=20).median_ms
    rate = 2 * 8192**3 / (ms * 1e-3) / 1e12
    del a
    print(f"bf16 matmul 8192^3: {rate:.0f} TFLOP/s", flush=True)

    if args.train:
        name, steps = args.train.split(":")
        return train_compare(int(steps), name, args.out)
    for item in filter(None, args.profile.split(",")):
        shape, regime = item.split(":")
        profile(*map(int, shape.split("x")), regime, args.entropy, args.top1)
    if args.profile:
        return
    if "576x49152" in args.shapes.split(",") and "realistic" in args.regimes.split(","):
        e_real, c_real, t_real = load_staged()
        real = logit_stats((e_real[:512].float() @ c_real.float().T))
        print("real SmolLM2 logits:", real, flush=True)
    if "384x49152" in args.shapes.split(",") and "realistic" in args.regimes.split(","):
        e_tr, c_tr, t_tr = load_staged(STAGE_TRAINED)  # benchmarks/cce.py --stage-trained data/trained-30m
        trained = logit_stats((e_tr[:512].float() @ c_tr.float().T))
        print("trained-30m logits:", trained, flush=True)
    fns = impls()
    if args.impls:
        fns = {k: v for k, v in fns.items() if k in args.impls.split(",")}
    rows = json.loads(Path(args.merge_rows).read_text()) if args.merge_rows else []
    if rows:
        print(f"extending {len(rows)} rows of {args.merge_rows}", flush=True)
    cases = [(shape, regime, n) for shape in args.shapes.split(",") for regime in args.regimes.split(",")
             for n in map(int, args.tokens.split(","))]
    for shape, regime, n in cases:
        D, V = map(int, shape.split("x"))
        staged = regime == "realistic" and (D, V) in ((576, 49152), (384, 49152))
        if staged and n != N_TOKENS:
            continue  # staged real inputs hold N_TOKENS rows
        if regime == "random" and args.random_shapes and shape not in args.random_shapes.split(","):
            continue
        t0 = time.time()
        if regime == "random":
            e, c, t, st = random_inputs(D, V, n=n)
        elif D == 576 and V == 49152:
            e, c, t, st = e_real.cuda(), c_real.cuda(), t_real.cuda(), dict(real)
        elif D == 384 and V == 49152:
            e, c, t, st = e_tr.cuda(), c_tr.cuda(), t_tr.cuda(), dict(trained)
        else:
            e, c, t, st = synthetic(D, V, args.entropy, args.top1, n=n)
        ref = float64_reference(e, c, t)
        with torch.no_grad():
            from thrifty.loss.reference import linear_cross_entropy as ref_lce  # noqa: F401

            lse = torch.logsumexp((e.float() @ c.float().T), -1) if V * n * 4 < 20e9 else None
        info = dict(regime=regime, tokens=n, entropy=st["entropy"], top1=st["top1"],
                    same_shape_matmul_ms=same_shape_matmul_ms(e, c))
        if lse is not None:
            info["kept_tiles_sorted"] = kept_tile_fraction(e, c, t, lse, 2.0**-7 / 32, True)
            info["kept_tiles_unsorted"] = kept_tile_fraction(e, c, t, lse, 2.0**-7 / 32, False)
        del lse
        print(f"== D={D} V={V} N={n} {regime} {info} (inputs+ref {time.time() - t0:.0f}s)", flush=True)
        for name, fn in fns.items():
            t1 = time.time()
            row = measure(name, fn, e, c, t, ref, rate, info, budget_s=args.budget)
            row["matmul_tflops"] = rate
            rows.append(row)
            keys = ("loss_ms", "loss_grad_ms", "peak_mem_mib", "loss_rel_err", "de_cos", "dc_cos", "error")
            print(f"  {name:18s}", {k: (round(row[k], 6) if isinstance(row.get(k), float) else row.get(k))
                                     for k in keys if k in row}, f"{time.time() - t1:.0f}s", flush=True)
            Path(args.out, "cce_rows.json").write_text(json.dumps(rows, indent=1))
        del e, c, t, ref
        torch.cuda.empty_cache()
    finalize(rows, rate, args)


def finalize(rows, rate, args):
    """Result file (thrifty.bench schema) + a bar chart of the realistic regime, both under --out."""
    from thrifty.bench import detect_device, plot_rows, read_result, write_result

    def get(shape, regime, impl, key, tokens=N_TOKENS):
        for r in rows:
            if (r["shape"] == shape and r["regime"] == regime and r["impl"] == impl
                    and r.get("tokens", N_TOKENS) == tokens):
                return r.get(key)
        return None

    # issue #32: the paper's shape and a Llama-3 shape, realistic logits, every token count of the run
    issue_cases = sorted({(r["shape"], r.get("tokens", N_TOKENS)) for r in rows if r["regime"] == "realistic"
                          and r["shape"] in ("D=2304 V=256000", "D=4096 V=128256")})

    def over_cases(fn, pick):
        vals = [v for v in (fn(shape, n) for shape, n in issue_cases) if v is not None]
        return pick(vals) if vals else None

    def ceiling_fraction(impl):
        return lambda shape, n: ratio(get(shape, "realistic", impl, "roofline_ms", n),
                                      get(shape, "realistic", impl, "loss_grad_ms", n))

    def same_shape_fraction(shape, n):  # four same-shape cuBLAS products / thrifty's loss+grad
        mm = get(shape, "realistic", "thrifty", "same_shape_matmul_ms", n)
        return ratio(4 * mm if mm else None, get(shape, "realistic", "thrifty", "loss_grad_ms", n))

    def time_ratio(impl, other):
        return lambda shape, n: ratio(get(shape, "realistic", impl, "loss_grad_ms", n),
                                      get(shape, "realistic", other, "loss_grad_ms", n))

    def mem_over_lb(shape, n):
        peak = get(shape, "realistic", "thrifty", "peak_mem_mib", n)
        return None if peak is None else peak - get(shape, "realistic", "thrifty", "lower_bound_mib", n)

    def ratio(a, b):
        return a / b if a is not None and b else None

    big, small, trained = "D=2304 V=256000", "D=576 V=49152", "D=384 V=49152"
    summary = dict(
        loss_grad_time_ratio_vs_apple_cce=ratio(get(big, "realistic", "thrifty", "loss_grad_ms"),
                                                get(big, "realistic", "apple_cce", "loss_grad_ms")),
        loss_grad_time_ratio_vs_torch_compile=ratio(get(big, "realistic", "thrifty", "loss_grad_ms"),
                                                    get(big, "realistic", "torch.compile", "loss_grad_ms")),
        peak_mem_over_lower_bound_mib=(get(big, "realistic", "thrifty", "peak_mem_mib") or 0)
        - (get(big, "realistic", "thrifty", "lower_bound_mib") or 0),
        sep64_peak_mem_over_lower_bound_mib=(get(big, "realistic", "thrifty_sep64", "peak_mem_mib") or 0)
        - (get(big, "realistic", "thrifty", "lower_bound_mib") or 0),
        loss_grad_time_ratio_vs_sep64=ratio(get(big, "realistic", "thrifty", "loss_grad_ms"),
                                            get(big, "realistic", "thrifty_sep64", "loss_grad_ms")),
        de_cos_vs_float64=get(big, "realistic", "thrifty", "de_cos"),
        dc_cos_vs_float64=get(big, "realistic", "thrifty", "dc_cos"),
        loss_rel_err_vs_float64=get(big, "realistic", "thrifty", "loss_rel_err"),
        smollm2_real_loss_grad_ratio_vs_apple_cce=ratio(get(small, "realistic", "thrifty", "loss_grad_ms"),
                                                        get(small, "realistic", "apple_cce", "loss_grad_ms")),
        smollm2_real_loss_grad_ratio_vs_torch_compile=ratio(get(small, "realistic", "thrifty", "loss_grad_ms"),
                                                            get(small, "realistic", "torch.compile", "loss_grad_ms")),
        trained30m_real_loss_grad_ratio_vs_apple_cce=ratio(get(trained, "realistic", "thrifty", "loss_grad_ms"),
                                                           get(trained, "realistic", "apple_cce", "loss_grad_ms")),
        trained30m_real_loss_grad_ratio_vs_torch_compile=ratio(get(trained, "realistic", "thrifty", "loss_grad_ms"),
                                                               get(trained, "realistic", "torch.compile",
                                                                   "loss_grad_ms")),
        random_256k_loss_grad_ratio_vs_apple_cce=ratio(get(big, "random", "thrifty", "loss_grad_ms"),
                                                       get(big, "random", "apple_cce", "loss_grad_ms")),
        random_256k_filtered_loss_grad_ratio_vs_apple_cce=ratio(get(big, "random", "thrifty_filter", "loss_grad_ms"),
                                                                get(big, "random", "apple_cce", "loss_grad_ms")),
        bf16_matmul_tflops=rate,
        matmul_ceiling_fraction_min=over_cases(ceiling_fraction("thrifty"), min),
        same_shape_cublas_fraction_min=over_cases(same_shape_fraction, min),
        matmul_ceiling_fraction_min_fused_forward=over_cases(ceiling_fraction("thrifty_fused_fwd"), min),
        gemm_forward_speedup_min=over_cases(time_ratio("thrifty_fused_fwd", "thrifty_gemm_fwd"), min),
        gemm_forward_speedup_max=over_cases(time_ratio("thrifty_fused_fwd", "thrifty_gemm_fwd"), max),
        gluon_tiles_speedup_min=over_cases(time_ratio("thrifty_triton_tiles", "thrifty"), min),
        gluon_tiles_speedup_max=over_cases(time_ratio("thrifty_triton_tiles", "thrifty"), max),
        gluon_forward_speedup_min=over_cases(time_ratio("thrifty_gemm_fwd", "thrifty"), min),
        gluon_forward_speedup_max=over_cases(time_ratio("thrifty_gemm_fwd", "thrifty"), max),
        time_ratio_vs_compile_max=over_cases(time_ratio("thrifty", "torch.compile"), max),
        time_ratio_vs_quack_max=over_cases(time_ratio("thrifty", "quack"), max),
        mem_over_lb_mib_max=over_cases(mem_over_lb, max),
        train_step_ratio_vs_stock_1b=None,  # measured by --train-step 1b; kept from the earlier file below
    )
    dev = detect_device()
    extra = dict(n_tokens=N_TOKENS, dtype="bfloat16",
                 regimes="random: N(0,1) logits, uniform targets; realistic: real SmolLM2-135M "
                         "hidden states/lm_head on Python docs text (D=576), the 30m model "
                         "trained here on corpus validation text (D=384), else synthetic "
                         "Zipf bias + Gaussian noise fitted to entropy/top-1, targets sampled")
    carried_rows = []
    previous = previous_cce_result(dev, args.merge_into)
    if previous is not None:  # the train step's rows, keys and settings (its own meta inside) stay
        old = read_result(previous)
        carried_rows = [r for r in old["rows"] if r.get("section") == TRAIN_STEP_SECTION]
        summary.update({k: v for k, v in old["summary"].items() if k.startswith("train_step_")})
        if "train_step" in old.get("extra", {}):
            extra["train_step"] = old["extra"]["train_step"]
    path = write_result("cce", rows + carried_rows, summary, device=dev, results_dir=args.out, extra=extra)
    plotted = [dict(r, case=f"{r['shape']} N={r.get('tokens', N_TOKENS)}") for r in rows
               if r["regime"] == "realistic" and "loss_grad_ms" in r]
    if plotted:  # a random-only run has nothing for this chart
        plot_rows(plotted, x="case", y="loss_grad_ms", hue="impl", path=Path(args.out) / f"cce_{dev}.png",
                  logy=True, title=f"linear CE loss+grad, bf16, realistic logits ({dev})",
                  ylabel="ms (log)")
    print("summary:", json.dumps(summary, indent=1), "->", path)


if __name__ == "__main__":
    sys.exit(main())
