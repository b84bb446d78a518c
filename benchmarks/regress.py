"""Same-run regression benchmark: the hot paths of every technique, old tree against new tree, in one call.

A change to a hot path is only safe for speed when the old and the new commit were timed on the same box in
the same run (boxes drift 5-15% between calls; /work/shared/notes/gpu-truth.md). This script times each
section once per tree, each in its own subprocess with ``PYTHONPATH=<tree>/src``, interleaved (section by
section: new, old; then the noisiest sections new again), and prints one table: every figure beside its anchor
(an outside implementation or a ceiling measured in the same worker), old, new, new/old.

Sections (``--sections``, default all), GPU sizes:
  attention  ``thrifty.sage_attention(impl="triton")`` and the kernels alone (``sage_forward_triton``) vs cuDNN
             SDPA (K/V repeated outside the timed region for GQA), bf16, causal, TFLOP/s = 4·B·H·S²·D/t/2:
             D=64 B=4 H=32/8 8K; D=64 B=2 H=32/32 8K; D=128 B=2 H=32/8 8K; D=128 B=1 H=32/8 32K.
  cce        ``thrifty.linear_cross_entropy`` loss+backward vs torch.compile'd linear -> cross_entropy and apple's
             ``cut_cross_entropy``, N=8192, D=2304, V=256000, bf16, peaky logits (benchmarks/cce.py's synthetic
             regime: Zipf bias + Gaussian noise fitted to entropy 5.35 / top-1 0.17); ms and peak MiB over inputs.
  neuzip     decode of a compressed 2048x8192 bf16 block (N(0, 0.02), lossless) vs ``copy_`` of its decoded
             bytes; GPU time (host path hidden) and per-call time.
  bitnet     fused activation quantizers (INT8, INT4, TopK+INT8) at width 4096 (16384 tokens), GB/s vs a copy;
             one training step of the 30m preset (batch 32 x 512, random tokens), a4.8 vs fp.
  shadowkv   one greedy decode step at batch 1, 32K context, Llama-3-8B shape (random bf16), benchmarks/
             shadowkv.py's code path *of the tree under test* (its DecodeStep/DenseAttention/ShadowKVAttention):
             ShadowKV vs dense, eager host wall time and CUDA-graph replay.
  e2e        transformers Llama-3.2-1B shape (random bf16 weights): prefill 8K (thrifty ``enable_hf`` vs SDPA),
             greedy decode ms/token after a 4K prompt, one training step (batch 1 x 2048, forward + backward, no
             optimizer) with thrifty attention + CCE (``patch_causal_lm``) vs CCE alone; host wall time per call.

Usage (GPU box; benchmarks/README.md has the whole recipe):

    git archive <old> | tar -x -C .base        # here (.base/ is git-ignored; carry it with .whl)
    THRIFTY_COMMIT=<new> bash benchmarks/run_on_gpu.sh benchmarks/regress.py --baseline .base --baseline-commit <old>
    python benchmarks/regress.py --smoke [--baseline DIR]    # CPU, tiny sizes, results to a temporary folder

Workers import thrifty only from the tree under test and use only public calls that exist at 6fd1441 (plus
``attn_kernel.sage_forward_triton`` and ``bitnet.quant_kernel.quantize_rows`` where present); they time with
their own CUDA-event code, never with the tree's ``thrifty.bench``. Every worker runs with
``TRITON_ALLOW_NON_CONSTEXPR_GLOBALS=1`` (the ShadowKV CUDA path of 6fd1441 does not compile without it).
Writes ``benchmarks/results/regress_<device>.json`` (``thrifty.bench`` schema) and a PNG of new/old ratios.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# Hard time limit of one worker (one section of one tree), seconds: the GPU figures expected are about half
# (first tree: Triton/inductor compile included; the second tree finds the compile caches warm).
SECTION_BUDGET_S = {"attention": 60, "cce": 100, "neuzip": 40, "bitnet": 50, "shadowkv": 60, "e2e": 75}
SMOKE_BUDGET_S = {name: 60 for name in SECTION_BUDGET_S}
SECTIONS = list(SECTION_BUDGET_S)
WORKER_ENV = {"TRITON_ALLOW_NON_CONSTEXPR_GLOBALS": "1", "PYTHONUNBUFFERED": "1"}


def _stamp() -> str:
    return datetime.datetime.now().strftime("%H:%M:%S")


# ================================================================================================ worker side
class Skip(Exception):
    """A subsection left out because the worker's time budget is spent."""


class Ctx:
    """What a section needs: device, sizes (GPU or smoke), the tree, a row sink and the soft deadline."""

    def __init__(self, args, torch):
        self.torch = torch
        self.smoke = args.smoke
        self.dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
        self.cuda = self.dev.type == "cuda"
        self.tree = Path(args.tree).resolve()
        self.label = args.label
        self.section = args.worker
        self.out = Path(args.out)
        self.t0 = time.time()
        self.deadline = self.t0 + args.soft_budget
        self.rows: list = []
        self.notes: dict = {}

    # ------------------------------------------------------------------------------------ bookkeeping
    def log(self, msg: str) -> None:
        print(f"[{_stamp()} +{time.time() - self.t0:5.1f}s] {self.section}/{self.label}: {msg}", flush=True)

    def left(self) -> float:
        return self.deadline - time.time()

    def guard(self, what: str, need_s: float = 0.0) -> None:
        if self.left() < need_s:
            raise Skip(f"skipped {what}: worker time budget spent ({self.left():.0f} s left)")

    def add(self, figure, unit, value, *, higher_is_better, anchor=None, kind="thrifty", **extra):
        row = dict(section=self.section, figure=figure, unit=unit, value=value, higher_is_better=higher_is_better,
                   anchor=anchor, kind=kind, **extra)
        self.rows.append(row)
        self.log(f"{figure} = {value:.4g} {unit}" + (f" (spread {extra['spread_pct']:.1f}%)"
                                                     if isinstance(extra.get("spread_pct"), float) else ""))
        self.flush()

    def error(self, figures, err) -> None:
        """Error rows for those of ``figures`` not measured yet."""
        done = {r["figure"] for r in self.rows}
        for f in ([figures] if isinstance(figures, str) else figures):
            if f not in done:
                self.rows.append(dict(section=self.section, figure=f, error=f"{type(err).__name__}: {err}"[:300]))
        self.log(f"{figures}: {type(err).__name__}: {err}"[:400])
        self.flush()

    def flush(self) -> None:
        """Rows so far to the output file: a worker killed at its time limit still leaves what it measured."""
        doc = dict(rows=self.rows, notes=self.notes, seconds=time.time() - self.t0, tree=str(self.tree),
                   label=self.label, device=self.dev.type)
        part = self.out.with_suffix(".part")
        part.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(part, self.out)  # whole files only, even when the worker is killed mid-write

    # --------------------------------------------------------------------------------------- timing
    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def free(self) -> None:
        import gc

        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def time_events(self, fn, sets=((),), *, warmup=3, reps=20, min_reps=3, budget_s=1.5, flush_l2=False,
                    gpu_only=False) -> dict:
        """Median ms of ``fn(*args)`` over CUDA events (perf_counter on the CPU), cycling over ``sets``.

        The last warm-up call is timed on the host to size ``reps`` to ``budget_s``. ``flush_l2`` overwrites
        L2 before each call; ``gpu_only`` queues a spin kernel first so that the events see GPU time only."""
        torch = self.torch
        sets = list(sets)
        if self.smoke:  # exercise the code, measure nothing
            warmup, reps, min_reps = 1, 1, 1
        for i in range(max(warmup - 1, 0)):
            fn(*sets[i % len(sets)])
        self.sync()
        t = time.perf_counter()
        fn(*sets[0])
        self.sync()
        per_call = max(time.perf_counter() - t, 1e-6)
        reps = max(min(reps, int(budget_s / per_call)), min_reps)
        times = []
        if self.cuda:
            flush = None
            if flush_l2:
                l2 = getattr(torch.cuda.get_device_properties(self.dev), "L2_cache_size", 0) or 64 << 20
                buf = torch.empty(2 * l2, dtype=torch.uint8, device=self.dev)
                flush = lambda: buf.fill_(1)  # noqa: E731
            spin = self._spin_cycles(fn, sets) if gpu_only else 0
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
            for i, (a, b) in enumerate(ev):
                if flush is not None:
                    flush()
                if spin:
                    torch.cuda._sleep(spin)
                a.record()
                fn(*sets[i % len(sets)])
                b.record()
            torch.cuda.synchronize()
            times = [a.elapsed_time(b) for a, b in ev]
        else:
            for i in range(reps):
                t = time.perf_counter()
                fn(*sets[i % len(sets)])
                times.append((time.perf_counter() - t) * 1e3)
        return _stats(times)

    def _spin_cycles(self, fn, sets) -> int:
        """Twice the host time of one call (GPU idle), 20 µs to 5 ms, in cycles at ~2 GHz."""
        host = []
        for i in range(3):
            self.sync()
            t = time.perf_counter()
            fn(*sets[i % len(sets)])
            host.append(time.perf_counter() - t)
        self.sync()
        return int(min(max(2 * sorted(host)[1], 20e-6), 5e-3) * 2e9)

    def time_wall(self, fn, *, warmup=2, reps=10, min_reps=3, budget_s=3.0) -> dict:
        """Median host wall ms per call, synchronized before and after each call (what a user waits)."""
        if self.smoke:
            warmup, reps, min_reps = 1, 1, 1
        for _ in range(max(warmup - 1, 0)):
            fn()
        times = []
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        per_call = max(time.perf_counter() - t, 1e-6)
        reps = max(min(reps, int(budget_s / per_call)), min_reps)
        for _ in range(reps):
            self.sync()
            t = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - t) * 1e3)
        return _stats(times)

    def peak_mib(self, fn):
        """Peak CUDA MiB allocated during ``fn()`` over what was allocated before (its inputs); None on CPU."""
        torch = self.torch
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del out
        return (peak - base) / 2**20


def _stats(times) -> dict:
    med = statistics.median(times)
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [med] * 9
    return dict(ms=med, spread_pct=100.0 * (q[-1] - q[0]) / med if med > 0 else 0.0, reps=len(times))


# --------------------------------------------------------------------------------------------- attention
ATTN_SHAPES = [  # tag, B, H, Hkv, S, D (GPU); all causal
    ("d64_gqa_8k", 4, 32, 8, 8192, 64),
    ("d64_mha_8k", 2, 32, 32, 8192, 64),
    ("d128_gqa_8k", 2, 32, 8, 8192, 128),
    ("d128_gqa_32k", 1, 32, 8, 32768, 128),
]
ATTN_SMOKE = {"d64_gqa_8k": (1, 2, 1, 32, 64), "d64_mha_8k": (1, 1, 1, 32, 64), "d128_gqa_8k": (1, 2, 1, 32, 128),
              "d128_gqa_32k": (1, 2, 1, 48, 128)}


def sec_attention(ctx: Ctx):
    torch = ctx.torch
    import torch.nn.functional as F

    import thrifty

    try:
        from thrifty.attention.attn_kernel import sage_forward_triton
    except ImportError as e:  # not in this tree: the public call is still timed
        sage_forward_triton = None
        ctx.notes["kernel_only"] = f"unavailable: {e}"
    if ctx.cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        anchor_name, anchor_ctx = "cudnn", lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION])
    else:
        import contextlib

        anchor_name, anchor_ctx = "sdpa (cpu)", contextlib.nullcontext
    for tag, B, H, Hkv, S, D in ATTN_SHAPES:
        if ctx.smoke:
            B, H, Hkv, S, D = ATTN_SMOKE[tag]
        shape = dict(B=B, H=H, Hkv=Hkv, S=S, D=D, causal=True)
        flops = 4 * B * H * S * S * D / 2
        fig, kfig = f"attn_{tag}_tflops", f"attn_{tag}_kernel_tflops"
        afig = f"attn_{tag}_{'cudnn' if ctx.cuda else 'sdpa'}_tflops"
        try:
            ctx.guard(tag, 5)
            g = torch.Generator(device=ctx.dev).manual_seed(0)
            mk = lambda h: torch.randn(B, h, S, D, generator=g, device=ctx.dev, dtype=torch.bfloat16)  # noqa: E731
            sets = [(mk(H), mk(Hkv), mk(Hkv)) for _ in range(2)]
        except Exception as e:  # noqa: BLE001 - an error row; the other shapes go on
            ctx.error([afig, fig, kfig], e)
            continue
        ref = None
        try:  # the anchor: cuDNN gets K/V repeated to H heads, outside the timed region
            dense = [(q, k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1))
                     for q, k, v in sets]
            with anchor_ctx():
                ref = F.scaled_dot_product_attention(*dense[0], is_causal=True)
                ta = ctx.time_events(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                     dense, warmup=3, reps=20)
            ctx.add(afig, "TFLOP/s", flops / ta["ms"] / 1e9, higher_is_better=True, kind="anchor",
                    label=anchor_name, **shape, **ta)
        except Exception as e:  # noqa: BLE001
            ctx.error(afig, e)
        dense = None
        try:
            out = thrifty.sage_attention(*sets[0], causal=True, impl="triton")
            cos = (None if ref is None
                   else F.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0).item())
            out = ref = None
            t = ctx.time_events(lambda q, k, v: thrifty.sage_attention(q, k, v, causal=True, impl="triton"), sets,
                                warmup=3, reps=20)
            ctx.add(fig, "TFLOP/s", flops / t["ms"] / 1e9, higher_is_better=True, anchor=afig,
                    label="sage_attention(impl='triton')", cos_vs_anchor=cos, **shape, **t)
        except Exception as e:  # noqa: BLE001
            ctx.error(fig, e)
        try:
            if sage_forward_triton is None:
                raise RuntimeError("thrifty.attention.attn_kernel.sage_forward_triton is not in this tree")
            ctx.guard(kfig, 2)
            tk = ctx.time_events(lambda q, k, v: sage_forward_triton(q, k, v, causal=True, sm_scale=D ** -0.5),
                                 sets, warmup=3, reps=20)
            ctx.add(kfig, "TFLOP/s", flops / tk["ms"] / 1e9, higher_is_better=True, anchor=afig,
                    label="attn_kernel.sage_forward_triton (no validation, no NaN pass)", **shape, **tk)
        except Exception as e:  # noqa: BLE001
            ctx.error(kfig, e)
        sets = None
        ctx.free()


# --------------------------------------------------------------------------------------------------- CCE
def cce_inputs(torch, N, D, V, dev, entropy=5.35, top1=0.17, seed=0):
    """benchmarks/cce.py's realistic synthetic regime: logits z = a·bias_j + s·noise, bias_j = -log(rank_j) (Zipf
    over a random token order), (a, s) fitted on 256 rows to the entropy and top-1 of real SmolLM2 logits
    (fitted here on fp32 logits); targets sampled from softmax(z). Returns e (N, D), c (V, D) bf16, targets."""
    g = torch.Generator(device=dev).manual_seed(seed)
    zipf = -torch.log(torch.randperm(V, generator=g, device=dev).float() + 1)
    base_e = torch.randn(N, D - 1, generator=g, device=dev) / math.sqrt(D - 1)
    base_c = torch.randn(V, D - 1, generator=g, device=dev)
    noise = base_e[:256] @ base_c.T
    best = None
    for a in torch.linspace(0.5, 2.0, 16).tolist():
        for s in torch.linspace(0.5, 4.0, 15).tolist():
            p = torch.softmax(a * zipf + s * noise, -1)
            ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean().item()
            t1 = p.max(-1).values.mean().item()
            err = (ent - entropy) ** 2 + (10 * (t1 - top1)) ** 2
            if best is None or err < best[0]:
                best = (err, a, s, ent, t1)
    _, a, s, ent, t1 = best
    del noise
    e = torch.cat([torch.ones(N, 1, device=dev), base_e * s], 1).bfloat16()
    c = torch.cat([zipf[:, None] * a, base_c], 1).bfloat16()
    del base_e, base_c
    targets = torch.empty(N, dtype=torch.long, device=dev)
    for i in range(0, N, 512):
        p = torch.softmax((e[i:i + 512] @ c.T).float(), -1)
        targets[i:i + 512] = torch.multinomial(p, 1, generator=g).squeeze(1)
    return e, c, targets, dict(a=a, s=s, entropy=ent, top1=t1)


def sec_cce(ctx: Ctx):
    torch = ctx.torch
    import torch.nn.functional as F

    import thrifty

    N, D, V = (256, 64, 512) if ctx.smoke else (8192, 2304, 256000)
    e, c, t, info = cce_inputs(torch, N, D, V, ctx.dev)
    ctx.notes["cce_inputs"] = dict(N=N, D=D, V=V, **info)
    ctx.log(f"inputs N={N} D={D} V={V}: entropy {info['entropy']:.2f} top1 {info['top1']:.3f}")
    naive = lambda e_, c_, t_: F.cross_entropy((e_ @ c_.T).float(), t_)  # noqa: E731
    impls = [("cce", "thrifty.linear_cross_entropy", "thrifty",
              lambda e_, c_, t_: thrifty.linear_cross_entropy(e_, c_, t_))]
    try:
        if not ctx.cuda:
            raise RuntimeError("apple cut_cross_entropy needs CUDA")
        from cut_cross_entropy import linear_cross_entropy as apple

        impls.append(("cce_apple", "apple cut_cross_entropy", "anchor", lambda e_, c_, t_: apple(e_, c_, t_)))
    except Exception as err:  # noqa: BLE001
        ctx.error(["cce_apple_loss_grad_ms", "cce_apple_peak_mib"], err)
    if ctx.smoke:  # inductor on 2 CPU cores takes longer than the whole smoke run
        impls.append(("cce_compile", "torch (eager: smoke)", "anchor", naive))
    else:  # last: its cold compile is the slowest part of the section
        impls.append(("cce_compile", "torch.compile(linear -> cross_entropy)", "anchor",
                      torch.compile(naive, dynamic=False)))
    with torch.no_grad():  # fp32 logits, 1024 rows at a time: each implementation's loss is checked against it
        ref_loss = sum(F.cross_entropy((e[i:i + 1024] @ c.T).float(), t[i:i + 1024], reduction="sum").item()
                       for i in range(0, N, 1024)) / N
    sets = [(e.clone().requires_grad_(), c.clone().requires_grad_(), t) for _ in range(2)]

    def loss_grad(fn, e_, c_, t_):
        e_.grad = c_.grad = None
        loss = fn(e_, c_, t_)
        loss.backward()
        return loss

    for prefix, label, kind, fn in impls:
        figs = [f"{prefix}_loss_grad_ms", f"{prefix}_peak_mib"]
        try:
            ctx.guard(prefix, 5)
            e_, c_, _ = sets[0]
            loss = loss_grad(fn, e_, c_, t).item()
            tm = ctx.time_events(lambda a, b, y: loss_grad(fn, a, b, y), sets, warmup=3, reps=10,
                                 budget_s=2.0)
            for s in sets:
                s[0].grad = s[1].grad = None
            peak = ctx.peak_mib(lambda: loss_grad(fn, e_, c_, t))
            e_.grad = c_.grad = None
            anchor = None if kind == "anchor" else "cce_compile_loss_grad_ms"
            ctx.add(figs[0], "ms", tm["ms"], higher_is_better=False, anchor=anchor, kind=kind, label=label,
                    loss=loss, loss_rel_diff=abs(loss - ref_loss) / abs(ref_loss), N=N, D=D, V=V, **tm)
            if peak is not None:
                ctx.add(figs[1], "MiB", peak, higher_is_better=False, kind=kind, label=label,
                        anchor=None if kind == "anchor" else "cce_compile_peak_mib",
                        lower_bound_mib=(N * D + V * D) * 2 / 2**20)
        except Exception as err:  # noqa: BLE001
            ctx.error(figs, err)
        ctx.free()
    ctx.notes["cce_ref_loss"] = ref_loss


# ------------------------------------------------------------------------------------------------- NeuZip
def sec_neuzip(ctx: Ctx):
    torch = ctx.torch
    import thrifty

    rows, cols = (64, 256) if ctx.smoke else (2048, 8192)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, cols, generator=g) * 0.02).bfloat16()
    t0 = time.time()
    ct = thrifty.compress(x)  # encoding runs on the CPU
    ctx.notes["neuzip_compress_s"] = time.time() - t0
    ctx.add("neuzip_ratio", "ratio", ct.nbytes / (x.numel() * 2), higher_is_better=False, label="compressed/original",
            shape=[rows, cols])
    ct = ct.to(ctx.dev)
    out = torch.empty(rows, cols, dtype=torch.bfloat16, device=ctx.dev)
    decode = lambda: ct.decompress(out=out, impl="triton")  # noqa: E731
    decode()
    exact = torch.equal(out.cpu().view(torch.int16), x.view(torch.int16))
    src = x.to(ctx.dev)
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731
    nbytes = x.numel() * 2
    warm, reps = 5, 100
    for suffix, gpu_only, unit in (("gbs", True, "GB/s"), ("call_us", False, "us")):
        figs = [f"neuzip_copy_{suffix}", f"neuzip_decode_{suffix}"]
        try:
            ctx.guard(suffix, 2)
            tc = ctx.time_events(copy, warmup=warm, reps=reps, flush_l2=True, gpu_only=gpu_only)
            td = ctx.time_events(decode, warmup=warm, reps=reps, flush_l2=True, gpu_only=gpu_only)
            what = ("GPU time (host path hidden by a spin kernel)" if gpu_only
                    else "events around each call (host path included)")
            val = (lambda tt: nbytes / tt["ms"] / 1e6) if gpu_only else (lambda tt: tt["ms"] * 1e3)
            ctx.add(figs[0], unit, val(tc), higher_is_better=gpu_only, kind="anchor",
                    label=f"copy_ {nbytes >> 20} MiB, {what}", **tc)
            ctx.add(figs[1], unit, val(td), higher_is_better=gpu_only, anchor=figs[0], label=f"decompress, {what}",
                    exact=exact, **td)
        except Exception as e:  # noqa: BLE001
            ctx.error(figs, e)


# ------------------------------------------------------------------------------------------------- BitNet
class _RandomTokens:
    """A stand-in for TokenDataset: ``batch(b, s, generator)`` of random token ids (speed does not read them)."""

    def __init__(self, vocab):
        self.vocab = vocab

    def batch(self, batch_size, seq_len, generator=None, **kw):
        import torch

        x = torch.randint(0, self.vocab, (batch_size, seq_len + 1), generator=generator)
        return x[:, :-1], x[:, 1:]


def _bitnet_config(bitnet, recipe: str, kernels: bool):
    """The recipe with the Triton quantizers ("auto") or the reference ones; the old tree (2fcb084) names the choice
    ``fused`` (True / False), the new one ``impl``."""
    if "impl" in bitnet.BitNetConfig.__dataclass_fields__:
        return bitnet.BitNetConfig(recipe=recipe, impl="auto" if kernels else "reference")
    return bitnet.BitNetConfig(recipe=recipe, fused=kernels)


def sec_bitnet(ctx: Ctx):
    torch = ctx.torch
    from thrifty import bitnet
    from thrifty.models import LlamaForCausalLM, preset
    from thrifty.train import Trainer, TrainConfig

    tokens, width = (8, 256) if ctx.smoke else (16384, 4096)
    x = torch.randn(tokens, width, device=ctx.dev, dtype=torch.bfloat16)
    moved = 2 * x.numel() * x.element_size()  # one read + one write
    warm, reps = 3, 30
    try:
        y = torch.empty_like(x)
        t = ctx.time_events(lambda: y.copy_(x), warmup=warm, reps=reps)
        ctx.add("bitnet_copy_gbs", "GB/s", moved / t["ms"] / 1e6, higher_is_better=True, kind="anchor",
                label=f"copy_ of the activations ({tokens}x{width} bf16)", **t)
    except Exception as e:  # noqa: BLE001
        ctx.error("bitnet_copy_gbs", e)
    try:
        from thrifty.bitnet.quant_kernel import quantize_rows
    except ImportError as e:
        quantize_rows = None
        ctx.error(["bitnet_int8_gbs", "bitnet_int4_gbs", "bitnet_topk_int8_gbs"], e)
    for kind in ("int8", "int4", "topk_int8") if quantize_rows else ():
        try:
            ctx.guard(kind, 2)
            t = ctx.time_events(lambda: quantize_rows(x, kind), warmup=warm, reps=reps)
            ctx.add(f"bitnet_{kind}_gbs", "GB/s", moved / t["ms"] / 1e6, higher_is_better=True,
                    anchor="bitnet_copy_gbs", label=f"quant_kernel.quantize_rows(x, {kind!r})", width=width, **t)
        except Exception as e:  # noqa: BLE001
            ctx.error(f"bitnet_{kind}_gbs", e)
    del x
    ctx.free()
    # one training step (forward, backward, clip, AdamW) of the bitnet_repro.py timing path, random tokens
    name, batch, seq = ("tiny", 2, 32) if ctx.smoke else ("30m", 32, 512)
    for recipe, kernels in (("fp", True), ("a4.8", True), ("a4.8", False)):
        fig = {"fp": "bitnet_fp_step_ms", "a4.8": "bitnet_a48_step_ms"}[recipe]
        if not kernels:  # the reference quantizers: only when the fused ones failed
            if any(r.get("figure") == fig and "value" in r for r in ctx.rows):
                continue
            fig = "bitnet_a48_reference_quantizers_step_ms"
        try:
            ctx.guard(fig, 5)
            torch.manual_seed(0)
            with torch.device(ctx.dev):
                cfg_model = preset(name, **({"vocab_size": 512} if ctx.smoke else {}))
                model = LlamaForCausalLM(cfg_model).init_weights(seed=0)
            if recipe != "fp":
                bitnet.build_for_pretraining(model, recipe)
                bitnet.convert(model, _bitnet_config(bitnet, recipe, kernels))
            cfg = TrainConfig(steps=1000, batch_size=batch, seq_len=seq, lr=1e-3, warmup_steps=10)
            trainer = Trainer(model, _RandomTokens(model.config.vocab_size), None, cfg)
            t = ctx.time_wall(trainer.train_step, warmup=3, reps=8,
                              budget_s=4.0)  # train_step ends with a host sync (float(grad norm))
            ctx.add(fig, "ms", t["ms"], higher_is_better=False, kind="anchor" if recipe == "fp" else "thrifty",
                    anchor=None if recipe == "fp" else "bitnet_fp_step_ms",
                    label=f"{name} preset, {recipe}{'' if kernels else ' (reference quantizers)'}, batch {batch}x{seq}",
                    **t)
            del trainer, model
        except Exception as e:  # noqa: BLE001
            ctx.error(fig, e)
        ctx.free()


# ----------------------------------------------------------------------------------------------- ShadowKV
def _load_tree_module(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def sec_shadowkv(ctx: Ctx):
    torch = ctx.torch
    from thrifty.kvcache import ShadowKVConfig

    skv = _load_tree_module(ctx.tree / "benchmarks" / "shadowkv.py", "tree_shadowkv_benchmark")
    shape = dict(skv.TINY if ctx.smoke else skv.LLAMA3_8B)
    T, reps, gen = (384, 2, 64) if ctx.smoke else (32768, 10, 64)
    model = skv.build_model(shape, ctx.dev)
    c = model.config
    L, H, D = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    base = dict(skv.PAPER_CFG, sparse_budget=32 if ctx.smoke else 1024, max_generated=gen, min_prompt_len=min(T, 4096))
    if ctx.smoke:
        base.update(rank=32, outlier_chunks=4)
    cfg = ShadowKVConfig(**base)
    ctx.notes["shadowkv"] = dict(shape="TINY" if ctx.smoke else "LLAMA3_8B", context=T, batch=1, config=base)
    info = dict(context=T, batch=1, layers=L)
    steps = {}
    for method in ("dense", "shadowkv"):
        fig = f"shadowkv_{'dense_' if method == 'dense' else ''}step_ms"
        try:
            ctx.guard(method, 5)
            if method == "dense":
                att = skv.DenseAttention(L, 1, H, D, T, gen + 8, ctx.dev, splits=max(8, T // 2048))
                step = skv.DecodeStep(model, 1, T, att, ctx.dev)
            else:
                step = skv.DecodeStep(model, 1, T, None, ctx.dev)
                att = skv.ShadowKVAttention(L, 1, H, D, T, cfg, ctx.dev, step.cos, step.sin)
                step.attention = att
            t = ctx.time_wall(step, warmup=3, reps=reps, budget_s=3.0)
            extra = dict(hit_rate=att.hit_rate()) if method == "shadowkv" else {}
            ctx.add(fig, "ms", t["ms"], higher_is_better=False, kind="anchor" if method == "dense" else "thrifty",
                    anchor=None if method == "dense" else "shadowkv_dense_step_ms",
                    label=f"{method} decode step, eager, host wall", **info, **extra, **t)
            steps[method] = (step, att)
        except Exception as e:  # noqa: BLE001
            ctx.error(fig, e)
    for method, (step, att) in steps.items() if ctx.cuda else ():  # CUDA graphs: last (a failed capture may
        fig = f"shadowkv_{'dense_' if method == 'dense' else ''}graph_step_ms"  # leave the context unusable)
        try:
            ctx.guard(f"{method} graph", 5)
            # thrifty.bench.capture_graph's recipe, written out: workers use no thrifty.bench (module docstring)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            t = ctx.time_events(graph.replay, warmup=2, reps=reps, budget_s=2.0)
            ctx.add(fig, "ms", t["ms"], higher_is_better=False, kind="anchor" if method == "dense" else "thrifty",
                    anchor=None if method == "dense" else "shadowkv_dense_graph_step_ms",
                    label=f"{method} decode step, CUDA graph replay", **info, **t)
        except Exception as e:  # noqa: BLE001
            ctx.error(fig, e)


# ------------------------------------------------------------------------------------ transformers end to end
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0)
LLAMA_SMOKE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, vocab_size=512)


def sec_e2e(ctx: Ctx):
    torch = ctx.torch
    import transformers
    from transformers import DynamicCache

    from thrifty.attention import disable_hf, enable_hf
    from thrifty.loss.hf import patch_causal_lm

    shape = LLAMA_SMOKE if ctx.smoke else LLAMA_1B
    S_prefill, S_prompt, S_train = (64, 32, 64) if ctx.smoke else (8192, 4096, 2048)
    cfg = transformers.LlamaConfig(**shape, max_position_embeddings=32768, attn_implementation="sdpa",
                                   tie_word_embeddings=False)
    with torch.device(ctx.dev):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    ctx.notes["e2e_model"] = dict(shape=shape, weights="random init, bf16", batch=1)
    ctx.log("model built")
    V = cfg.vocab_size
    g = torch.Generator(device=ctx.dev).manual_seed(0)

    def switch(which):
        (enable_hf if which == "thrifty" else disable_hf)(model)

    # prefill: no cache, logits of the last position only
    ids = torch.randint(0, V, (1, S_prefill), generator=g, device=ctx.dev)
    for which in ("sdpa", "thrifty"):
        fig = "e2e_prefill_8k_ms" if which == "thrifty" else "e2e_prefill_8k_sdpa_ms"
        try:
            ctx.guard(fig, 5)
            switch(which)
            with torch.no_grad():
                t = ctx.time_wall(lambda: model(ids, use_cache=False, logits_to_keep=1), warmup=2,
                                  reps=6, budget_s=3.0)
            ctx.add(fig, "ms", t["ms"], higher_is_better=False, kind="anchor" if which == "sdpa" else "thrifty",
                    anchor="e2e_prefill_8k_sdpa_ms" if which == "thrifty" else None, S=S_prefill,
                    label=f"prefill {S_prefill} tokens, {which} attention", **t)
        except Exception as e:  # noqa: BLE001
            ctx.error(fig, e)
        finally:
            disable_hf(model)
        ctx.free()
    # greedy decode after a prompt, stock DynamicCache (thrifty routes 1-16-row queries to SDPA)
    prompt = torch.randint(0, V, (1, S_prompt), generator=g, device=ctx.dev)
    n_warm, n_steps = (1, 1) if ctx.smoke else (3, 8)
    # Two rounds, only the second recorded: in one round the first method measured paid for the process's first
    # decode (SDPA at 77-92 ms/token beside thrifty's 17 ms, both on the same SDPA route, run of 2026-11-24).
    rounds = [("sdpa", False), ("thrifty", False)] * (0 if ctx.smoke else 1) + [("sdpa", True), ("thrifty", True)]
    for which, record in rounds:
        fig = "e2e_decode_4k_ms_per_token" if which == "thrifty" else "e2e_decode_4k_sdpa_ms_per_token"
        try:
            ctx.guard(fig, 5)
            switch(which)
            with torch.no_grad():
                cache = DynamicCache()
                tok = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
                for _ in range(n_warm):
                    tok = model(tok, past_key_values=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
                times = []
                for _ in range(n_steps):
                    ctx.sync()
                    t0 = time.perf_counter()
                    tok = model(tok, past_key_values=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
                    ctx.sync()
                    times.append((time.perf_counter() - t0) * 1e3)
            if record:
                ctx.add(fig, "ms", statistics.median(times), higher_is_better=False,
                        kind="anchor" if which == "sdpa" else "thrifty",
                        anchor="e2e_decode_4k_sdpa_ms_per_token" if which == "thrifty" else None, prompt=S_prompt,
                        label=f"greedy decode after {S_prompt} tokens, {which} attention, DynamicCache",
                        **_stats(times))
            del cache
        except Exception as e:  # noqa: BLE001
            ctx.error(fig, e)
        finally:
            disable_hf(model)
        ctx.free()
    # one training step: forward with labels (CCE, logits never built) + backward; no optimizer
    try:
        patch_causal_lm(model)
        model.train()
    except Exception as e:  # noqa: BLE001
        ctx.error(["e2e_train_2k_cce_only_ms", "e2e_train_2k_ms"], e)
        return
    ids = torch.randint(0, V, (1, S_train), generator=g, device=ctx.dev)

    def train_step():
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    # Two rounds here too, only the second recorded: on 2026-11-25 (H200) the first-measured CCE-only step read
    # 65 ms in the new tree against 45 ms in the old, while thrifty attention + CCE read 53 ms after it.
    rounds = [("sdpa", False), ("thrifty", False)] * (0 if ctx.smoke else 1) + [("sdpa", True), ("thrifty", True)]
    for which, record in rounds:
        fig = "e2e_train_2k_ms" if which == "thrifty" else "e2e_train_2k_cce_only_ms"
        try:
            ctx.guard(fig, 5)
            switch(which)
            t = ctx.time_wall(train_step, warmup=2, reps=6, budget_s=4.0)
            if record:
                ctx.add(fig, "ms", t["ms"], higher_is_better=False, kind="anchor" if which == "sdpa" else "thrifty",
                        anchor="e2e_train_2k_cce_only_ms" if which == "thrifty" else None, S=S_train,
                        label=f"train step 1x{S_train}, CCE loss, {which} attention", **t)
        except Exception as e:  # noqa: BLE001
            ctx.error(fig, e)
        finally:
            disable_hf(model)
        ctx.free()


SECTION_FNS = {"attention": sec_attention, "cce": sec_cce, "neuzip": sec_neuzip, "bitnet": sec_bitnet,
               "shadowkv": sec_shadowkv, "e2e": sec_e2e}


def worker_main(args) -> int:
    if sys.path and Path(sys.path[0]).resolve() == HERE:  # benchmarks/*.py must not shadow modules
        sys.path.pop(0)
    import torch

    import thrifty

    ctx = Ctx(args, torch)
    src = (ctx.tree / "src").resolve()
    where = Path(thrifty.__file__).resolve()
    ctx.notes.update(thrifty_file=str(where), torch=torch.__version__, pid=os.getpid(),
                     env={k: os.environ.get(k) for k in ("TRITON_ALLOW_NON_CONSTEXPR_GLOBALS", "TRITON_INTERPRET")})
    if src not in where.parents:
        ctx.error(f"{ctx.section}_import", RuntimeError(f"thrifty imported from {where}, not from {src}"))
        return 3
    if ctx.cuda:
        ctx.notes["gpu"] = torch.cuda.get_device_name(0)
    ctx.log(f"thrifty from {where.parent}, device {ctx.dev}")
    try:
        SECTION_FNS[ctx.section](ctx)
    except Exception as e:  # noqa: BLE001 - set-up failed (inputs, model): one error row for the section
        ctx.error(f"{ctx.section}_setup", e)
    ctx.flush()
    ctx.log(f"done in {time.time() - ctx.t0:.1f} s")
    return 0


# ============================================================================================ orchestrator side
def worker_env(tree: Path, trees: list, smoke: bool) -> dict:
    """The parent's environment with ``<tree>/src`` first on PYTHONPATH and every other tree's src removed."""
    env = dict(os.environ)
    others = {str((t / "src").resolve()) for t in trees}
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and str(Path(p).resolve()) not in others]
    env["PYTHONPATH"] = os.pathsep.join([str((tree / "src").resolve())] + kept)
    env.update(WORKER_ENV)
    if smoke:
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_worker(section, label, tree, trees, timeout_s, args, tmp) -> dict:
    out = Path(tmp) / f"{section}_{label}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", section, "--tree", str(tree), "--label", label,
           "--out", str(out), "--soft-budget", f"{max(timeout_s * 0.85 - 5, 1):.0f}"]
    cmd += ["--smoke"] if args.smoke else []
    print(f"[{_stamp()}] == {section} / {label} ({tree}), limit {timeout_s:.0f} s", flush=True)
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=worker_env(tree, trees, args.smoke), cwd=str(tree), start_new_session=True)
    status = None
    try:
        rc = proc.wait(timeout=timeout_s)
        if rc != 0:
            status = f"worker exited with {rc}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker and whatever it started (inductor compile workers)
        proc.wait()
        status = f"killed at its time limit ({timeout_s:.0f} s)"
    wall = time.time() - t0
    doc = json.loads(out.read_text()) if out.is_file() else {"rows": [], "notes": {}}
    if status:
        doc["rows"].append(dict(section=section, figure=f"{section}_worker", error=status))
    doc.update(section=section, label=label, wall_s=wall, status=status or "ok")
    print(f"[{_stamp()}] == {section} / {label}: {wall:.1f} s, {status or 'ok'}", flush=True)
    return doc


def merge(runs: list) -> list:
    """One row per figure: old, new (mean of the new runs when repeated), ratios, spreads."""
    order, by = [], {}
    for run in runs:
        for r in run["rows"]:
            f = r["figure"]
            if f not in by:
                order.append(f)
                by[f] = {}
            by[f].setdefault(run["label"], r)
    rows = []
    for f in order:
        got = by[f]
        first = next(iter(got.values()))
        row = dict(section=first["section"], figure=f)
        meta = next((r for r in got.values() if "value" in r), first)
        row.update(unit=meta.get("unit"), kind=meta.get("kind"), label=meta.get("label"), anchor=meta.get("anchor"),
                   higher_is_better=meta.get("higher_is_better"))
        val = {lab: r["value"] for lab, r in got.items() if isinstance(r.get("value"), (int, float))}
        news = [val[lab] for lab in ("new", "new2") if lab in val]
        row["old"] = val.get("old")
        row["new"] = statistics.fmean(news) if news else None
        if len(news) == 2:
            row["new_runs"] = news
            row["aba_pct"] = 100 * abs(news[1] - news[0]) / row["new"] if row["new"] else None
        spreads = [r["spread_pct"] for r in got.values() if isinstance(r.get("spread_pct"), (int, float))]
        row["spread_pct"] = max(spreads) if spreads else None
        if row["old"] and row["new"] is not None:
            row["new_over_old"] = row["new"] / row["old"]
            r = row["new_over_old"]
            row["change_pct"] = 100 * ((r - 1) if row["higher_is_better"] else (1 / r - 1)) if r else None
        errors = {lab: r["error"] for lab, r in got.items() if "error" in r}
        if errors:
            row["error"] = "; ".join(f"{lab}: {e}" for lab, e in errors.items())
        rows.append(row)
    by_fig = {r["figure"]: r for r in rows}
    for row in rows:  # value / anchor, per tree (the anchor measured in the same worker)
        a = by_fig.get(row["anchor"]) if row.get("anchor") else None
        if a:
            for side in ("old", "new"):
                if row.get(side) is not None and a.get(side):
                    row[f"{side}_vs_anchor"] = row[side] / a[side]
    return rows


def _short_anchor(row) -> str:
    """The words of the anchor's key that the figure's key lacks: attn_d64_gqa_8k_cudnn_tflops -> cudnn."""
    if not row.get("anchor"):
        return "(anchor)" if row.get("kind") == "anchor" else ""
    mine = set(row["figure"].split("_"))
    return "_".join(w for w in row["anchor"].split("_") if w not in mine) or row["anchor"]


def plot_ratios(rows, path: Path, title: str) -> Path | None:
    """Horizontal bars of new/old per figure on a log axis: green better, red worse, grey anchors (drift)."""
    good = [r for r in rows if isinstance(r.get("new_over_old"), float) and r["new_over_old"] > 0]
    if not good:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 0.28 * len(good) + 1.6), dpi=120)
    ys = list(range(len(good)))
    colors = ["0.6" if r.get("kind") == "anchor" else "tab:green" if (r.get("change_pct") or 0) >= 0 else "tab:red"
              for r in good]
    ratios = [r["new_over_old"] for r in good]
    ax.barh(ys, [x - 1 for x in ratios], left=1, color=colors)
    for y, x in zip(ys, ratios):
        ax.annotate(f"{x:.3f}", (x, y), xytext=(3 if x >= 1 else -3, 0), textcoords="offset points",
                    ha="left" if x >= 1 else "right", va="center", fontsize=6)
    ax.axvline(1, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    lo, hi = min(ratios + [0.8]), max(ratios + [1.25])
    ax.set_xlim(lo / 1.15, hi * 1.15)
    ticks = [t for t in (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0) if lo / 1.15 <= t <= hi * 1.15]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    which = lambda r: ("anchor" if r.get("kind") == "anchor"  # noqa: E731
                       else "higher" if r["higher_is_better"] else "lower")
    ax.set_yticks(ys, [f"{r['figure']} ({which(r)})" for r in good], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("new / old (log scale; green better, red worse, grey: anchor = drift between workers)")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def orchestrate(args) -> int:
    sys.path.insert(0, str(ROOT / "src"))  # the harness of this (the new) tree
    from thrifty import bench

    t_start = time.time()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTION_FNS]
    if unknown:
        raise SystemExit(f"--sections: unknown {unknown}, expected some of {SECTIONS}")
    repeat = [s for s in args.repeat.split(",") if s.strip() in sections] if args.baseline else []
    trees = [("new", ROOT)]
    if args.baseline:
        base = Path(args.baseline).resolve()
        if not (base / "src" / "thrifty" / "__init__.py").is_file():
            raise SystemExit(f"--baseline: {base} has no src/thrifty (expected a `git archive` of a commit)")
        trees.append(("old", base))
    tree_dirs = [t for _, t in trees]
    budgets = SMOKE_BUDGET_S if args.smoke else SECTION_BUDGET_S
    plan = [(s, lab, tree) for s in sections for lab, tree in trees] + [(s, "new2", ROOT) for s in repeat]
    deadline = t_start + args.budget_s
    print(f"[{_stamp()}] regress: {len(plan)} worker runs, total budget {args.budget_s:.0f} s; trees: "
          + ", ".join(f"{lab}={tree}" for lab, tree in trees), flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="regress_") as tmp:
        for section, label, tree in plan:
            left = deadline - time.time()
            limit = min(budgets[section], left)
            if label == "new2" and left < budgets[section]:  # a repeat only with its whole budget left
                print(f"[{_stamp()}] == {section} / new2: skipped ({left:.0f} s left)", flush=True)
                continue
            if limit < 15:
                runs.append(dict(section=section, label=label, wall_s=0.0, status="skipped: total budget spent",
                                 rows=[dict(section=section, figure=f"{section}_worker",
                                            error="skipped: total time budget spent")], notes={}))
                print(f"[{_stamp()}] == {section} / {label}: skipped ({left:.0f} s left)", flush=True)
                continue
            runs.append(run_worker(section, label, tree, tree_dirs, limit, args, tmp))
    rows = merge(runs)
    summary = {}
    for r in rows:
        if r.get("new") is not None:
            summary[r["figure"]] = r["new"]
            if r.get("new_over_old") is not None:
                summary[f"{r['figure']}_vs_baseline"] = r["new_over_old"]
    wall = {f"{r['section']}/{r['label']}": round(r["wall_s"], 1) for r in runs}
    extra = dict(
        baseline=str(Path(args.baseline).resolve()) if args.baseline else None, baseline_commit=args.baseline_commit,
        smoke=args.smoke, sections=sections, repeated=repeat, section_wall_s=wall,
        total_wall_s=round(time.time() - t_start, 1), worker_env=WORKER_ENV,
        trees={lab: [dict(section=r["section"], wall_s=r["wall_s"], status=r["status"], notes=r.get("notes"),
                          rows=r["rows"]) for r in runs if r["label"] == lab] for lab in ("new", "old", "new2")},
        notes=["each section of each tree ran in its own subprocess with PYTHONPATH=<tree>/src",
               "order: per section new then old; repeated sections ran new again at the end (new = mean of the "
               "two new runs, aba_pct = their difference)",
               "spread_pct: largest (p90-p10)/median of the runs; change_pct > 0 means the new tree is better",
               "e2e and bitnet/shadowkv models have random weights; times do not depend on the values"])
    device = "cpu" if args.smoke else None
    path = bench.write_result("regress", rows, summary, device=device, extra=extra, results_dir=args.out)
    title = (f"new/old, {path.stem}" + (f" (baseline {args.baseline_commit})" if args.baseline_commit else ""))
    plot_ratios(rows, path.with_suffix(".png"), title)
    table = []
    for r in rows:
        table.append(dict(figure=r["figure"], unit=r.get("unit"), anchor=_short_anchor(r),
                          old=r.get("old"), new=r.get("new"), **{"new/old": r.get("new_over_old")},
                          **{"better%": r.get("change_pct"), "old/anchor": r.get("old_vs_anchor"),
                             "new/anchor": r.get("new_vs_anchor"), "spread%": r.get("spread_pct"),
                             "aba%": r.get("aba_pct"), "error": r.get("error")}))
    print(f"\nsection wall times (s): {wall}; total {time.time() - t_start:.0f} s")
    bench.print_table(table, max_width=70)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default=None, help="a `git archive` of the old commit, extracted (e.g. .base)")
    ap.add_argument("--baseline-commit", default=None, help="its commit, recorded in the result")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--repeat", default="attention", help="sections timed new again after old (ABA; if time is left)")
    ap.add_argument("--budget-s", type=float, default=None, help="total seconds (default 420 GPU, 600 smoke)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results; --smoke: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--label", default="new", help=argparse.SUPPRESS)
    ap.add_argument("--soft-budget", type=float, default=60.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.budget_s is None:
        args.budget_s = 600.0 if args.smoke else 420.0
    if args.smoke and args.out is None:
        args.out = tempfile.mkdtemp(prefix="regress_smoke_")
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
