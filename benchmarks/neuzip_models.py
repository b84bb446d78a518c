"""NeuZip inside models, in the shape of the paper's Tables 1 and 3 (arXiv 2410.20650).

(1) Training (Table 1): a Llama-shaped model of ~1.1B parameters (TinyLlama shape, SmolLM2 vocabulary), **random
    init** (honest for memory and speed, not for loss values), bf16 weights, activation checkpointing on every
    block (as in the paper), B 4 x T 1024. Rows: vanilla AdamW (torch fused, bf16 states as torch keeps them for
    bf16 weights, full logits); the same with thrifty's fused linear cross-entropy (CCE: no B*T*V logits); LOMO-style
    AdamW (thrifty.optim.lomo: each weight updated in its backward, no gradient kept) with bf16 or 8-bit
    block-quantized states, each without and with NeuZip lossless; LOMO SGD + NeuZip (the paper's setting). Every
    LOMO row uses CCE. Headline: LOMO AdamW 8-bit states + NeuZip vs vanilla AdamW (memory, speed), and its losses
    against LOMO AdamW 8-bit states without NeuZip (identical bits: lossless). Peak memory, iterations/s, the
    loss of every step. Memory arithmetic: NOTES.md ("In models: arithmetic for the goals").
(2) Inference (Table 3): a model trained here (``--checkpoint`` = a ``thrifty pretrain`` folder; without one a
    ``--preset`` model, 30m by default, is pre-trained here first, ``--train-steps``), bf16; or ``--checkpoint
    smollm2`` (the real SmolLM2-135M, Q4_1-distorted). NeuZip rows code the embedding and lm_head too
    (``NeuZipConfig(vocab=True)``; ``--no-vocab`` keeps them plain), and their memory is the whole model as it sits
    on the device (coded weights, decode buffers, launch tables, plain norms). Rows: bf16, NeuZip 7 (lossless) / 3 / 1 / 0
    bits, and per-block (64 weights along the input) INT8 and INT4 round-to-nearest (absmax scale) as reference
    points (weights fake-quantized: their perplexity is real, their memory is counted, their speed is not
    measured — no integer kernel here). Weight memory, tokens/s of a forward over a batch, validation perplexity.
(3) Per-block decode of the trained model's middle block: host time of one decode call, GPU time of the one
    launch against a copy of the same bf16 bytes (the 1B-class block: ``benchmarks/neuzip_decode.py``).
(4) Loss identity on real text: the trained model fine-tuned 8 steps on the corpus's train split with LOMO AdamW
    8-bit states, without and with NeuZip lossless, deterministic kernels (``train_loss_identical_real_text``).

    python benchmarks/neuzip_models.py [--checkpoint DIR] [--skip-train | --skip-infer --suffix=-train] [--smoke]
    python benchmarks/neuzip_models.py --cpu-accuracy DIR   # CPU: perplexity + memory only (no speed)

``--smoke``: tiny sizes on the CPU (writes ``neuzip_models_smoke.json``; not a result).

Loss identity on the GPU. The backward is not deterministic run to run (SDPA's flash backward adds dQ with
atomics), and Adam's first step is ~lr·sign(g), so the noise moves the second loss by ~1e-3: at a305afd the
four AdamW rows, whose first steps are the same arithmetic (zero states decode to zero in 8 bits too), gave four
different second losses. So the training part also runs "LOMO AdamW (repeat)" (run-to-run control) and, with
``--check-identity``, the NeuZip pairs again under ``torch.use_deterministic_algorithms(True)``: those rows must
give equal losses (``train_loss_identical_deterministic*``). Every row also gets one profiled step after the
timed ones (``phase_*``: host and GPU ms of the forward, backward, NeuZip decodes and re-encodes, fused updates,
and the synchronizing calls counted by torch's sync debug mode).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import sys
import time

import torch

from thrifty import bench
from thrifty.models import LlamaConfig, LlamaForCausalLM, preset
from thrifty.neuzip import NeuZipConfig, compress_model
from thrifty.optim import LomoConfig, lomo

TRAIN_SHAPE = dict(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                   num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                   tie_word_embeddings=True, rope_theta=10000.0)
SMOKE_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   tie_word_embeddings=True, rope_theta=10000.0)
INT_BLOCK = 64
CONTROL = "LOMO AdamW (repeat)"  # the same row again: run-to-run noise of the GPU backward
VANILLA_AGAIN = "vanilla AdamW (repeat, speed only)"  # timed last: the box's drift over the run
DETERMINISTIC = " [deterministic]"
FRESH_CODES = " [fresh code every step]"  # NeuZipConfig(reuse_code=False): the re-encode before code reuse
IDENTITY_PAIRS = ("LOMO AdamW", "LOMO AdamW + NeuZip lossless", "LOMO AdamW 8-bit states",
                  "LOMO AdamW 8-bit states + NeuZip lossless")


# ---------------------------------------------------------------------------------------------- training
class Checkpointed(torch.nn.Module):
    """Activation checkpointing of one block (non-reentrant, so hooks and the NeuZip decode compose)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, *args, use_reentrant=False)


def _train_model(shape, device, seed=0):
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape))
    model.init_weights(seed=seed)
    return model.to(torch.bfloat16)


def _checkpoint_blocks(model):
    for i, block in enumerate(model.model.layers):
        model.model.layers[i] = Checkpointed(block)


class PhaseProfile:
    """One training step split into phases: host ms, main-stream GPU ms (CUDA events) and synchronizing calls
    (torch.cuda sync debug mode, CUDA only) of NeuZip's block decodes and re-encodes (``model.neuzip.observe``, the
    library's instrumentation hook) and of the fused updates (``FusedOptimizer.update`` wrapped), for the one
    profiled step; the forward and backward spans around them."""

    PHASES = ("decode", "reencode", "update")

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.host = {name: 0.0 for name in self.PHASES}
        self.calls = dict.fromkeys(self.host, 0)
        self.syncs = dict.fromkeys(self.host, 0)
        self.spans: dict = {name: [] for name in self.host}
        self.log: list = []  # the sync warnings of the step
        self.peak, self.peak_at = 0, None  # the step's allocation peak and the first phase call that reached it

    def note_peak(self, name, what) -> None:
        """Where the step's peak is: the phase call after which max_memory_allocated last rose (a host read, no
        sync). ``what``: the call's subject (the parameter's name for an update, the block for NeuZip)."""
        if not self.cuda:
            return
        peak = torch.cuda.max_memory_allocated()
        if peak > self.peak:
            what = what if isinstance(what, (str, int)) else ""
            self.peak, self.peak_at = peak, f"{name} {what}".strip()

    def event(self):
        """A recorded CUDA event (None on the CPU)."""
        if not self.cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    @contextlib.contextmanager
    def phase(self, name, what=None):
        """Times one call of phase ``name`` (host, GPU span, syncs, calls, peak)."""
        n0, e0, t0 = len(self.log), self.event(), time.perf_counter()
        try:
            yield
        finally:
            self.host[name] += time.perf_counter() - t0
            self.spans[name].append((e0, self.event()))
            self.syncs[name] += len(self.log) - n0
            self.calls[name] += 1
            self.note_peak(name, what)

    def step(self, step_fn, x, y, neuzip=None) -> dict:
        """``step_fn(x, y)`` profiled; ``neuzip``: the model's ``model.neuzip`` (None for a plain model)."""
        import warnings

        from thrifty.optim import FusedOptimizer

        update = FusedOptimizer.update  # a public method, wrapped for this step only
        prof = self

        def timed_update(opt, name, *args, **kwargs):
            with prof.phase("update", name):
                return update(opt, name, *args, **kwargs)

        with contextlib.ExitStack() as stack:
            if neuzip is not None:
                stack.enter_context(neuzip.observe(self.phase))
            FusedOptimizer.update = timed_update
            stack.callback(setattr, FusedOptimizer, "update", update)
            try:
                with warnings.catch_warnings(record=True) as log:
                    warnings.simplefilter("always")
                    self.log = log
                    if self.cuda:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        torch.cuda.set_sync_debug_mode("warn")
                    t0, e0 = time.perf_counter(), self.event()
                    step_fn(x, y)
                    host_enqueue = time.perf_counter() - t0
                    e1 = self.event()
                    if self.cuda:
                        torch.cuda.set_sync_debug_mode("default")
                        torch.cuda.synchronize()
                    wall = time.perf_counter() - t0
                    syncs = sum(1 for w in log if "synchroniz" in str(w.message))
            finally:
                if self.cuda:
                    torch.cuda.set_sync_debug_mode("default")
        out = {"phase_step_ms": wall * 1e3, "phase_host_enqueue_ms": host_enqueue * 1e3, "phase_syncs": syncs}
        if self.cuda:
            out["phase_gpu_span_ms"] = e0.elapsed_time(e1)
            out["phase_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            out["phase_peak_after"] = self.peak_at if self.peak == torch.cuda.max_memory_allocated() else \
                f"between wrapped calls, after {self.peak_at}"
        for name in self.host:
            if not self.calls[name]:
                continue
            out[f"phase_{name}_calls"] = self.calls[name]
            out[f"phase_{name}_host_ms"] = self.host[name] * 1e3
            if self.cuda:
                out[f"phase_{name}_gpu_ms"] = sum(a.elapsed_time(b) for a, b in self.spans[name])
                out[f"phase_{name}_syncs"] = self.syncs[name]
        return out


def _split_step(model, adam):
    """A step with the forward and backward timed apart (CUDA events; host ms on the CPU) for the profile."""
    spans = {}

    def step_fn(x, y):
        cuda = x.is_cuda
        marks = []
        for phase in ("forward", "backward", "optimizer"):
            marks.append((phase, time.perf_counter(), _record() if cuda else None))
            if phase == "forward":
                loss = model(x, labels=y)
                if cuda:  # the peak before backward (the profiled step resets the peak first)
                    spans["phase_peak_forward_gib"] = torch.cuda.max_memory_allocated() / 2**30
            elif phase == "backward":
                loss.backward()
            elif adam is not None:
                adam.step()
                adam.zero_grad(set_to_none=True)
        marks.append(("end", time.perf_counter(), _record() if cuda else None))
        for (phase, t0, e0), (_, t1, e1) in zip(marks, marks[1:]):
            spans[f"phase_{phase}_host_ms"] = (t1 - t0) * 1e3
            if cuda:
                spans[f"phase_{phase}_gpu_events"] = (e0, e1)
        return loss.detach()

    return step_fn, spans


def _record():
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def profile_step(model, adam, device, x, y) -> dict:
    """The phase columns of one extra (untimed) training step."""
    step_fn, spans = _split_step(model, adam)
    out = PhaseProfile(device.type == "cuda").step(step_fn, x, y, getattr(model, "neuzip", None))
    for key, value in spans.items():
        if key.endswith("_gpu_events"):
            out[key.replace("_events", "_ms")] = value[0].elapsed_time(value[1])
        else:
            out[key] = value
    return out


def _lomo_config(optimizer: str, state_dtype: torch.dtype) -> LomoConfig:
    """The LOMO settings of every training row (Table 1 and the real-text identity pair)."""
    return LomoConfig(optimizer=optimizer, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, state_dtype=state_dtype)


def _deterministic(on: bool) -> None:
    """Deterministic kernels for the identity rows (flash attention's backward without atomics, cuBLAS with a
    fixed workspace); uninitialized memory is not filled (only the speed would change)."""
    import os

    import torch.utils.deterministic

    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)
    torch.utils.deterministic.fill_uninitialized_memory = not on


def train_rows(args, device):
    shape = SMOKE_SHAPE if args.smoke else TRAIN_SHAPE
    steps, warm = (3, 1) if args.smoke else (args.train_iters, 2)
    seq, bsz = (32, 2) if args.smoke else (1024, args.train_batch)
    bf16, int8 = torch.bfloat16, torch.int8  # LOMO AdamW state dtypes (int8: block-quantized 8-bit states)
    # (name, optimizer, LOMO, NeuZip, state dtype, fused linear cross-entropy). Vanilla is plain torch training
    # (full logits); the thrifty rows use the fused loss, so "vanilla AdamW + CCE" shows its share apart.
    variants = [("vanilla AdamW", "adamw", False, False, bf16, False),
                ("vanilla AdamW + CCE", "adamw", False, False, bf16, True),
                ("LOMO AdamW", "adamw", True, False, bf16, True),
                (CONTROL, "adamw", True, False, bf16, True),
                ("LOMO AdamW + NeuZip lossless", "adamw", True, True, bf16, True),
                ("LOMO AdamW 8-bit states", "adamw", True, False, int8, True),
                ("LOMO AdamW 8-bit states + NeuZip lossless", "adamw", True, True, int8, True),
                ("LOMO AdamW 8-bit states + NeuZip lossless" + FRESH_CODES, "adamw", True, True, int8, True),
                ("LOMO SGD + NeuZip lossless", "sgd", True, True, bf16, True),
                (VANILLA_AGAIN, "adamw", False, False, bf16, False)]
    if args.smoke:  # the smoke test runs every code path once, not every row
        variants = [v for v in variants if v[0] in ("vanilla AdamW", VANILLA_AGAIN, "LOMO AdamW 8-bit states",
                                                    "LOMO AdamW 8-bit states + NeuZip lossless")]
    if args.check_identity:  # the NeuZip pairs again, deterministic kernels (see the module docstring)
        variants += [(v[0] + DETERMINISTIC,) + v[1:] for v in variants if v[0] in IDENTITY_PAIRS]
    rows, losses = [], {}
    for name, opt_name, use_lomo, neuzip, state_dtype, cce in variants:
        _deterministic(name.endswith(DETERMINISTIC))
        row = {"part": "train", "variant": name, "params_m": None}
        model = opt = adam = step_fn = batches = None
        try:
            model = _train_model(shape, device)
            row["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
            cfg = _lomo_config(opt_name, state_dtype)
            if cce:
                from thrifty.loss import linear_cross_entropy

                model.set_loss(lambda h, w, y: linear_cross_entropy(h, w, y))
            if neuzip:
                compress_model(model, config=NeuZipConfig(reuse_code=not name.endswith(FRESH_CODES)))
                row["weights_ratio_vs_bf16"] = model.neuzip.memory()["ratio_vs_bf16"]
            _checkpoint_blocks(model)
            adam = None if use_lomo else torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                                           weight_decay=0.0, fused=device.type == "cuda")
            opt = lomo(model, cfg) if use_lomo else None

            def step_fn(x, y):
                loss = model(x, labels=y)
                loss.backward()  # LOMO: every update happens in here
                if adam is not None:
                    adam.step()
                    adam.zero_grad(set_to_none=True)
                return loss.detach()
            g = torch.Generator().manual_seed(0)
            batches = [torch.randint(0, shape["vocab_size"], (bsz, seq + 1), generator=g) for _ in range(steps)]
            if device.type == "cuda":  # the peak of training, not of building (the bf16 model before compression)
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                row["setup_allocated_gib"] = torch.cuda.memory_allocated(device) / 2**30
            step_losses, t0 = [], None
            for i, b in enumerate(batches):
                if i == warm:
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                x, y = b[:, :-1].to(device), b[:, 1:].to(device)
                step_losses.append(step_fn(x, y))
            if device.type == "cuda":
                torch.cuda.synchronize()
            row["it_per_s"] = (steps - warm) / (time.perf_counter() - t0)
            if device.type == "cuda":
                row["timed_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30  # before the profiled step
            row.update(profile_step(model, adam, device, batches[-1][:, :-1].to(device), batches[-1][:, 1:].to(device)))
            step_losses = [float(v) for v in step_losses]
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            row["loss_first"], row["loss_last"] = step_losses[0], step_losses[-1]
            losses[name] = step_losses
            if use_lomo:
                row["optimizer_state_gib"] = opt.state_bytes / 2**30
            if neuzip:  # how many re-encodes kept their block's code (NeuZipConfig.reuse_code)
                st = model.neuzip.stats
                row["code_reuse_fraction"] = st["code_reuses"] / max(1, st["code_reuses"] + st["code_builds"])
        except Exception as err:  # a failing variant (OOM) keeps its row
            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        # free this variant completely before the next one's peak is measured
        _deterministic(False)
        model = opt = adam = step_fn = batches = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            row["left_allocated_mib"] = torch.cuda.memory_allocated(device) / 2**20
        rows.append(row)
        print(row, flush=True)
    return rows, losses


# --------------------------------------------------------------------------------------------- inference
def _int_rtn(model, bits):
    """Fake-quantizes every block linear weight: per block of 64 input weights, absmax scale, round to nearest."""
    qmax = 2 ** (bits - 1) - 1
    with torch.no_grad():
        for block in model.model.layers:
            for m in block.modules():
                if isinstance(m, torch.nn.Linear):
                    w = m.weight.float().reshape(m.out_features, -1, INT_BLOCK)
                    scale = w.abs().amax(-1, keepdim=True).clamp_min(1e-12) / qmax
                    m.weight.copy_(((w / scale).round().clamp(-qmax - 1, qmax) * scale).reshape(m.weight.shape))
    return model


def _block_params(model):
    return sum(m.weight.numel() for b in model.model.layers for m in b.modules() if isinstance(m, torch.nn.Linear))


def _param_bytes(model, skip_blocks=False):
    block_ids = {id(m.weight) for b in model.model.layers for m in b.modules() if isinstance(m, torch.nn.Linear)}
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen or (skip_blocks and id(p) in block_ids):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def trained_model(args, device):
    """(model in bf16, dataset, description): the checkpoint given, or a 30m model pre-trained here now."""
    from thrifty.data import TokenDataset
    from thrifty.paths import data_dir

    corpus = data_dir() / "corpus"
    val = TokenDataset(corpus, "validation")
    if args.checkpoint == "smollm2":
        from thrifty.evaluate import load_any_model

        model = load_any_model("smollm2", device, torch.bfloat16).to(torch.bfloat16)
        return model, val, "the real SmolLM2-135M (Q4_1 GGUF dequantized: its weight statistics are distorted)"
    if args.checkpoint:
        model = LlamaForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16, device=device)
        return model, val, f"checkpoint {args.checkpoint} (trained here with thrifty pretrain)"
    from thrifty.train import TrainConfig, Trainer

    train = TokenDataset(corpus, "train")
    name = "tiny" if args.smoke else args.preset
    with torch.device(device):
        model = LlamaForCausalLM(preset(name)).init_weights(seed=0)
    steps = 4 if args.smoke else args.train_steps
    cfg = TrainConfig(steps=steps, batch_size=4 if args.smoke else 32, seq_len=64 if args.smoke else 512, lr=1e-3,
                      warmup_steps=max(1, steps // 20), eval_batches=2)
    Trainer(model, train, val, cfg).fit(progress=True)
    return model.to(torch.bfloat16), val, f"{name} pre-trained here for {steps} steps (fp32 master, bf16 eval)"


def infer_rows(args, device, base, val, measure_speed=True):
    from thrifty.evaluate import validation_perplexity

    seq, bsz, batches = (64, 2, 2) if args.smoke else (args.eval_seq, args.eval_batch, args.eval_batches)
    x = torch.randint(0, base.config.vocab_size, (args.speed_batch if not args.smoke else 2, seq), device=device)
    variants = [("bf16", None), ("NeuZip 7-bit (lossless)", 7), ("NeuZip 3-bit", 3), ("NeuZip 1-bit", 1),
                ("NeuZip 0-bit", 0), ("INT8 RTN per-block", "int8"), ("INT4 RTN per-block", "int4")]
    rows = []
    bf16_bytes = _param_bytes(base)
    block_params = _block_params(base)
    for name, k in variants:
        row = {"part": "infer", "variant": name}
        try:
            model = copy.deepcopy(base)
            if isinstance(k, int):
                compress_model(model, config=NeuZipConfig(mode="lossy", mantissa_bits=k, vocab=args.vocab))
                mem = model.neuzip.memory()
                # the whole model as it sits in memory: coded blocks and vocabulary, decode buffers, launch
                # tables, and everything kept plain (norms; the vocabulary too with --no-vocab)
                row["weight_mib"] = mem["total_weight_bytes"] / 2**20
                row["buffer_mib"] = mem["buffer_bytes"] / 2**20
                row["vocab_coded"] = args.vocab
                row["block_weights_ratio_vs_bf16"] = mem["ratio_vs_bf16"]
            elif k in ("int8", "int4"):
                bits = 8 if k == "int8" else 4
                _int_rtn(model, bits)
                q = block_params * bits / 8 + block_params / INT_BLOCK * 2  # codes + one bf16 scale per block
                row["weight_mib"] = (q + _param_bytes(model, skip_blocks=True)) / 2**20
                row["block_weights_ratio_vs_bf16"] = q / (2 * block_params)
            else:
                row["weight_mib"] = bf16_bytes / 2**20
                row["block_weights_ratio_vs_bf16"] = 1.0
            row.update(validation_perplexity(model, val, bsz, seq, batches, device))
            if measure_speed and not (isinstance(k, str)):
                row.update(_forward_speed(model, x, args.smoke, device))
            del model
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        rows.append(row)
        print(row, flush=True)
    if measure_speed:  # bf16 timed again last: the drift of the box over the run, beside the variants' ratios
        rows.append({"part": "infer", "variant": "bf16 (repeat, speed only)",
                     **_forward_speed(base, x, args.smoke, device)})
    return rows


def _forward_speed(model, x, smoke: bool, device) -> dict:
    """Median forward ms (last position's logits) and tokens/s over the batch ``x``. 30 warm-up forwards (~1 s):
    after the host-only compression the GPU has idled and clocked down; with 2, the cde9124 run put 1-bit at
    0.49x and 0-bit at 0.73x of bf16 (3-bit 0.79x)."""
    with torch.no_grad():
        t = bench.time_fn(lambda: model(x, logits_to_keep=1), warmup=2 if smoke else 30, reps=3 if smoke else 20,
                          device=device)
    return {"forward_ms": t.median_ms, "tokens_per_s": x.numel() / (t.median_ms / 1e3)}


def fp32_rows(args, device, val):
    """The checkpoint's fp32 weights, plain and NeuZip lossless (same perplexity by construction; the ratio)."""
    from thrifty.evaluate import validation_perplexity

    seq, bsz, batches = (64, 2, 2) if args.smoke else (args.eval_seq, args.eval_batch, args.eval_batches)
    rows = []
    for name, packed in (("fp32", False), ("NeuZip lossless (fp32 weights)", True)):
        model = LlamaForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32, device=device)
        row = {"part": "infer", "variant": name, "weight_mib": _param_bytes(model) / 2**20}
        if packed:
            compress_model(model)
            mem = model.neuzip.memory()
            row["weight_mib"] = (mem["compressed_bytes"] + mem["uncompressed_param_bytes"]) / 2**20
            row["block_weights_ratio_vs_fp32"] = mem["ratio_vs_original"]
        row.update(validation_perplexity(model, val, bsz, seq, batches, device))
        rows.append(row)
        print(row, flush=True)
    return rows


def real_text_identity_rows(args, device, base):
    """The trained model fine-tuned a few steps on real text (the corpus's train split), LOMO AdamW with 8-bit
    states without and with NeuZip lossless, deterministic kernels, the same batches: their losses must be equal
    step by step (``train_loss_identical_real_text``)."""
    from thrifty.data import TokenDataset
    from thrifty.loss import linear_cross_entropy
    from thrifty.paths import data_dir

    train = TokenDataset(data_dir() / "corpus", "train")
    steps, seq, bsz = (2, 32, 2) if args.smoke else (8, 512, 4)
    g = torch.Generator().manual_seed(1)
    batches = [train.batch(bsz, seq, generator=g) for _ in range(steps)]
    rows = []
    for neuzip in (False, True):
        name = "real text: LOMO AdamW 8-bit states" + (" + NeuZip lossless" if neuzip else "")
        row = {"part": "identity", "variant": name}
        _deterministic(True)
        try:
            model = copy.deepcopy(base).train()
            model.set_loss(lambda h, w, y: linear_cross_entropy(h, w, y))
            if neuzip:
                compress_model(model, config=NeuZipConfig())
            opt = lomo(model, _lomo_config("adamw", torch.int8))
            losses = []
            for x, y in batches:
                loss = model(x.to(device), labels=y.to(device))
                loss.backward()  # LOMO: the updates happen in here
                losses.append(float(loss.detach()))
            row["losses"] = losses
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        finally:
            _deterministic(False)
            model = opt = None
            gc.collect()
        rows.append(row)
        print(row, flush=True)
    return rows


ONE_B_BLOCK = "block decode (Llama-3.2-1B-shaped block, N(0, 0.02))"


def one_b_block_rows(device):
    """``neuzip_decode.py``'s measurement of the 1B-class block (the issue's ``block_decode_vs_copy``)."""
    try:
        from neuzip_decode import BLOCKS, block_weights, measure  # benchmarks/ is this script's folder

        row = measure("llama-3.2-1b", block_weights(BLOCKS["llama-3.2-1b"], device), device, smoke=False)
        return [dict(row, part="block", variant=ONE_B_BLOCK)]
    except Exception as err:
        return [{"part": "block", "variant": ONE_B_BLOCK, "error": f"{type(err).__name__}: {err}"}]


def block_decode_rows(args, device, base):
    """Host µs per block decode call; GPU µs of the one launch vs copying the same bf16 bytes."""
    model = compress_model(copy.deepcopy(base))
    st = model.neuzip
    pack = st.packs[len(st.packs) // 2]
    buf = st.buffers[0]
    # the impl the model's own block decodes use: config.impl, "auto" = Triton on CUDA, else the reference
    impl = st.config.impl if st.config.impl != "auto" else ("triton" if st.cuda else "reference")
    for _ in range(3):
        pack.decode_into(buf, impl)
    if device.type == "cuda":
        torch.cuda.synchronize()
    reps = 3 if args.smoke else 200
    t = time.perf_counter()
    for _ in range(reps):
        pack.decode_into(buf, impl)
    host_us = (time.perf_counter() - t) / reps * 1e6
    if device.type == "cuda":
        torch.cuda.synchronize()
    row = {"part": "block", "variant": "block decode (middle block)", "tensors": len(pack.numels),
           "params": pack.total_numel, "block_decode_host_us": host_us, "impl": impl}
    if device.type == "cuda":
        src = torch.empty_like(buf[: pack.total_numel])
        dst = torch.empty_like(src)
        dec = bench.time_fn(lambda: pack.decode_into(buf, impl), reps=100, flush_l2=True, gpu_only=True,
                            device=device)
        cp = bench.time_fn(lambda: dst.copy_(src), reps=100, flush_l2=True, gpu_only=True, device=device)
        row.update(block_decode_gpu_us=dec.median_ms * 1e3, block_copy_gpu_us=cp.median_ms * 1e3,
                   block_decode_vs_copy=dec.median_ms / cp.median_ms)
    print(row, flush=True)
    return [row]


# ------------------------------------------------------------------------------------------------ main
def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _max_gap(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def _identity_summary(losses, head, head_plain) -> dict:
    """Run-to-run control (the same row twice), the NeuZip pairs' largest loss gaps, and the pairs under
    deterministic kernels; the second loss of every AdamW row under deterministic kernels (their first updates
    are the same arithmetic, so a spread there is GPU nondeterminism, not NeuZip)."""
    s = {}
    if "LOMO AdamW" in losses and CONTROL in losses:
        s["train_loss_identical_control"] = int(losses["LOMO AdamW"] == losses[CONTROL])
        s["train_loss_max_gap_control"] = _max_gap(losses["LOMO AdamW"], losses[CONTROL])
    pairs = {"": (head_plain, head), "_bf16_states": ("LOMO AdamW", "LOMO AdamW + NeuZip lossless")}
    for suffix, (plain, packed) in pairs.items():
        if plain in losses and packed in losses:
            s["train_loss_max_gap" + suffix] = _max_gap(losses[plain], losses[packed])
        plain, packed = plain + DETERMINISTIC, packed + DETERMINISTIC
        if plain in losses and packed in losses:
            s["train_loss_identical_deterministic" + suffix] = int(losses[plain] == losses[packed])
    second = [v[1] for k, v in losses.items() if k.endswith(DETERMINISTIC) and len(v) > 1]
    if second:
        s["train_second_loss_spread_deterministic"] = max(second) - min(second)
    return s


def _real_text_summary(identity) -> dict:
    pair = [r.get("losses") for r in identity if "error" not in r]
    if len(pair) != 2:
        return {}
    return {"train_loss_identical_real_text": int(pair[0] == pair[1]),
            "train_loss_max_gap_real_text": _max_gap(pair[0], pair[1])}


def _vanilla_it_per_s(by: dict) -> float:
    """Vanilla AdamW's speed: the mean of its first and last timing when both ran (the box drifts ~20% over a
    run: H100, 459c993, vanilla 5.47 it/s first against 6.69 for the next row)."""
    speeds = [by[k]["it_per_s"] for k in ("vanilla AdamW", VANILLA_AGAIN) if k in by]
    return sum(speeds) / len(speeds)


def _summary(train, losses, infer, block):
    s = {}
    by = {r["variant"]: r for r in train if "error" not in r}
    van = by.get("vanilla AdamW")
    head, head_plain = "LOMO AdamW 8-bit states + NeuZip lossless", "LOMO AdamW 8-bit states"
    pairs = {"": (head_plain, head), "_bf16_states": ("LOMO AdamW", "LOMO AdamW + NeuZip lossless")}
    for suffix, (plain, packed) in pairs.items():
        if van and packed in by:
            if van.get("peak_gib"):
                s["train_mem_ratio_vs_vanilla" + suffix] = by[packed]["peak_gib"] / van["peak_gib"]
            s["train_speed_ratio_vs_vanilla" + suffix] = by[packed]["it_per_s"] / _vanilla_it_per_s(by)
        if plain in losses and packed in losses:
            s["train_loss_identical" + suffix] = int(losses[plain] == losses[packed])
    for name, key in (("vanilla AdamW + CCE", "cce"), ("LOMO AdamW", "lomo"), (head_plain, "lomo_int8"),
                      ("LOMO SGD + NeuZip lossless", "sgd_neuzip")):
        if van and van.get("peak_gib") and name in by:
            s[f"train_mem_ratio_{key}_vs_vanilla"] = by[name]["peak_gib"] / van["peak_gib"]
    fresh = by.get(head + FRESH_CODES)
    if VANILLA_AGAIN in by and van:
        s["train_vanilla_repeat_ratio"] = by[VANILLA_AGAIN]["it_per_s"] / van["it_per_s"]
    if van and fresh:  # the same row before code reuse, timed in the same run
        s["train_speed_ratio_vs_vanilla_fresh_codes"] = fresh["it_per_s"] / _vanilla_it_per_s(by)
        if head in by:
            s["train_code_reuse_speedup"] = by[head]["it_per_s"] / fresh["it_per_s"]
            s["train_code_reuse_fraction"] = by[head].get("code_reuse_fraction")
    s.update(_identity_summary(losses, head, head_plain))
    if "LOMO AdamW" in losses and head_plain in losses:  # 8-bit vs bf16 states (not identical, by design)
        s["train_loss_max_gap_int8_vs_bf16_states"] = max(abs(a - b) for a, b in zip(losses["LOMO AdamW"],
                                                                                     losses[head_plain]))
    ib = {r["variant"]: r for r in infer if "error" not in r}
    bf, k3 = ib.get("bf16"), ib.get("NeuZip 3-bit")
    if bf and k3:
        s["ppl_delta_3bit_pct"] = 100 * (k3["val_ppl"] / bf["val_ppl"] - 1)
        s["mem_ratio_3bit"] = k3["weight_mib"] / bf["weight_mib"]
        s["mem_ratio_3bit_block_weights"] = k3["block_weights_ratio_vs_bf16"]
        if bf.get("tokens_per_s") and k3.get("tokens_per_s"):
            # against the faster of bf16's two timings (first and last of the run: the box drifts, and at
            # 8fda306 the first read 0.52x the last); the first alone and their mean beside it
            again = ib.get("bf16 (repeat, speed only)") or {}
            bf_speeds = [bf["tokens_per_s"]] + ([again["tokens_per_s"]] if again.get("tokens_per_s") else [])
            s["infer_speed_ratio_3bit"] = k3["tokens_per_s"] / max(bf_speeds)
            s["infer_speed_ratio_3bit_vs_bf16_first"] = k3["tokens_per_s"] / bf["tokens_per_s"]
            if len(bf_speeds) == 2:
                s["infer_bf16_repeat_ratio"] = bf_speeds[1] / bf_speeds[0]
                s["infer_speed_ratio_3bit_vs_bf16_mean"] = k3["tokens_per_s"] / (sum(bf_speeds) / 2)
    for r in infer:
        if "val_ppl" in r:
            s["ppl_" + r["variant"].split(" (")[0].replace(" ", "_").replace("-", "").lower()] = r["val_ppl"]
    one_b = [r for r in block if r.get("variant") == ONE_B_BLOCK and "error" not in r]
    if one_b:  # the block: a 1B-class one (benchmarks/neuzip_decode.py's measurement)
        s["block_decode_vs_copy"] = one_b[0].get("block_decode_vs_copy")
        s["block_decode_host_us"] = one_b[0]["block_decode_host_us"]
    block = [r for r in block if r.get("variant") != ONE_B_BLOCK]
    if block and "error" not in block[0]:
        s["block_decode_host_us_trained_block"] = block[0]["block_decode_host_us"]
        if "block_decode_vs_copy" in block[0]:
            s["block_decode_vs_copy_trained_block"] = block[0]["block_decode_vs_copy"]
    return s


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", default=None, help="a thrifty pretrain folder (real trained weights)")
    p.add_argument("--train-steps", type=int, default=1000, help="pre-training steps when no checkpoint is given")
    p.add_argument("--preset", default="30m", help="model preset pre-trained when no checkpoint is given")
    p.add_argument("--no-vocab", dest="vocab", action="store_false",
                   help="inference rows: keep the embedding and lm_head plain (default: NeuZipConfig(vocab=True))")
    p.add_argument("--train-iters", type=int, default=14, help="training iterations per variant, 2 of them warm-up "
                   "(part 1)")
    p.add_argument("--train-batch", type=int, default=4)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--eval-batch", type=int, default=8)
    p.add_argument("--eval-seq", type=int, default=512)
    p.add_argument("--speed-batch", type=int, default=8)
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--skip-infer", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    p.add_argument("--check-identity", action="store_true", help="run the NeuZip pairs again with deterministic "
                   "kernels (torch.use_deterministic_algorithms): their losses must be equal")
    p.add_argument("--suffix", default="", help="appended to the device tag of the result file (split runs: "
                   "--suffix=-train with --skip-infer, --suffix=-infer with --skip-train)")
    p.add_argument("--cpu-accuracy", default=None, metavar="DIR",
                   help="CPU: perplexity and weight memory of every variant for the checkpoint DIR (no speed)")
    args = p.parse_args(argv)
    if args.cpu_accuracy:
        device = torch.device("cpu")
        args.checkpoint = args.cpu_accuracy
        base, val, what = trained_model(args, device)
        rows = infer_rows(args, device, base, val, measure_speed=False)
        if args.checkpoint != "smollm2":  # its weights exist in bf16/fp32 only as the GGUF's dequantization
            rows += fp32_rows(args, device, val)
        summary = _summary([], {}, rows, [])
        path = bench.write_result("neuzip_models", rows, summary, device="cpu-accuracy",
                                  extra={"model": what, "note": "CPU run: accuracy and weight memory only; no "
                                         "speed, no training columns", "eval": vars(args)})
        bench.print_table(rows, ["variant", "val_ppl", "weight_mib", "block_weights_ratio_vs_bf16",
                                 "block_weights_ratio_vs_fp32"])
        print("SUMMARY", summary)
        print("wrote", path)
        return 0
    device = torch.device("cpu" if args.smoke else "cuda")
    assert args.smoke or torch.cuda.is_available(), "needs CUDA (or --smoke)"
    t0 = time.time()
    train, losses = ([], {}) if args.skip_train else train_rows(args, device)
    infer, block, identity, what = [], [], [], None
    if not args.skip_infer:
        try:
            base, val, what = trained_model(args, device)
            infer = infer_rows(args, device, base, val)
        except Exception as err:  # e.g. no corpus on the box: keep the training rows
            infer = [{"part": "infer", "variant": "trained model", "error": f"{type(err).__name__}: {err}"}]
            base = None
        if base is not None:
            try:
                block = block_decode_rows(args, device, base)
            except Exception as err:
                block = [{"part": "block", "variant": "block decode", "error": f"{type(err).__name__}: {err}"}]
            identity = real_text_identity_rows(args, device, base)
        if not args.smoke:
            block += one_b_block_rows(device)
    summary = _summary(train, losses, infer, block)
    summary.update(_real_text_summary(identity))
    rows = train + infer + block + identity
    extra = {"train_model": f"Llama-shaped {SMOKE_SHAPE if args.smoke else TRAIN_SHAPE}, RANDOM INIT (memory and "
                            "speed are honest, loss values are not a trained model's), activation checkpointing, "
                            "bf16 weights", "train_losses": losses, "infer_model": what,
             "int_rtn": f"per-block absmax RTN, block {INT_BLOCK} along the input, fake-quantized (ppl real, "
                        "memory counted as codes + one bf16 scale per block, speed not measured)",
             "args": vars(args), "wall_s": time.time() - t0}
    results_dir = None
    if args.smoke:  # a smoke run is no result: keep it out of benchmarks/results
        import tempfile

        results_dir = tempfile.mkdtemp(prefix="neuzip_models_smoke_")
    tag = ("smoke" if args.smoke else bench.detect_device(device)) + args.suffix
    path = bench.write_result("neuzip_models", rows, summary, device=tag, extra=extra, results_dir=results_dir)
    if any(_is_number(r.get("val_ppl")) for r in infer):
        try:
            bench.plot_rows([r for r in infer if "error" not in r], x="variant", y="val_ppl",
                            path=path.with_suffix(".png"), title="validation perplexity by weight format")
        except Exception as err:  # a plot failure must not lose the numbers
            print("plot failed:", err)
    if any(_is_number(r.get("peak_gib")) for r in train):
        try:
            bench.plot_rows([r for r in train if "error" not in r], x="variant", y="peak_gib",
                            path=path.with_name(path.stem + "_train.png"), title="training peak memory (GiB)")
        except Exception as err:
            print("plot failed:", err)
    bench.print_table(train, ["variant", "params_m", "peak_gib", "it_per_s", "loss_first", "loss_last"])
    bench.print_table(train, ["variant", "phase_step_ms", "phase_host_enqueue_ms", "phase_forward_gpu_ms",
                              "phase_backward_gpu_ms", "phase_optimizer_gpu_ms", "phase_decode_host_ms",
                              "phase_reencode_host_ms", "phase_reencode_gpu_ms", "phase_update_host_ms",
                              "phase_update_gpu_ms", "phase_syncs", "phase_reencode_syncs"])
    bench.print_table(infer, ["variant", "val_ppl", "weight_mib", "tokens_per_s", "block_weights_ratio_vs_bf16"])
    print("SUMMARY", summary)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
