"""Training beyond one GPU: thrifty's Trainer under torchrun + FSDP2 (thrifty.parallel.shard_model), 1 vs N
GPUs, per recipe. Reports tokens/s and peak memory per GPU, scaling efficiency (tokens/s on N GPUs over N x
tokens/s on 1 GPU, same per-GPU batch) and whether the N-GPU training step equals the 1-GPU step on the same
global batches (1 GPU with N x the per-GPU batch reads exactly the windows the N ranks read together).

loss_match comes from an equivalence phase per recipe, in launches of its own: --equiv-steps (10) steps from the
same initial weights at the preset's constant equivalence lr (135m 1e-4, 1b 3e-5: PRESET_DEFAULTS says why),
comparing per step the loss (0.02 nats, or 2x the 1-GPU run's own run-to-run gap where that is larger) and
the pre-clip gradient norm (5%), and per parameter the update norm (10%) -- thrifty.parallel.equivalence.
--smoke --inject-bug {grad_x2_rank0,grad_sum,skip_update_rank1} (test-only) must turn loss_match false.

Run on the GPU box (NVLink multicast off: NCCL_NVLS_ENABLE=0, set by this driver for its torchrun children).
Per preset, torchrun launches that each run every recipe in turn (one start-up, one model init per launch):
1. equivalence: N GPUs x b (the record, the bytes of one step, --profile's profiled step), then at once on
   GPU 0 and GPU 1 the 1-GPU loss reference, N micro-batches of b rows (--grad-accum N: the ranks' GEMM shapes
   and bf16 gradient roundings, which BitNet's codes amplify otherwise; parallel/NOTES.md, issue #33). The
   second copy is the same code on another GPU: its gap from the first is the comparison's noise floor. The
   phase runs SDPA's math backend on CUDA (bit-reproducible; flash attention's backward adds dQ with atomics,
   which BitNet's codes grow into 0.015-0.06 nats in 10 steps): what remains is the sharding;
2. one timing launch: in the same N processes, the N-rank job (b rows per rank) and, per rank, a 1-GPU job of
   its own (a copy of the model on a mesh of that rank alone, b rows), timed in alternating blocks of
   --block-steps (10) steps, ABBA order. Every GPU runs a 1-GPU job at once, so both sides see the same host,
   the same box and the same drift (at 0525885 and 3ad1858, with separate launches per side, throughput of
   every recipe moved 20-35% between launches a minute apart, and pairs of launches gave scalings 0.69-0.98
   for the same code).
Scaling of block pair i = N-rank tokens/s over N x the mean of the ranks' 1-GPU tokens/s in that pair; the
median pair, spread beside it. Peak GiB per GPU: one extra step of the equivalence launches (N ranks; the
1-GPU reference, whose N micro-batches of b rows hold what one of b rows does).
Defaults: 50 timed steps after 5 warm-up per side, per-GPU batch 8 (135m) / 4 (1b), sequence 1024.

Budget (10-minute calls): one preset per call (3 launches; at 66d08d3 on 2 H200s, 135m with --profile
--checkpoint-check 229 s, 1b with --profile 264 s, set-up included). Fold the parts afterwards:

    bash benchmarks/run_on_gpu.sh benchmarks/multi_gpu.py --presets 135m --part-name 135m --profile --checkpoint-check
    bash benchmarks/run_on_gpu.sh benchmarks/multi_gpu.py --presets 1b --part-name 1b --profile
    python benchmarks/multi_gpu.py --merge benchmarks/results/multi_gpu_part_135m_<dev>.json \
        benchmarks/results/multi_gpu_part_1b_<dev>.json     # -> multi_gpu_<dev>.json + PNG, anywhere

Summary: scaling_efficiency_2gpu (the worst preset x recipe), loss_match (and loss_match_failed), per preset x
recipe the scaling, tokens/s, peak GiB per GPU on 1 and N GPUs and its reduction, the equivalence phase's
differences and noise (<key>_equiv_*), with --profile the exposed NCCL and idle GPU time of the N-GPU step;
checkpoint_2to1_ok with --checkpoint-check. The result is written after every preset,
so a launch that times out (--launch-timeout) keeps what finished. ``--smoke``: 2 CPU processes on gloo, tiny
model, synthetic tokens, results into a temporary folder -- proves the script runs, measures nothing.

Recipes: plain (logits + torch CE), cce (thrifty cut cross-entropy), bitnet (thrifty.bitnet.convert(model,
"a4.8")), neuzip (thrifty.neuzip.compress_model(model)); a recipe whose API is missing gives an error row.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _recipe_missing(recipe):
    """Why a recipe cannot run on this checkout (its API lives on another branch), or None."""
    need = {"bitnet": ("thrifty.bitnet", "convert"), "neuzip": ("thrifty.neuzip", "compress_model")}.get(recipe)
    if recipe not in RECIPES:
        return f"unknown recipe {recipe!r}; expected one of {sorted(RECIPES)}"
    if need is None:
        return None
    try:
        module = importlib.import_module(need[0])
    except ImportError:
        return f"{need[0]} is not on this checkout"
    return None if hasattr(module, need[1]) else f"{need[0]}.{need[1]} is not on this checkout"


def _bitnet(model):
    return importlib.import_module("thrifty.bitnet").convert(model, "a4.8")


def _neuzip(model):
    return importlib.import_module("thrifty.neuzip").compress_model(model)


# name -> (thrifty.loss impl or "torch", a model conversion applied before sharding or None)
RECIPES = {
    "plain": ("torch", None),
    "cce": ("auto", None),
    "bitnet": ("auto", _bitnet),   # BitNet a4.8 (its branch): scales computed on the all-gathered weight
    "neuzip": ("auto", _neuzip),   # NeuZip lossless (its branch): see src/thrifty/parallel/NOTES.md
}

LOSS_TOL = 0.02  # nats: the checkpoint check's loss tolerance (equivalence tolerances: thrifty.parallel.equivalence)


# ------------------------------------------------------------------------------------------------ the worker

# per-preset defaults (--batch-size/--seq-len/--lr/--equiv-lr > 0 override them for every preset):
# per-GPU batch, sequence, the timed run's peak lr (warm-up a quarter of the steps, then cosine), and the constant
# lr of the equivalence phase. Peak lrs: 6e-4 / 3e-4 are the usual values at these sizes (GPT-3 125M, Llama 1B
# class); at a305afd, 1e-3 with 6 warm-up steps spiked both sizes within 4 steps (135m 9.87 -> 12.21 after an
# update at 5e-4; 1b 9.69 -> 13.25 after one at 3.3e-4). The equivalence lr sits 3-5x below the lr of the first
# spike and shrinks ~1/width (576 -> 2048): 135m 1e-4, 1b 3e-5; each step still moves the loss by > 0.1 nat.
PRESET_DEFAULTS = {"tiny": (2, 32, 1e-3, 1e-3), "30m": (8, 1024, 6e-4, 2e-4), "60m": (8, 1024, 6e-4, 2e-4),
                   "135m": (8, 1024, 6e-4, 1e-4), "1b": (4, 1024, 3e-4, 3e-5)}
EQUIV_STEPS = 10  # steps of the equivalence phase (the first ~5 at a305afd matched to < 0.01 even at lr 1e-3)


def _data(args, vocab):
    if not args.smoke:
        try:
            from thrifty.data import TokenDataset
            from thrifty.paths import data_dir

            return TokenDataset(data_dir() / "corpus", "train"), "corpus"
        except (ValueError, OSError):
            pass
    from thrifty.bench import RandomTokens

    return RandomTokens(vocab), "random"


def _init(args):
    """Joins the group with a short timeout (a rank that fails must not hang its peer for NCCL's 10 minutes)."""
    from datetime import timedelta

    import torch.distributed as dist

    from thrifty import parallel

    if not args.smoke and torch.cuda.is_available() and not dist.is_initialized():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", timeout=timedelta(seconds=args.nccl_timeout))
    return parallel.init_distributed("gloo" if args.smoke else None)


def _profile_step(trainer, device, path):
    """One training step under torch.profiler; the kernel-overlap summary of its trace (thrifty.parallel)."""
    from torch.profiler import ProfilerActivity, profile

    from thrifty.parallel.profiling import trace_summary

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        trainer.train_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    prof.export_chrome_trace(str(path))
    out = trace_summary(path)
    out["step_wall_ms_profiled"] = 1e3 * wall
    return out


class _ScaledGrad(torch.autograd.Function):
    """Identity forward, gradient x factor backward: a rank's gradients scaled before the reduce-scatter while
    the loss it reports stays right (--inject-bug)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()  # not a view: FSDP2 hooks the root output, and warns about views

    @staticmethod
    def backward(ctx, g):
        return ctx.factor * g, None


def _scale_grads(model, factor):
    loss_fn = model.loss_fn
    model.set_loss(lambda *a, **kw: _ScaledGrad.apply(loss_fn(*a, **kw), factor))


def _inject_bug(bug, model, trainer, rank, world):
    """Test-only sharding bugs (--inject-bug, --smoke only): the equivalence phase must flag each of them."""
    if bug == "grad_x2_rank0" and rank == 0:
        _scale_grads(model, 2.0)
    elif bug == "grad_sum":  # every rank x world before FSDP2's average: the sum over ranks, not the mean
        _scale_grads(model, float(world))
    elif bug == "skip_update_rank1" and rank == 1:  # rank 1's shard of one weight never updated
        victim = next(p for p in model.model.layers[0].parameters() if p.ndim >= 2)

        def drop(optimizer, args, kwargs):
            victim.grad = None

        trainer.optimizer.register_step_pre_hook(drop)


def _trainer(args, recipe, base, device, world, rank, data, cfg, mesh=None):
    """A fresh copy of the base model with the recipe's loss and conversion, sharded over ``mesh`` (default: all
    ranks), in a Trainer."""
    import copy

    from thrifty import parallel
    from thrifty.train import Trainer

    loss_impl, convert = RECIPES[recipe]
    model = copy.deepcopy(base).to(device)
    if loss_impl != "torch":
        from thrifty.loss import lm_loss

        model.set_loss(functools.partial(lm_loss, impl=loss_impl))
    if convert is not None:
        model = convert(model) or model
    parallel.shard_model(model, mesh, prefetch=args.prefetch, block_units=args.block_units,
                         blocks_per_unit=_blocks_per_unit(args.blocks_per_unit))
    trainer = Trainer(model, data, None, cfg)
    if args.inject_bug and world > 1 and mesh is None:
        _inject_bug(args.inject_bug, model, trainer, rank, world)
    return trainer


def _blocks_per_unit(text: str):
    return text if text == "auto" else int(text)


def _equivalence_phase(args, recipe, base, device, world, rank, data):
    """EQUIV_STEPS at the preset's constant equivalence lr from the base weights: losses, gradient norms,
    update norms (thrifty.parallel.equivalence), compared by the driver with the 1-GPU runs on the same batches.
    Returns (record, trainer): the N-GPU launch measures one step's collectives and profile with the trainer."""
    from thrifty.parallel.equivalence import record_steps
    from thrifty.train import TrainConfig

    # constant lr: no schedule in the comparison. The 1-GPU reference runs --grad-accum N micro-batches of the
    # ranks' b rows (the same global batch and step): one batch of N.b rows rounds its bf16 weight gradients over
    # other partial sums (and cuBLAS picks kernels by M), a ~1e-3-relative difference that BitNet's ternary and
    # INT4/INT8 codes turn into O(1) code flips from step 1 on (thrifty/parallel/NOTES.md, "BitNet and loss_match")
    cfg = TrainConfig(steps=args.equiv_steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.equiv_lr,
                      warmup_steps=0, min_lr_ratio=1.0, seed=0, grad_accum=args.grad_accum)
    trainer = _trainer(args, recipe, base, device, world, rank, data, cfg)
    with _reproducible_attention(device):
        record = record_steps(trainer, args.equiv_steps)
    return {**record, "lr": args.equiv_lr, "attention": "math" if device.type == "cuda" else "default"}, trainer


def _reproducible_attention(device):
    """SDPA's math backend on CUDA, for the equivalence phase only: flash attention's backward adds dQ with
    atomics, so two runs of the same step differ in the last bits, which BitNet's codes grow into 0.015-0.06 nats
    within 10 steps (3ad1858, c9c6fca: the 1-GPU reference run twice, and the 2-rank run). The math backend is
    plain matmuls and a softmax, bit-reproducible, so what is left between N ranks and one process is the
    sharding itself. The timed runs keep the default (flash) backend."""
    import contextlib

    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _equivalence_launch(args, recipe, base, device, rank, world, data):
    """--phase equiv: the equivalence record; on N GPUs also what one step communicates and, with --profile,
    one step under torch.profiler (untimed, after the recorded steps)."""
    record, trainer = _equivalence_phase(args, recipe, base, device, world, rank, data)
    part = {"recipe": recipe, "preset": args.preset, "gpus": world, "grad_accum": args.grad_accum,
            "equivalence": record, "peak_gib_per_gpu": _steady_peak_gib(trainer, device, world)}
    if world > 1:
        from thrifty.parallel.profiling import CollectiveCounter

        try:
            with CollectiveCounter() as counter:
                trainer.train_step()
            part["comm_per_step"] = counter.summary()
        except Exception as err:  # a measurement, never the run's failure
            part["comm_per_step"] = {"error": f"{type(err).__name__}: {err}"}
    if args.profile and world > 1:
        trace = Path(args.part).with_name(f"trace_{Path(args.part).stem}_{recipe}_rank{rank}.json")
        try:
            mine = _profile_step(trainer, device, trace)
        except Exception as err:
            mine = {"error": f"{type(err).__name__}: {err}"}
        Path(str(trace) + ".summary").write_text(json.dumps(mine))
        torch.distributed.barrier()
        if rank == 0:
            part["profile"] = [json.loads(Path(str(trace).replace("rank0", f"rank{r}") + ".summary").read_text())
                               for r in range(world)]
    return part


def _steady_peak_gib(trainer, device, world):
    """Peak GiB per rank of one more (untimed) step, every allocation of the run already made: the peak of
    training at this size. The 1-GPU reference's step of N micro-batches of b rows holds what one of b rows does
    (one micro-batch's activations at a time, the same gradient buffers)."""
    if device.type != "cuda":
        return [float("nan")] * world
    torch.cuda.reset_peak_memory_stats()
    trainer.train_step()
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=device)
    peaks = torch.empty(world, device=device)
    torch.distributed.all_gather_into_tensor(peaks, peak)
    return [float(p) for p in peaks.cpu()]


def _timed_steps(trainer, n):
    """n steps, each timed on the host; a step ends with the loss's all-reduce (a host sync)."""
    times, losses = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        row = trainer.train_step()
        times.append(time.perf_counter() - t0)
        losses.append(row["loss"])
    return times, losses


def _timed_launch(args, recipe, base, device, rank, world, data, source, solo):
    """--phase time: the N-rank job and, in the same processes, a 1-GPU job per rank (its own copy of the model
    on a mesh of this rank alone: every GPU runs one, at once), timed in alternating blocks of --block-steps
    steps after --warmup steps each. Both sides see the same host, the same box and the same drift; the scaling
    of block pair i is the N-rank tokens/s over N x the mean of the ranks' 1-GPU tokens/s in that pair."""
    from thrifty.train import TrainConfig

    total = args.warmup + args.steps
    cfg = TrainConfig(steps=total, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      warmup_steps=max(1, total // 4), seed=0)
    jobs = {"many": _trainer(args, recipe, base, device, world, rank, data, cfg)}
    jobs["one"] = _trainer(args, recipe, base, device, world, rank, data, cfg, mesh=solo)
    for trainer in jobs.values():
        _timed_steps(trainer, args.warmup)
    blocks = {k: [] for k in jobs}  # per block: the median step seconds
    losses = {k: [] for k in jobs}
    done = 0
    while done < args.steps:
        n = min(args.block_steps, args.steps - done)
        order = list(jobs) if len(blocks["many"]) % 2 == 0 else list(jobs)[::-1]  # ABBA: a drift cancels
        for name in order:
            torch.distributed.barrier()
            times, loss = _timed_steps(jobs[name], n)
            blocks[name].append(statistics.median(times))
            losses[name] += loss
        done += n
    mine = torch.tensor(blocks["one"], device=device, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(world)]
    torch.distributed.all_gather(every, mine)  # each rank's 1-GPU block medians
    tokens = args.batch_size * args.seq_len
    one_tps = [[tokens / float(t[i]) for t in every] for i in range(len(blocks["one"]))]
    many_tps = [world * tokens / t for t in blocks["many"]]
    model = jobs["many"].model
    return {"recipe": recipe, "preset": args.preset, "gpus": world, "batch_per_gpu": args.batch_size,
            "seq_len": args.seq_len, "block_steps": args.block_steps, "timed_steps": done,
            "tokens_per_s_n_gpu_blocks": many_tps, "tokens_per_s_1gpu_blocks": one_tps,
            "scaling_blocks": [m / (world * statistics.fmean(o)) for m, o in zip(many_tps, one_tps)],
            "losses_n_gpu": losses["many"], "losses_1gpu_rank0": losses["one"], "data": source,
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "prefetch": args.prefetch,
            "block_units": args.block_units, "blocks_per_unit": args.blocks_per_unit, "lr": args.lr}


def _one_recipe(args, recipe, base, device, rank, world, data, source, solo):
    if args.phase == "equiv":
        return _equivalence_launch(args, recipe, base, device, rank, world, data)
    return _timed_launch(args, recipe, base, device, rank, world, data, source, solo)


def _solo_mesh(device, rank, world):
    """A mesh of this rank alone (the 1-GPU job beside the N-rank one); every rank takes part in creating
    every group, as torch.distributed requires."""
    from torch.distributed.device_mesh import DeviceMesh

    groups = [torch.distributed.new_group([r]) for r in range(world)]
    return DeviceMesh.from_group(groups[rank], device.type)


def worker(args) -> None:
    import gc

    import torch.distributed as dist

    from thrifty.models import LlamaForCausalLM, preset

    device = _init(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.ckpt:
        return checkpoint_worker(args, device, rank, world)
    cfg_model = preset(args.preset)
    base = LlamaForCausalLM(cfg_model).init_weights(seed=0)  # once per launch, on the CPU; copied per recipe
    data, source = _data(args, cfg_model.vocab_size)
    solo = _solo_mesh(device, rank, world) if args.phase == "time" else None
    parts = {}
    for recipe in args.recipes.split(","):
        try:
            parts[recipe] = _one_recipe(args, recipe, base, device, rank, world, data, source, solo)
        except Exception as err:  # an OOM, a recipe whose API is missing ...: the next recipe still runs
            parts[recipe] = {"recipe": recipe, "error": f"{type(err).__name__}: {err}"}
            print(f"[rank {rank}] {recipe}: {parts[recipe]['error']}", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        Path(args.part).write_text(json.dumps(parts))
    dist.barrier()
    dist.destroy_process_group()


def checkpoint_worker(args, device, rank, world) -> None:
    """--ckpt save (N ranks): 3 steps, a sharded checkpoint, the full weights it holds and the next 2 losses.
    --ckpt load (1 process, no sharding): loads it, compares every weight bit for bit and the next 2 losses."""
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    from thrifty import parallel
    from thrifty.models import LlamaForCausalLM, preset
    from thrifty.train import Trainer, TrainConfig

    folder = Path(args.ckpt_dir)
    cfg_model = preset(args.preset)
    model = LlamaForCausalLM(cfg_model).init_weights(seed=0).to(device)
    data, _ = _data(args, cfg_model.vocab_size)
    if args.ckpt == "save":
        parallel.shard_model(model)
        batch = args.batch_size
    else:
        batch = args.batch_size * args.ckpt_world  # one process reads the windows of all the saving ranks
    trainer = Trainer(model, data, None, TrainConfig(steps=5, batch_size=batch, seq_len=args.seq_len, lr=args.lr,
                                                     warmup_steps=1, seed=0))
    if args.ckpt == "save":
        for _ in range(3):
            trainer.train_step()
        trainer.save_checkpoint(folder / "ck")
        full = {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters()}
        after = [trainer.train_step()["loss"] for _ in range(2)]
        if rank == 0:
            save_file(full, str(folder / "full_weights.safetensors"))
            (folder / "save.json").write_text(json.dumps({"after": after, "world": world}))
    else:
        trainer.load_checkpoint(folder / "ck")
        full = load_file(str(folder / "full_weights.safetensors"))
        saved = json.loads((folder / "save.json").read_text())
        mismatch = [n for n, p in model.named_parameters() if not torch.equal(p.detach().cpu(), full[n])]
        after = [trainer.train_step()["loss"] for _ in range(2)]
        diff = max(abs(a - b) for a, b in zip(after, saved["after"]))
        ok = not mismatch and trainer.step == 5 and diff <= LOSS_TOL and saved["world"] == args.ckpt_world
        (folder / "load.json").write_text(json.dumps({
            "checkpoint_2to1_ok": ok, "weights_bit_equal": not mismatch, "mismatched": mismatch[:5],
            "loss_after_saved_world": saved["after"], "loss_after_one_process": after, "loss_max_abs_diff": diff,
            "saved_on_ranks": saved["world"], "device": str(device)}))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ the driver

def _cmd(args, gpus, batch, part, recipes, extra=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
           str(Path(__file__).resolve()), "--worker", "--recipes", recipes, "--preset", args.preset,
           "--batch-size", str(batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--lr", str(args.lr), "--part", str(part), "--prefetch", str(args.prefetch),
           "--nccl-timeout", str(args.nccl_timeout), "--equiv-steps", str(args.equiv_steps),
           "--equiv-lr", str(args.equiv_lr), "--block-units", args.block_units, "--block-steps", str(args.block_steps),
           "--blocks-per-unit", args.blocks_per_unit, "--phase", args.phase] + \
        (["--smoke"] if args.smoke else []) + (["--profile"] if args.profile else []) + \
        (["--inject-bug", args.inject_bug] if args.inject_bug else []) + list(extra)
    return cmd


def _env(visible=None):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def _show(cmd, visible=None):
    pre = f"CUDA_VISIBLE_DEVICES={visible} " if visible is not None else ""
    print(pre + "NCCL_NVLS_ENABLE=0 " + " ".join(cmd[2:]).replace("torch.distributed.run", "torchrun", 1), flush=True)


def _launch_all(args, jobs):
    """Runs [(cmd, visible devices)] at once; raises when one fails."""
    procs = []
    for cmd, visible in jobs:
        _show(cmd, visible)
        procs.append(subprocess.Popen(cmd, env=_env(visible)))
    codes = [p.wait(timeout=args.launch_timeout) for p in procs]
    if any(codes):
        raise RuntimeError(f"torchrun exited with {codes}")


def _run_preset(args, gpus, tmp):
    """The launches of one preset -> {recipe: {"timing", "equivalence": [N-GPU, 1-GPU, 1-GPU again], "peaks",
    "comm_per_step", "profile"}} or error strings. First the equivalence launches: N GPUs (with --profile, and
    the bytes of one step), then the 1-GPU loss reference (--grad-accum N) twice at once, on GPU 0 and GPU 1
    (one by one off CUDA): the second run of the same code measures the run-to-run noise the comparison has to
    live with. Then one timing launch: the N-rank job and a 1-GPU job per rank in alternating blocks
    (_timed_launch)."""
    b = args.batch_size
    runnable = [r for r in args.recipes.split(",") if not _recipe_missing(r)]
    out = {r: {"error": _recipe_missing(r)} for r in args.recipes.split(",") if _recipe_missing(r)}
    if not runnable:
        return out
    rec = ",".join(runnable)
    concurrent = torch.cuda.is_available() and gpus >= 2 and not args.smoke
    equiv = argparse.Namespace(**{**vars(args), "phase": "equiv"})
    ref_args = argparse.Namespace(**{**vars(equiv), "profile": False})
    timing = argparse.Namespace(**{**vars(args), "phase": "time", "profile": False})
    files = {k: tmp / f"{args.preset}_{k}.json" for k in ("many_eq", "ref0", "ref1", "timing")}
    refs = [(_cmd(ref_args, 1, b, files[f"ref{g}"], rec, ["--grad-accum", str(gpus)]),
             str(g) if concurrent else None) for g in range(2)]
    try:
        if args.equiv_steps:
            _launch_all(args, [(_cmd(equiv, gpus, b, files["many_eq"], rec), None)])
            for group in ([refs] if concurrent else [[r] for r in refs]):
                _launch_all(args, group)
        _launch_all(args, [(_cmd(timing, gpus, b, files["timing"], rec), None)])
    except Exception as err:  # keep whatever parts were written
        print(f"{args.preset}: {type(err).__name__}: {err}", flush=True)
    got = {k: json.loads(f.read_text()) if f.is_file() else {} for k, f in files.items()}
    for r in runnable:
        runs = {k: got[k].get(r, {"error": "no result (launch failed or timed out)"}) for k in files}
        if "error" in runs["timing"]:
            out[r] = {"error": f"timing: {runs['timing']['error']}"}
            continue
        eq = [runs["many_eq"], runs["ref0"], runs["ref1"]]
        ok = not any("error" in x for x in eq)
        out[r] = {"timing": runs["timing"], "equivalence": [x["equivalence"] for x in eq] if ok else None,
                  "peaks": (runs["ref0"]["peak_gib_per_gpu"], runs["many_eq"]["peak_gib_per_gpu"]) if ok else None,
                  "comm_per_step": runs["many_eq"].get("comm_per_step"), "profile": runs["many_eq"].get("profile")}
    return out


def _fold(preset, results, gpus, rows, summary, curves, extra):
    for recipe, res in results.items():
        if "error" in res:
            rows.append({"preset": preset, "recipe": recipe, "error": res["error"]})
            continue
        key, t = f"{preset}_{recipe}", res["timing"]
        one_tps = [statistics.fmean(o) for o in t["tokens_per_s_1gpu_blocks"]]
        many_tps = t["tokens_per_s_n_gpu_blocks"]
        peaks = res["peaks"] or ([float("nan")], [float("nan")])
        for label, n, tps, peak in (("1 GPU", 1, one_tps, peaks[0]), (f"{gpus} GPUs", gpus, many_tps, peaks[1])):
            rows.append({"preset": preset, "recipe": recipe, "run": label, "gpus": n,
                         "batch_per_gpu": t["batch_per_gpu"], "tokens_per_s": statistics.median(tps),
                         "step_ms": 1e3 * n * t["batch_per_gpu"] * t["seq_len"] / statistics.median(tps),
                         "blocks": len(tps), "peak_gib_per_gpu": max(peak), "timed_steps": t["timed_steps"],
                         "data": t["data"], "params_m": t["params_m"]})
        scalings = t["scaling_blocks"]
        summary[f"{key}_scaling_efficiency_{gpus}gpu"] = statistics.median(scalings)  # of the block pairs
        summary[f"{key}_scaling_efficiency_{gpus}gpu_spread"] = max(scalings) - min(scalings)
        summary[f"{key}_scaling_efficiency_{gpus}gpu_blocks"] = len(scalings)
        extra.setdefault("scaling_runs", {})[key] = {
            "scaling": scalings, "tokens_per_s_1gpu_each": t["tokens_per_s_1gpu_blocks"],
            "tokens_per_s_n_gpu": many_tps, "block_steps": t["block_steps"]}
        summary[f"{key}_tokens_per_s_1gpu"] = statistics.median(one_tps)
        summary[f"{key}_tokens_per_s_{gpus}gpu"] = statistics.median(many_tps)
        p1, pn = max(peaks[0]), max(peaks[1])
        summary[f"{key}_peak_gib_per_gpu_1gpu"] = p1
        summary[f"{key}_peak_gib_per_gpu_{gpus}gpu"] = pn
        summary[f"{key}_peak_reduction_gib"] = p1 - pn
        if res.get("equivalence"):
            many_eq, ref, repeat = res["equivalence"]
            curves[key] = {"n_gpu": many_eq["losses"], "one_gpu_same_batches": ref["losses"],
                           "one_gpu_repeat": repeat["losses"]}
            _equivalence_keys(key, many_eq, ref, repeat, summary, extra)
        extra.setdefault("comm_per_step", {})[key] = res.get("comm_per_step")
        if res.get("profile"):
            extra.setdefault("profile", {})[key] = {f"{gpus}gpu": res["profile"]}
            ranks = [p for p in res["profile"] if "error" not in p]
            if ranks:
                summary[f"{key}_nccl_exposed_ms_{gpus}gpu"] = max(p["nccl_exposed_ms"] for p in ranks)
                summary[f"{key}_gpu_idle_ms_{gpus}gpu"] = max(p["gpu_idle_ms"] for p in ranks)


def _equivalence_keys(key, many, ref, repeat, summary, extra):
    """The equivalence phase of one preset x recipe (thrifty.parallel.equivalence.compare) into the summary."""
    from thrifty.parallel.equivalence import compare

    verdict = compare(many, ref, repeat=repeat)
    for name in ("loss_max_abs_diff", "loss_noise", "loss_tol", "grad_norm_max_rel_diff",
                 "grad_norm_max_rel_diff_all_steps", "update_norm_max_rel_diff"):
        summary[f"{key}_equiv_{name}"] = verdict[name]
    summary[f"{key}_equiv_ok"] = verdict["ok"]
    extra.setdefault("equivalence", {})[key] = {**verdict, "n_gpu": many, "one_gpu_same_batches": ref,
                                                "one_gpu_repeat": repeat}


def _finalize(summary, gpus):
    """The headline keys from the per-(preset, recipe) ones. loss_match: every preset x recipe passed its
    equivalence phase; None when a run has none (--equiv-steps 0, or a failed equivalence launch)."""
    tail = f"_scaling_efficiency_{gpus}gpu"
    effs = {k[:-len(tail)]: v for k, v in summary.items() if k.endswith(tail) and k != tail[1:]}
    if effs:
        summary[f"scaling_efficiency_{gpus}gpu"] = min(effs.values())
        summary["scaling_efficiency_worst"] = min(effs, key=effs.get)
        verdicts = [summary.get(f"{k}_equiv_ok") for k in effs]
        summary["loss_match"] = None if None in verdicts else all(verdicts)
        if summary["loss_match"] is None:
            summary["loss_match_note"] = "no equivalence phase: " + \
                ",".join(sorted(k for k in effs if summary.get(f"{k}_equiv_ok") is None))
        summary["loss_match_failed"] = ",".join(sorted(k for k in effs if summary.get(f"{k}_equiv_ok") is False))
        summary["runs"] = ",".join(sorted(effs))
        for preset in {k.split("_")[0] for k in effs}:
            red = [summary.get(f"{k}_peak_reduction_gib") for k in effs if k.split("_")[0] == preset]
            red = [v for v in red if isinstance(v, (int, float)) and v == v]  # no NaN/None (CPU runs)
            summary[f"{preset}_peak_reduction_gib_min"] = min(red) if red else None


def _checkpoint_check(args, gpus, tmp):
    folder = tmp / "ckpt"
    folder.mkdir()
    a = argparse.Namespace(**{**vars(args), "profile": False})
    common = ["--ckpt-dir", str(folder), "--ckpt-world", str(gpus)]
    try:
        _launch_all(args, [(_cmd(a, gpus, a.batch_size, folder / "unused.json", "plain", ["--ckpt", "save"] + common),
                            None)])
        _launch_all(args, [(_cmd(a, 1, a.batch_size, folder / "unused.json", "plain", ["--ckpt", "load"] + common),
                            None)])
        return json.loads((folder / "load.json").read_text())
    except Exception as err:
        return {"checkpoint_2to1_ok": False, "error": f"{type(err).__name__}: {err}"}


def _write(args, gpus, rows, summary, curves, extra, name):
    from thrifty.bench import write_result

    out_dir = Path(tempfile.mkdtemp(prefix="multi_gpu_smoke_")) if args.smoke else None
    path = write_result(name, rows, summary, results_dir=out_dir, device=extra.get("device"),
                        extra={**extra, "gpus": gpus, "loss_tol_nats": LOSS_TOL, "nccl_nvls_enable": 0,
                               "curves": curves})
    _plot(rows, curves, gpus, path.with_suffix(".png"))
    return path


def driver(args) -> None:
    from thrifty.bench import print_table

    gpus = args.gpus or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    if not args.smoke and gpus < 2:
        raise SystemExit(f"--gpus: need at least 2 GPUs for a scaling figure, have {gpus}")
    rows, summary, curves = [], {}, {}
    extra = {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "recipe", "part")},
             "presets": {}}
    tmp = Path(tempfile.mkdtemp(prefix="multi_gpu_"))
    name = f"multi_gpu_part_{args.part_name}" if args.part_name else "multi_gpu"
    path = None
    for preset in args.presets.split(","):
        b, t, lr, equiv_lr = PRESET_DEFAULTS.get(preset, PRESET_DEFAULTS["135m"])
        pa = argparse.Namespace(**{**vars(args), "preset": preset, "batch_size": args.batch_size or b,
                                   "seq_len": args.seq_len or t, "lr": args.lr or lr,
                                   "equiv_lr": args.equiv_lr or equiv_lr})
        t0 = time.perf_counter()
        results = _run_preset(pa, gpus, tmp)
        extra["presets"][preset] = {"batch_per_gpu": pa.batch_size, "seq_len": pa.seq_len, "lr": pa.lr,
                                    "equiv_lr": pa.equiv_lr, "equiv_steps": pa.equiv_steps,
                                    "wall_s": time.perf_counter() - t0}
        _fold(preset, results, gpus, rows, summary, curves, extra)
        _finalize(summary, gpus)
        path = _write(args, gpus, rows, summary, curves, extra, name)  # after every preset: a timeout keeps these
    if args.checkpoint_check:
        pa = argparse.Namespace(**{**vars(args), "preset": args.presets.split(",")[0] if args.smoke else "135m",
                                   "batch_size": 2, "seq_len": args.seq_len or (32 if args.smoke else 512),
                                   "lr": args.lr or 1e-3, "equiv_lr": 0.0})
        extra["checkpoint_check"] = _checkpoint_check(pa, gpus, tmp)
        summary["checkpoint_2to1_ok"] = bool(extra["checkpoint_check"].get("checkpoint_2to1_ok"))
        path = _write(args, gpus, rows, summary, curves, extra, name)
    print_table(rows)
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


def merge(args) -> None:
    """Folds part files (--part-name runs, e.g. one per call) into benchmarks/results/multi_gpu_<device>.json."""
    from thrifty.bench import print_table, read_result

    docs = [read_result(p) for p in args.merge]
    devices = {d["device"] for d in docs}
    gpus = {d["extra"]["gpus"] for d in docs}
    if len(devices) != 1 or len(gpus) != 1:
        raise SystemExit(f"--merge: parts from different devices/GPU counts {sorted(devices)} {sorted(gpus)}")
    rows, summary, curves = [], {}, {}
    extra = {"merged_from": [str(p) for p in args.merge], "device": devices.pop(), "presets": {}}
    for d in docs:
        rows += d["rows"]
        summary.update({k: v for k, v in d["summary"].items()})
        curves.update(d["extra"].get("curves", {}))
        for key in ("presets", "comm_per_step", "profile", "equivalence", "scaling_runs"):
            extra.setdefault(key, {}).update(d["extra"].get(key) or {})
        if "checkpoint_check" in d["extra"]:
            extra["checkpoint_check"] = d["extra"]["checkpoint_check"]
        extra.setdefault("parts_meta", []).append(d.get("meta"))
    gpus = gpus.pop()
    for key, rec in dict(extra.get("equivalence") or {}).items():  # verdicts by today's comparator
        _equivalence_keys(key, rec["n_gpu"], rec["one_gpu_same_batches"], rec["one_gpu_repeat"], summary, extra)
    _finalize(summary, gpus)
    args.smoke = False
    path = _write(args, gpus, rows, summary, curves, extra, "multi_gpu")
    print_table(rows)
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


def _plot(rows, curves, gpus, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "tokens_per_s" in r]
    presets = list(dict.fromkeys(r["preset"] for r in ok)) or ["-"]
    fig, axes = plt.subplots(len(presets), 2, figsize=(12, 4 * len(presets)), squeeze=False)
    for (ax1, ax2), preset in zip(axes, presets):
        mine = [r for r in ok if r["preset"] == preset]
        recipes = list(dict.fromkeys(r["recipe"] for r in mine))
        for i, n in enumerate(sorted({r["gpus"] for r in mine})):
            sel = [next((r for r in mine if r["recipe"] == rc and r["gpus"] == n), None) for rc in recipes]
            bars = ax1.bar([j + 0.4 * i for j in range(len(recipes))], [r["tokens_per_s"] if r else 0 for r in sel],
                           width=0.4, label=f"{n} GPU(s)")
            ax1.bar_label(bars, labels=[f"{r['peak_gib_per_gpu']:.1f} GiB" if r and r.get("peak_gib_per_gpu") is not None
                                         else "" for r in sel], fontsize=7)
        ax1.set_xticks([j + 0.2 for j in range(len(recipes))], recipes)
        ax1.set_ylabel("tokens/s (all GPUs)")
        ax1.set_title(f"{preset}: throughput, same batch per GPU (labels: peak GiB per GPU)")
        ax1.legend()
        for key, curve in curves.items():
            if not key.startswith(preset + "_"):
                continue
            line = ax2.plot(curve["n_gpu"], label=f"{key[len(preset) + 1:]}: {gpus} GPUs")[0]
            ax2.plot(curve["one_gpu_same_batches"], "--", color=line.get_color(), label="1 GPU, same batches")
            ax2.plot(curve["one_gpu_repeat"], ":", color=line.get_color(), label="1 GPU again (another GPU)")
        ax2.set_xlabel("step of the equivalence phase (constant lr)")
        ax2.set_ylabel("train loss (nats/token)")
        ax2.set_title(f"{preset}: equivalence phase, N GPUs vs 1 GPU twice")
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=0, help="N (default: every visible GPU; 2 for --smoke)")
    ap.add_argument("--recipes", default="plain,cce,bitnet,neuzip")
    ap.add_argument("--presets", default="135m,1b", help="model presets, run one after the other")
    ap.add_argument("--batch-size", type=int, default=0, help="per GPU (0: the preset's, PRESET_DEFAULTS)")
    ap.add_argument("--seq-len", type=int, default=0, help="0: the preset's")
    ap.add_argument("--steps", type=int, default=50, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.0, help="the timed run's peak lr (0: the preset's)")
    ap.add_argument("--block-steps", type=int, default=10,
                    help="timed steps per block; N-GPU and 1-GPU blocks alternate, the scaling is the median pair")
    ap.add_argument("--equiv-steps", type=int, default=EQUIV_STEPS,
                    help="steps of the equivalence phase that decides loss_match (0: none)")
    ap.add_argument("--equiv-lr", type=float, default=0.0, help="its constant lr (0: the preset's)")
    ap.add_argument("--prefetch", type=int, default=1, help="shard_model(prefetch=): 0 = FSDP2's implicit order")
    ap.add_argument("--block-units", choices=("auto", "all"), default="auto",
                    help="shard_model(block_units=): all = a unit per block even without weight matrices (NeuZip)")
    ap.add_argument("--blocks-per-unit", default="auto",
                    help="shard_model(blocks_per_unit=): auto (units of >= 16M parameters) or an int (1: one per block)")
    ap.add_argument("--profile", action="store_true",
                    help="one extra step per recipe under torch.profiler: NCCL vs compute, exposed NCCL, idle GPU")
    ap.add_argument("--checkpoint-check", action="store_true",
                    help="save a sharded checkpoint on N ranks, load it in 1 process: checkpoint_2to1_ok")
    ap.add_argument("--part-name", default="", help="write multi_gpu_part_<name>_<device>.json (fold with --merge)")
    ap.add_argument("--merge", nargs="+", default=None, help="part files to fold into multi_gpu_<device>.json")
    ap.add_argument("--launch-timeout", type=float, default=540, help="seconds per torchrun launch")
    ap.add_argument("--nccl-timeout", type=float, default=180, help="seconds before a stuck collective fails")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 processes, tiny sizes")
    ap.add_argument("--inject-bug", choices=("grad_x2_rank0", "grad_sum", "skip_update_rank1"), default=None,
                    help=argparse.SUPPRESS)  # test-only (--smoke): a sharding bug loss_match must catch
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--preset", default="135m", help=argparse.SUPPRESS)
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", choices=("save", "load"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt-world", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--grad-accum", type=int, default=1, help=argparse.SUPPRESS)  # the loss reference's micro-batches
    ap.add_argument("--phase", choices=("equiv", "time"), default="time", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inject_bug and not args.smoke:
        ap.error("--inject-bug: test-only, allowed with --smoke alone (it would make a real run's result wrong)")
    if args.blocks_per_unit != "auto" and not (args.blocks_per_unit.isdigit() and int(args.blocks_per_unit) >= 1):
        ap.error(f"--blocks-per-unit: expected auto or an int >= 1, got {args.blocks_per_unit!r}")
    if args.block_steps < 1:
        ap.error(f"--block-steps: expected 1 or more, got {args.block_steps}")
    if args.equiv_steps < 0:
        ap.error(f"--equiv-steps: expected 0 or more, got {args.equiv_steps}")
    if args.smoke and not args.worker:
        args.presets, args.steps, args.warmup = "tiny", 4, 1
        args.equiv_steps = min(args.equiv_steps, 4)
        args.block_steps = min(args.block_steps, 2)  # two block pairs: the alternation exercised
        args.gpus = args.gpus or 2
    if args.merge:
        merge(args)
    elif args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
