"""Where a BitNet training step's time goes: one step (forward, backward, AdamW) of fp, b1.58 and a4.8 under
torch.profiler, per recipe, plus what the host does per step.

For each recipe (same model, batch, process) it reports:

* step ms: median of ``--reps`` steps (CUDA events), and the GPU-busy ms of the profiled step (sum of kernel
  times): step ≫ busy means the GPU waits for the host (launch overhead, syncs);
* the top CUDA kernels by total time (count, total µs, µs per call) and the per-kernel difference of a4.8 vs
  b1.58 and b1.58 vs fp (which kernels the extra time is in);
* kernel launches (CUDA runtime/driver launch calls), host syncs (cudaStreamSynchronize/cudaDeviceSynchronize/
  cudaEventSynchronize/cudaMemcpy calls, and aten ``_local_scalar_dense`` = ``.item()``/``int()``/``float()``);
* CPU-side time: the step's wall time on the host and the self CPU time of the top host ops;
* from a TorchDispatchMode pass over one more step: aten op count per phase, dtype conversions (``_to_copy``),
  the BitLinear paths (``last_path``: "triton" or "reference") and the Triton launches of the BitNet kernels.

Writes ``benchmarks/results/bitnet_profile_<device>.json`` (rows: one per (recipe, kernel) of the top table and
one "step" row per recipe; summary: step ms, busy ms, launches, syncs per recipe). GPU box, < 60 s:

    THRIFTY_COMMIT=<sha> bash benchmarks/run_on_gpu.sh benchmarks/bitnet_profile.py

``--smoke``: tiny sizes on the CPU (kernels under TRITON_INTERPRET=1, CPU profiler only) into a temporary folder.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from thrifty import bitnet
from thrifty.bench import (RandomTokens, count_launches, default_results_dir, detect_device, print_table, time_fn,
                           write_result)
from thrifty.bitnet.bitlinear import BitLinear
from thrifty.models import LlamaForCausalLM, preset
from thrifty.train import Trainer, TrainConfig

RECIPES = ("fp", "b1.58", "a4.8")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuCtxSynchronize")  # cudaMemcpy (not ...Async) waits for the GPU
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel")
VIEW_OPS = {"view", "t", "transpose", "detach", "_unsafe_view", "slice", "expand", "unsqueeze", "squeeze",
            "split", "alias", "as_strided", "permute", "select", "_reshape_alias", "unbind", "split_with_sizes"}
# the BitNet training kernels whose launches are counted (thrifty.bitnet.quant_kernel's three; topk_kernel's 16-bit
# TopK rows: a4.8's o_proj under autocast), by kernel name as bench.count_launches reports them
BITNET_KERNELS = ("_quantize_rows_kernel", "_norm_backward_kernel", "_ternary_kernel", "_topk_int8_kernel")


class OpCounter(TorchDispatchMode):
    """aten ops per phase ("fwd", "bwd", "opt"), view ops left out; ops inside a counted Triton launch (the
    interpreter's own tensor traffic) left out too."""

    def __init__(self):
        super().__init__()
        self.phase = "fwd"
        self.inside_kernel = 0
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.inside_kernel and name not in VIEW_OPS:
            self.ops[(self.phase, name)] += 1
        return out


def bitnet_launch_counter(counter: OpCounter, launches: collections.Counter):
    """``around`` for bench.count_launches: each BitNet kernel launch counted per phase, and the ops inside it (the
    interpreter's own tensor traffic) kept out of the op counter; other kernels' launches pass untouched."""

    @contextlib.contextmanager
    def around(name):
        if name not in BITNET_KERNELS:
            yield
            return
        launches[(counter.phase, name)] += 1
        counter.inside_kernel += 1
        try:
            yield
        finally:
            counter.inside_kernel -= 1
    return around


def make_trainer(recipe: str, impl: str, args, device) -> Trainer:
    config = preset(args.preset, vocab_size=args.vocab_size)
    with torch.device(device):
        model = LlamaForCausalLM(config).init_weights(seed=0)
    if recipe != "fp":
        bitnet.convert(model, bitnet.BitNetConfig(recipe=recipe, impl=impl))
    cfg = TrainConfig(steps=10**6, batch_size=args.batch_size, seq_len=args.seq_len, lr=1e-3, warmup_steps=1,
                      autocast="bf16")  # bf16 autocast on the CPU too: the smoke run takes the GPU's dtype path
    return Trainer(model, RandomTokens(config.vocab_size), None, cfg)


def count_step(trainer: Trainer) -> dict:
    """One step under the op counter: aten ops per phase, conversions, syncs, BitLinear paths, Triton launches."""
    counter, launches = OpCounter(), collections.Counter()
    original_clip = torch.nn.utils.clip_grad_norm_

    def forward_starts(module, args):
        counter.phase = "fwd"

    def forward_ends(module, args, loss):  # the model's output with labels: the step's loss
        loss.register_hook(lambda g: setattr(counter, "phase", "bwd"))

    def clip(*a, **k):
        counter.phase = "opt"
        return original_clip(*a, **k)

    hooks = [trainer.model.register_forward_pre_hook(forward_starts),
             trainer.model.register_forward_hook(forward_ends)]
    torch.nn.utils.clip_grad_norm_ = clip
    try:
        with count_launches(bitnet_launch_counter(counter, launches)), counter:
            trainer.train_step()
    finally:
        for hook in hooks:
            hook.remove()
        torch.nn.utils.clip_grad_norm_ = original_clip
    paths = collections.Counter(f"{n.rsplit('.', 1)[-1]}:{m.last_path}" for n, m in trainer.model.named_modules()
                                if isinstance(m, BitLinear))
    out = {}
    for phase in ("fwd", "bwd", "opt"):
        ops = {k[1]: v for k, v in counter.ops.items() if k[0] == phase}
        out[f"aten_ops_{phase}"] = sum(ops.values())
        out[f"to_copy_{phase}"] = ops.get("_to_copy", 0)
        out[f"triton_launches_{phase}"] = sum(v for k, v in launches.items() if k[0] == phase)
    out["aten_ops"] = sum(counter.ops.values())
    out["item_syncs"] = sum(v for k, v in counter.ops.items() if k[1] in ("_local_scalar_dense", "item"))
    out["nonzero_or_mask"] = sum(v for k, v in counter.ops.items()
                                 if k[1] in ("nonzero", "masked_select", "masked_scatter", "unique"))
    out["bitlinear_paths"] = dict(paths)
    out["triton_launches_by_kernel"] = {f"{k[0]}:{k[1]}": v for k, v in sorted(launches.items())}
    return out


def phase_split(trainer: Trainer, device) -> dict:
    """Host-bound or GPU-bound, per phase: one forward + backward (the Trainer's, without the optimizer) with a
    host clock and a CUDA event at the same three points. The event after the forward completes when the GPU
    has run the forward; the host reaches that point when it has enqueued it. GPU ms ≈ host ms: the GPU waited
    for the host (launch overhead); GPU ms ≫ host ms: the GPU is the bottleneck."""
    cuda = device.type == "cuda"
    inputs, labels = trainer.train_data.batch(trainer.cfg.batch_size, trainer.cfg.seq_len, generator=trainer.generator)
    inputs, labels = inputs.to(device), labels.to(device)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else None
    if cuda:
        torch.cuda.synchronize()
    t = [time.perf_counter()]
    if cuda:
        events[0].record()
    cfg = trainer.cfg  # the Trainer's autocast and loss (a thrifty model: the loss is model(inputs, labels=labels))
    bf16 = cfg.autocast == "bf16" or (cfg.autocast == "auto" and trainer.device.type == "cuda")
    with torch.autocast(trainer.device.type, dtype=torch.bfloat16, enabled=bf16, cache_enabled=not cfg.cuda_graph):
        loss = trainer.model(inputs, labels=labels)
    t.append(time.perf_counter())
    if cuda:
        events[1].record()
    loss.backward()
    t.append(time.perf_counter())
    if cuda:
        events[2].record()
        torch.cuda.synchronize()
    trainer.optimizer.zero_grad(set_to_none=True)
    out = {"fwd_host_ms": (t[1] - t[0]) * 1e3, "bwd_host_ms": (t[2] - t[1]) * 1e3,
           "loss_finite": bool(torch.isfinite(loss.detach()).item())}
    if cuda:
        out.update(fwd_gpu_ms=events[0].elapsed_time(events[1]), bwd_gpu_ms=events[1].elapsed_time(events[2]))
    return out


def profile_step(trainer: Trainer, device, top: int) -> tuple:
    """(step summary, top kernel rows) of one profiled step."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        trainer.train_step()
        host_ms = (time.perf_counter() - t0) * 1e3  # ends at the step's last sync (float(grad norm))
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    launches = syncs = 0
    for e in events:
        if cuda and getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name]
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        elif e.name in LAUNCH_CALLS:
            launches += 1
        elif e.name in SYNC_CALLS:
            syncs += 1
    busy_us = sum(v[1] for v in kernels.values())
    if not cuda:  # the CPU smoke run: the aten ops stand in for kernels (self CPU time)
        for a in prof.key_averages():
            if a.key.startswith("aten::"):
                kernels[a.key] = [a.count, a.self_cpu_time_total]
    rows = [{"kernel": name[:120], "calls": n, "total_us": us, "us_per_call": us / max(n, 1)}
            for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])]
    host_top = sorted((a for a in prof.key_averages() if not a.key.startswith(("cuda", "cu"))),
                      key=lambda a: -a.self_cpu_time_total)[:top]
    summary = {"host_ms": host_ms, "gpu_busy_ms": busy_us / 1e3, "kernel_launches": launches,
               "kernels_run": sum(v[0] for v in kernels.values()) if cuda else 0, "cuda_syncs": syncs,
               "host_top": [{"op": a.key[:80], "calls": a.count, "self_cpu_us": a.self_cpu_time_total}
                            for a in host_top]}
    return summary, rows


def kernel_diff(a: list, b: list, n: int) -> list:
    """Kernels whose total time differs most between two recipes' tables (a − b)."""
    ta = {r["kernel"]: r for r in a}
    tb = {r["kernel"]: r for r in b}
    names = set(ta) | set(tb)
    diff = [{"kernel": k, "calls": ta.get(k, {}).get("calls", 0) - tb.get(k, {}).get("calls", 0),
             "extra_us": ta.get(k, {}).get("total_us", 0.0) - tb.get(k, {}).get("total_us", 0.0)} for k in names]
    return sorted(diff, key=lambda r: -abs(r["extra_us"]))[:n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="30m")
    ap.add_argument("--vocab-size", type=int, default=49152)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results; --smoke: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, results to a temporary folder")
    args = ap.parse_args(argv)
    impl = "auto"
    if args.smoke:  # set TRITON_INTERPRET=1 before thrifty is imported: the kernels run in the interpreter
        args.preset, args.vocab_size, args.batch_size, args.seq_len = "tiny", 256, 1, 8
        args.warmup, args.reps, args.top, impl = 0, 1, 5, "triton"
        args.out = args.out or tempfile.mkdtemp(prefix="bitnet_profile_smoke_")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    label = args.label or detect_device(device)
    recipes = [r for r in args.recipes.split(",") if r]
    torch.manual_seed(0)
    t_start = time.perf_counter()

    rows, tables, per = [], {}, {}
    trainers = {}
    for recipe in recipes:
        trainers[recipe] = trainer = make_trainer(recipe, impl, args, device)
        for _ in range(args.warmup):
            trainer.train_step()
    # step times interleaved (fp, b1.58, a4.8, fp, ...): no recipe pays for running later in the process
    # (bitnet_step.py times them one after the other)
    times = collections.defaultdict(list)
    for _ in range(args.reps):
        for recipe in recipes:
            times[recipe] += time_fn(trainers[recipe].train_step, warmup=0, reps=1, device=device).times_ms
    for recipe in recipes:
        trainer = trainers.pop(recipe)
        step_ms = statistics.median(times[recipe])
        counts = count_step(trainer)
        prof, table = profile_step(trainer, device, args.top)
        split = phase_split(trainer, device)
        tables[recipe] = table
        per[recipe] = {"step_ms": step_ms, **prof, **counts, **split}
        rows.append({"what": "step", "recipe": recipe, "step_ms": step_ms, "host_ms": prof["host_ms"],
                     "gpu_busy_ms": prof["gpu_busy_ms"], "kernel_launches": prof["kernel_launches"],
                     "cuda_syncs": prof["cuda_syncs"], "item_syncs": counts["item_syncs"],
                     "aten_ops": counts["aten_ops"], "to_copy": counts["to_copy_fwd"] + counts["to_copy_bwd"],
                     "triton_launches": sum(counts[f"triton_launches_{p}"] for p in ("fwd", "bwd", "opt")),
                     **{k: v for k, v in split.items()}})
        rows += [{"what": "kernel", "recipe": recipe, **r} for r in table[:args.top]]
        print(f"\n== {recipe}: step {step_ms:.2f} ms, GPU busy {prof['gpu_busy_ms']:.2f} ms, host "
              f"{prof['host_ms']:.2f} ms, launches {prof['kernel_launches']}, syncs {prof['cuda_syncs']} "
              f"(item {counts['item_syncs']}), aten ops {counts['aten_ops']}", flush=True)
        print("   forward/backward, host vs GPU ms:", {k: round(v, 2) if isinstance(v, float) else v
                                                      for k, v in split.items()})
        print("   paths:", counts["bitlinear_paths"], " triton:", counts["triton_launches_by_kernel"])
        print_table(table[:args.top], ["kernel", "calls", "total_us", "us_per_call"], max_width=90)
        print_table(prof["host_top"], ["op", "calls", "self_cpu_us"], max_width=80)
        del trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()

    for a, b in (("a4.8", "b1.58"), ("b1.58", "fp")):
        if a in tables and b in tables:
            diff = kernel_diff(tables[a], tables[b], args.top)
            rows += [{"what": "diff", "recipe": f"{a} - {b}", **r} for r in diff]
            print(f"\n== kernels, {a} minus {b} (µs per step)")
            print_table(diff, ["kernel", "calls", "extra_us"], max_width=90)
    summary = {}
    for r, v in per.items():
        tag = r.replace(".", "")
        summary.update({f"step_ms_{tag}": v["step_ms"], f"gpu_busy_ms_{tag}": v["gpu_busy_ms"],
                        f"host_ms_{tag}": v["host_ms"], f"kernel_launches_{tag}": v["kernel_launches"],
                        f"cuda_syncs_{tag}": v["cuda_syncs"], f"item_syncs_{tag}": v["item_syncs"],
                        f"aten_ops_{tag}": v["aten_ops"], f"fwd_host_ms_{tag}": v["fwd_host_ms"],
                        f"bwd_host_ms_{tag}": v["bwd_host_ms"],
                        **({f"fwd_gpu_ms_{tag}": v["fwd_gpu_ms"], f"bwd_gpu_ms_{tag}": v["bwd_gpu_ms"]}
                           if "fwd_gpu_ms" in v else {})})
    summary["seconds"] = time.perf_counter() - t_start
    extra = {"args": vars(args), "per_recipe": per,
             "note": "smoke run: tiny sizes, CPU profiler, measures nothing" if args.smoke else
             "issue #31: where the BitNet step's extra time goes (a4.8 goal <= 1.3x fp)"}
    results_dir = Path(args.out) if args.out else default_results_dir()
    path = write_result("bitnet_profile", rows, summary, device=label, extra=extra, results_dir=results_dir)
    print_table([r for r in rows if r["what"] == "step"],
                ["recipe", "step_ms", "gpu_busy_ms", "host_ms", "fwd_host_ms", "fwd_gpu_ms", "bwd_host_ms",
                 "bwd_gpu_ms", "kernel_launches", "cuda_syncs", "item_syncs", "aten_ops", "triton_launches"])
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}, indent=1))
    print(f"wrote {path} in {summary['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
