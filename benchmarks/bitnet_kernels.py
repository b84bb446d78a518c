"""BitNet inference kernels (issue #29): packed ternary W2×A8 against bf16 ``F.linear`` (cuBLAS) and int8
``torch._int_mm``, side by side in one run.

1. **Gate**: on each shape the Triton kernels must equal the PyTorch path of ``PackedBitLinear`` (bit for bit for
   INT8 inputs): a wrong kernel is reported, never timed as if it were right.
2. **Layers**: 7B shapes (N×K = 4096×4096, 11008×4096, 4096×11008) and 2B shapes (2560×2560, 6912×2560,
   2560×6912), tokens ∈ {1, 4, 16, 128, 2048}. Per row: GPU time (``gpu_only``: the host's launch path hidden
   behind a spin kernel, what a CUDA-graph decode sees) and host-inclusive time, effective weight GB/s and its
   share of the measured HBM bandwidth (a device-to-device copy). thrifty = activation quantization (b1.58:
   INT8 per token) + matmul; ``thrifty_matmul`` = the matmul alone on ready codes; ``codes`` = the activation
   quantizer alone as the layer calls it (``layer_codes``), with its byte floor (``floor_ms``: x read + codes
   written at the measured copy bandwidth) and ``pct_of_floor`` (100 = at the floor). a4.8's quantizers (INT4, TopK)
   are timed at 1 and 16 tokens. ``torch._int_mm`` needs more than 16 rows: it runs on 17-row-padded inputs.
   ``launch`` is the smallest kernel (a one-element add) timed the same way: the fixed cost of any layer call
   here; each thrifty row's ``floor_ms`` = that + the packed bytes at the copy bandwidth, ``floor_speedup_vs_bf16``
   the most a one-launch layer could show, ``pct_of_floor_speedup`` the share of it reached.
   **Graph** rows (``what="graph"``, 1-16 tokens): the layer replayed in a CUDA graph, each call on its own weight
   copy, with copies enough for twice the L2 (the eager rows re-read one layer's weights, L2-resident when
   packed); the floor there uses a launch inside a graph. This is how decode runs (and how the anchors measure).
3. **Sweep** (M = 1 and 16, 7B shapes): other tiles / K splits of the same kernels, so ``plan()`` can be checked.
4. **Model decode**: a Llama-7B-shaped model (32 layers, 4096 / 11008, vocab 32000) with *random* ternary weights
   (speed does not depend on the values, so random weights are honest for it) against the same shape in bf16,
   batch 1, 2, 4 and 16 (``--batches``), 128 cached tokens: ms per decode step as run eagerly (host included),
   the GPU busy time (sum of the step's kernel durations, torch.profiler), per new token of
   ``generate(..., cuda_graph=True)`` (each step one graph replay, the call's capture included) and per new token of a ``GraphedDecoder`` called
   again (the graph captured once, replayed across calls); tokens/s from the reused-graph figure when it ran,
   weight bytes; KV-cache bytes at 32K context computed.

Writes ``benchmarks/results/bitnet_kernels_<device>.json`` + PNG; summary keys ``gemv_speedup_vs_bf16_b1_min``,
``gemv_speedup_vs_bf16_b16_min``, ``gemm_speedup_vs_bf16_t2048_min`` (7B shapes, GPU time, full layer incl.
activation quantization), ``gemv_speedup_vs_bf16_b{1,16}_graph_min`` (graph rows),
``gemv_floor_speedup_vs_bf16_b{1,16}[_graph]_min`` and ``gemv_pct_of_floor_speedup_b{1,16}[_graph]_min`` (the
floors above), ``launch_floor_us`` / ``launch_floor_graph_us``, ``packed_weight_mem_ratio``, ``decode_tokens_per_s_ratio_vs_bf16_b1`` (the reused
graph; ``..._graph_one_shot``, ``..._gpu_busy`` and ``..._eager`` beside it), ``kv3_ppl_delta_pct`` (copied from
``benchmarks/bitnet_kv.py``'s result). GPU box:

    THRIFTY_COMMIT=<sha> bash benchmarks/run_on_gpu.sh benchmarks/bitnet_kernels.py

``--smoke``: tiny shapes on the CPU (kernels under TRITON_INTERPRET=1), results to a temporary folder; measures
nothing. ``--no-model`` / ``--no-sweep`` skip parts. ``--baseline-src OLD/src`` (``git archive OLD | tar -x -C
/tmp/old``) also times the layer rows (and, without ``--no-model``, the model decode rows) with another tree's
code in the same run (rows tagged ``tree``, summary keys ``thrifty_speedup_vs_baseline_<shape>_t<tokens>`` and
``decode_<figure>_speedup_vs_baseline_<model>_b<batch>``):

    THRIFTY_COMMIT=<sha> THRIFTY_NO_INSTALL=1 bash benchmarks/run_on_gpu.sh benchmarks/bitnet_kernels.py \
        --no-model --tokens 1,4,16 --baseline-src /tmp/old/src
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from pathlib import Path

if "--smoke" in sys.argv:  # before any kernel module is imported: the interpreter is chosen at jit time
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

from thrifty.bench import default_results_dir, detect_device, print_table, time_fn, write_result
from thrifty.bitnet import PackedBitLinear, relu_squared
from thrifty.bitnet import packed_kernel as PK
from thrifty.bitnet.bitlinear import SharedInput
from thrifty.bitnet.pack import pack_ternary
from thrifty.bitnet.packed import integer_matmul

SHAPES = {"7B": [(4096, 4096), (11008, 4096), (4096, 11008)], "2B": [(2560, 2560), (6912, 2560), (2560, 6912)],
          "7B stacked": [(12288, 4096), (22016, 4096)]}  # q/k/v and gate/up of the stacked 7B model (MHA)
TOKENS = (1, 4, 16, 128, 2048)
INT_MM_MIN_ROWS = 17  # torch._int_mm on CUDA wants more than 16 rows
ROWS_MARK = "BITNET_KERNEL_ROWS "  # the line a --rows-only run prints its rows on (for --baseline-src)


def random_packed(n: int, k: int, activation: str, device, seed: int = 0) -> PackedBitLinear:
    """A PackedBitLinear of random ternary codes (speed does not depend on the values) and α = 0.02."""
    g = torch.Generator(device=device).manual_seed(seed)  # on the GPU: 6.5B codes for the 7B model
    layer = PackedBitLinear(k, n, activation=activation, device=device)
    codes = torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8, device=device)
    with torch.no_grad():
        layer.packed.copy_(pack_ternary(codes))
        layer.alpha.fill_(0.02)
    return layer


def hbm_bandwidth_gbs(device, args) -> float:
    """Device-to-device copy of a large buffer: bytes read + written per second."""
    n = (1 << 28) if device.type == "cuda" else (1 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), warmup=3, reps=args.reps, device=device)
    return 2 * n / t.median_ms / 1e6


def torch_path(layer: PackedBitLinear, x: torch.Tensor) -> torch.Tensor:
    """``PackedBitLinear``'s PyTorch path from the layer's public pieces: the same ops in the same order (so the
    same bits), in this tree and in every older one a ``--baseline-src`` run may load."""
    codes, scale = layer.quantize_input(x)
    acc = integer_matmul(codes, layer.ternary())
    y = (acc.float() * scale[:, None]) * layer.row_scale()[None, :]
    if layer.bias is not None:
        y = y + layer.bias
    return y.to(x.dtype)


def check_kernels(layer: PackedBitLinear, x: torch.Tensor) -> dict:
    """Kernel output vs the PyTorch path on the same device (the integer dot is exact in both)."""
    want = torch_path(layer, x)
    got = PK.packed_linear(x, layer)
    diff = (got.float() - want.float()).abs().max().item()
    return {"match": bool(torch.equal(got, want)), "max_abs_diff": diff}


def choose_decode_asm(device) -> dict:
    """The kernels' inline PTX (dp4a, 4-byte decode) runs only on the GPU, never in CI's interpreter: check it
    first on one GEMV and one tensor-core shape, and fall back to the plain-Triton decode if it is wrong, so
    the run still times correct kernels (and says which)."""
    if device.type != "cuda":
        return {"used": PK.USE_ASM, "note": "interpreter: plain Triton decode"}
    layer = random_packed(300, 1100, "int8", device, seed=1)
    results = {}
    for use_asm in (True, False):
        PK.USE_ASM = use_asm
        results[use_asm] = [check_kernels(layer, torch.randn(m, 1100, device=device, dtype=torch.bfloat16))["match"]
                            for m in (1, 3, 16, 200)]
        if all(results[use_asm]):
            break
    PK.USE_ASM = all(results[True])
    return {"used": PK.USE_ASM, "asm_matches": results[True], "plain_matches": results.get(False)}


def _timed(fn, args, device, gpu_only=True) -> float:
    return time_fn(fn, warmup=args.warmup, reps=args.reps, gpu_only=gpu_only and device.type == "cuda",
                   device=device).median_ms


def layer_rows(args, device, hbm_gbs: float) -> list[dict]:
    rows = []
    for model_name, shapes in args.shapes.items():
        for n, k in shapes:
            layer = random_packed(n, k, "int8", device)
            w_bf16 = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
            w_i8 = torch.randint(-1, 2, (k, n), device=device, dtype=torch.int8)
            for m in args.tokens:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                gate = check_kernels(layer, x) if m in args.check_tokens else {}
                codes, scale, sums = PK.quantize_codes(x, "int8")
                rs = layer.row_scale()
                base = dict(model=model_name, shape=f"{n}x{k}", N=n, K=k, tokens=m, **gate)
                impls = {
                    "bf16": (lambda: F.linear(x, w_bf16), 2 * n * k),
                    "thrifty": (lambda: PK.packed_linear(x, layer), layer.packed.numel()),
                    "thrifty_matmul": (lambda: PK.matmul_codes(codes, scale, sums, layer.packed, rs, None,
                                                               torch.bfloat16, n, k), layer.packed.numel()),
                }
                xi = torch.randint(-127, 128, (max(m, INT_MM_MIN_ROWS), k), device=device, dtype=torch.int8)
                impls["int8_int_mm"] = (lambda: torch._int_mm(xi, w_i8), n * k)
                times = {}
                for impl, (fn, wbytes) in impls.items():
                    try:
                        ms = _timed(fn, args, device)
                    except Exception as err:  # noqa: BLE001 - e.g. _int_mm on a CPU build: an error row
                        rows.append({**base, "impl": impl, "error": f"{type(err).__name__}: {err}"[:300]})
                        continue
                    times[impl] = ms
                    gbs = wbytes / ms / 1e6
                    row = {**base, "impl": impl, "gpu_ms": ms, "weight_gbs": gbs, "pct_of_hbm": 100 * gbs / hbm_gbs}
                    if impl in ("thrifty", "bf16") and m <= 16:
                        row["host_ms"] = _timed(fn, args, device, gpu_only=False)
                    rows.append(row)
                for r in rows[-len(impls):]:
                    if "gpu_ms" in r and "bf16" in times:
                        r["speedup_vs_bf16"] = times["bf16"] / r["gpu_ms"]
                    if r.get("impl") == "thrifty" and args.launch_ms and "bf16" in times and m <= 16:  # bytes-bound
                        add_floor(r, args.launch_ms, layer.packed.numel(), hbm_gbs, times["bf16"])
                rows.append(codes_row(base, x, layer, args, device, hbm_gbs))
                if "gpu_ms" in rows[-1]:
                    times["codes"] = rows[-1]["gpu_ms"]
                print(f"  {model_name} {n}x{k} m={m}: " + ", ".join(f"{i} {t * 1e3:.1f} us" for i, t in times.items())
                      + (f"  match={gate.get('match')}" if gate else ""), flush=True)
    return rows


def launch_floor_ms(args, device) -> float | None:
    """One launch of the smallest kernel there is (a one-element add), timed as the layer rows are: the fixed
    cost every layer call pays under this timing, whatever it reads."""
    if device.type != "cuda":
        return None
    one = torch.zeros(1, device=device)
    return _timed(lambda: one.add_(1), args, device)


def add_floor(row: dict, fixed_ms: float, packed_bytes: int, hbm_gbs: float, bf16_ms: float) -> None:
    """The floor of a one-launch layer: the fixed launch cost plus the packed weights read once at the copy
    bandwidth; ``floor_speedup_vs_bf16`` is the most any such kernel could show against the bf16 time measured
    the same way, ``pct_of_floor_speedup`` how much of it this row reaches."""
    floor = fixed_ms + packed_bytes / hbm_gbs / 1e6
    row.update(floor_ms=floor, floor_speedup_vs_bf16=bf16_ms / floor,
               pct_of_floor_speedup=100 * (bf16_ms / row["gpu_ms"]) / (bf16_ms / floor))


def graph_ms_per_call(calls: list, device, args) -> float:
    """ms per call of ``calls`` run back to back inside one CUDA graph (each once per replay), the replay queued
    behind a spin kernel and timed by events: what a graph-replayed decode step sees (no host, no per-call event)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # compile and allocate outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    t = time_fn(graph.replay, warmup=2, reps=max(5, args.reps // 5), gpu_only=True, device=device)
    return t.median_ms / len(calls)


def copies_past_l2(nbytes: int, l2_bytes: int) -> int:
    """Weight copies (at least 2) that together hold twice the L2: cycled through, each is read from HBM."""
    return max(2, -(-2 * l2_bytes // nbytes))


def graph_rows(args, device, hbm_gbs: float) -> list[dict]:
    """Layer calls replayed in a CUDA graph, each call on its own copy of the weights, with enough copies to
    fill twice the L2 cache: every call reads its weights from HBM, as each layer of a decoded model does. (The
    eager rows call one layer again and again: its packed weights, 1.6-11 MB, stay in the 50-60 MB L2.) The
    floor is the same graph of one-element adds (a launch's cost inside a graph) plus the packed bytes at the
    copy bandwidth."""
    if device.type != "cuda":
        return []
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    one = torch.zeros(1, device=device)
    launch = graph_ms_per_call([lambda: one.add_(1)] * 64, device, args)
    rows = [dict(what="graph", impl="launch", gpu_ms=launch)]
    for model_name, shapes in args.shapes.items():
        for n, k in shapes:
            packed = [random_packed(n, k, "int8", device, seed=i) for i in range(copies_past_l2(n * k // 4, l2))]
            dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
                     for _ in range(copies_past_l2(2 * n * k, l2))]
            for m in args.graph_tokens_layers:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                base = dict(what="graph", model=model_name, shape=f"{n}x{k}", N=n, K=k, tokens=m)
                bf16 = graph_ms_per_call([lambda w=w: F.linear(x, w) for w in dense], device, args)
                ours = graph_ms_per_call([lambda layer=layer: PK.packed_linear(x, layer) for layer in packed],
                                         device, args)
                rows.append({**base, "impl": "bf16", "gpu_ms": bf16, "copies": len(dense),
                             "pct_of_hbm": 100 * 2 * n * k / bf16 / 1e6 / hbm_gbs})
                row = {**base, "impl": "thrifty", "gpu_ms": ours, "copies": len(packed),
                       "speedup_vs_bf16": bf16 / ours}
                add_floor(row, launch, packed[0].packed.numel(), hbm_gbs, bf16)
                rows.append(row)
                print(f"  graph {model_name} {n}x{k} m={m}: bf16 {bf16 * 1e3:.1f} us, thrifty {ours * 1e3:.1f} us "
                      f"({bf16 / ours:.2f}x; floor {row['floor_speedup_vs_bf16']:.2f}x)", flush=True)
            del packed, dense
            torch.cuda.empty_cache()
    return rows


def codes_row(base: dict, x: torch.Tensor, layer: PackedBitLinear, args, device, hbm_gbs: float) -> dict:
    """The layer's activation quantizer alone (``PK.layer_codes``, as ``packed_linear`` calls it) against its
    byte floor: x read once and the int8 codes (zero-padded to whole groups) written once at the measured copy
    bandwidth (scales and sums, 8 bytes a row, left out). ``pct_of_floor`` = 100 · floor / time."""
    m, k = x.shape
    kp = -(-k // 256) * 256  # pack.padded_k (whole 256-weight groups), spelled out for older --baseline-src trees
    floor_ms = (x.numel() * x.element_size() + m * kp) / hbm_gbs / 1e6
    try:
        ms = _timed(lambda: PK.layer_codes(x, layer), args, device)
    except Exception as err:  # noqa: BLE001 - an error row, as the other impls
        return {**base, "impl": "codes", "error": f"{type(err).__name__}: {err}"[:300]}
    which = getattr(PK, "codes_kernel", None)  # older --baseline-src trees have one codes kernel
    return {**base, "impl": "codes", "gpu_ms": ms, "floor_ms": floor_ms, "pct_of_floor": 100 * floor_ms / ms,
            "codes_kernel": which(layer.activation, m, k) if which else "whole-row"}


def a48_rows(args, device) -> list[dict]:
    """The a4.8 quantizers on the 7B attention/FFN inputs: INT4-range (q/k/v, gate/up) and TopK+INT8 (o)."""
    rows = []
    n, k = args.shapes[next(iter(args.shapes))][0]
    for kind in ("int8", "int4", "topk_int8"):
        layer = random_packed(n, k, kind, device)
        for m in (1, 16):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            rows.append(dict(what="a4.8 activation", activation=kind, shape=f"{n}x{k}", tokens=m,
                             gpu_ms=_timed(lambda: PK.packed_linear(x, layer), args, device),
                             quant_gpu_ms=_timed(lambda: PK.quantize_codes(x, kind), args, device),
                             **check_kernels(layer, x)))
    return rows


def checked_timing(row: dict, fn, want, args, device) -> dict:
    """``row`` with ``match`` (``fn()`` equal to ``want()`` bit for bit) and ``gpu_ms``, or the ``error`` either
    raised: one sweep config that fails to compile or run does not end the sweep."""
    try:
        row["match"] = bool(torch.equal(fn(), want()))
        row["gpu_ms"] = _timed(fn, args, device)
    except Exception as err:  # noqa: BLE001
        row["error"] = f"{type(err).__name__}: {err}"[:300]
    return row


def sweep_rows(args, device) -> list[dict]:
    """Other tiles and K splits at 1 and 16 tokens (the stacked 7B shapes at 1 token): is plan()'s choice the
    fastest?"""
    from thrifty.triton_utils import sm_count  # here: the sweep runs on this tree only (--baseline-src does not)

    rows = []
    shapes = [(shape, (1, 16)) for shape in args.shapes[next(iter(args.shapes))]]
    shapes += [(shape, (1,)) for shape in args.shapes.get("7B stacked", [])]
    for (n, k), tokens in shapes:
        layer = random_packed(n, k, "int8", device)
        groups = layer.packed.shape[1] // 64
        for m in tokens:
            codes, scale, sums = PK.quantize_codes(torch.randn(m, k, device=device, dtype=torch.bfloat16), "int8")
            rs = layer.row_scale()
            planned = PK.plan(m, n, k, sm_count(device))
            kernel = planned["kernel"]
            if kernel == "decode":
                rows += decode_sweep_rows(args, device, layer, m, planned)
                continue
            # gemm tiles below 64 weight rows lost at 16 tokens (bitnet NOTES: 11.6 / 9.3 µs against 9.5 at 4096²,
            # 28% slower at 11008x4096): 64 and 128 only
            configs = [(bn, sp) for bn in ((16, 32, 64) if kernel == "gemv" else (64, 128))
                       for sp in args.sweep_splits]
            for block_n, split in configs:
                per = -(-groups // split)
                cfg = dict(planned, BLOCK_N=block_n, split=-(-groups // per), groups_per_split=per)
                row = dict(what="sweep", shape=f"{n}x{k}", tokens=m, kernel=kernel, BLOCK_N=block_n,
                           split=cfg["split"],
                           planned=(block_n, cfg["split"]) == (planned["BLOCK_N"], planned["split"]))

                def run():
                    return PK.matmul_codes(codes, scale, sums, layer.packed, rs, None, torch.bfloat16, n, k, cfg)

                unsplit = dict(cfg, split=1, groups_per_split=groups)
                # the split must give the unsplit result bit for bit
                rows.append(checked_timing(row, run, lambda: PK.matmul_codes(
                    codes, scale, sums, layer.packed, rs, None, torch.bfloat16, n, k, unsplit), args, device))
    return rows


GEMM_TILES = [(bn, bm, warps, stages) for bn in (64, 128) for bm in (64, 128, 256) for warps in (4, 8)
              for stages in (3, 4) if not (bm == 256 and warps == 4)]  # 256 tokens x 4 warps: 256+ int32 registers


def gemm_sweep_rows(args, device) -> list[dict]:
    """Prefill tiles on ready codes (``--gemm-sweep-tokens``): BLOCK_N (weight rows, the wgmma's M) x BLOCK_M
    (tokens, its N) x warps x stages, unsplit, at every layer shape; each config must equal the planned one bit
    for bit. The layer rows of the same run give bf16's time beside them."""
    from thrifty.triton_utils import sm_count

    rows = []
    for model_name, shapes in args.shapes.items():
        for n, k in shapes:
            layer = random_packed(n, k, "int8", device)
            rs = layer.row_scale()
            groups = layer.packed.shape[1] // 64
            for m in args.gemm_sweep_tokens:
                codes, scale, sums = PK.quantize_codes(torch.randn(m, k, device=device, dtype=torch.bfloat16), "int8")
                planned = PK.plan(m, n, k, sm_count(device))
                want = PK.matmul_codes(codes, scale, sums, layer.packed, rs, None, torch.bfloat16, n, k, planned)
                for bn, bm, warps, stages in GEMM_TILES:
                    cfg = dict(planned, kernel="gemm", BLOCK_N=bn, BLOCK_M=bm, num_warps=warps, num_stages=stages,
                               split=1, groups_per_split=groups)
                    row = dict(what="gemm sweep", model=model_name, shape=f"{n}x{k}", tokens=m, BLOCK_N=bn,
                               BLOCK_M=bm, num_warps=warps, num_stages=stages,
                               planned=(bn, bm, warps, stages) == (planned["BLOCK_N"], planned["BLOCK_M"],
                                                                   planned["num_warps"], planned["num_stages"]))

                    def run():
                        return PK.matmul_codes(codes, scale, sums, layer.packed, rs, None, torch.bfloat16, n, k, cfg)

                    rows.append(checked_timing(row, run, lambda: want, args, device))
                    print(f"  gemm sweep {n}x{k} m={m} {bn}x{bm} w{warps} s{stages}: "
                          f"{row.get('gpu_ms', float('nan')) * 1e3:.1f} us", flush=True)
    return rows


def decode_sweep_rows(args, device, layer, m: int, planned: dict) -> list[dict]:
    """The decode GEMVs side by side in one process: v3 (decode_plan, on ready codes) at its plan and at other rows
    per program, warps (K chunk = 128 int32 words per warp) and pipeline stages; the layer as planned (codes
    kernel + v3); and the split-K GEMV before it (on ready codes, + its epilogue launch) for reference. Every row
    is checked against the planned layer's output bit for bit."""
    from thrifty.triton_utils import sm_count

    n, k = layer.out_features, layer.in_features
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    want = PK.packed_linear(x, layer)
    codes, scale, sums = PK.quantize_codes(x, "int8")
    rs = layer.row_scale()
    sms = sm_count(device)
    rows = []

    def timed(kernel: str, cfg: dict, fn, planned_row: bool) -> None:
        row = dict(what="sweep", shape=f"{n}x{k}", tokens=m, kernel=kernel, BLOCK_N=cfg["BLOCK_N"],
                   rows_per_program=cfg.get("rows_per_program"), KW=cfg.get("KW"), num_warps=cfg["num_warps"],
                   num_stages=cfg["num_stages"], split=cfg["split"], planned=planned_row)
        rows.append(checked_timing(row, fn, lambda: want, args, device))

    if planned["kernel"] == "decode":
        timed("decode v3 + codes kernel (layer)", planned, lambda: PK.packed_linear(x, layer), False)
        words = layer.packed.shape[1] // 4
        configs = [planned]
        for rpp in (4, 8, 16):
            for warps in (1, 2):
                chunks = -(-words // (128 * warps))
                for stages in ((1,) if chunks == 1 else (2, 3)):
                    cfg = dict(planned, BLOCK_N=rpp, rows_per_program=rpp, KW=128 * warps, num_warps=warps,
                               num_stages=stages)
                    if cfg != planned:
                        configs.append(cfg)
        for cfg in configs:
            timed("decode v3 (ready codes)", cfg, lambda cfg=cfg: PK.matmul_codes(
                codes, scale, sums, layer.packed, rs, None, torch.bfloat16, n, k, cfg), cfg == planned)
    block_m = 1 << (m - 1).bit_length() if m > 1 else 1  # m rounded up to a power of 2
    old = dict(PK.plan(5, n, k, sms), kernel="gemv", BLOCK_N=32, BLOCK_M=block_m, num_warps=4, num_stages=4)
    groups = layer.packed.shape[1] // 64
    split = 1
    while -(-n // 32) * split < 4 * sms and groups // (split * 2) >= 2:  # the old plan()'s split
        split *= 2
    per = -(-groups // split)
    old.update(split=-(-groups // per), groups_per_split=per)
    rows.append(dict(what="sweep", shape=f"{n}x{k}", tokens=m, kernel="gemv split-K (old plan, ready codes)",
                     BLOCK_N=32, split=old["split"], planned=False,
                     gpu_ms=_timed(lambda: PK.matmul_codes(codes, scale, sums, layer.packed, rs, None, torch.bfloat16,
                                                           n, k, old), args, device)))
    return rows


# ---------------------------------------------------------------------------------------------- model decode

def build_models(args, device):
    """(bf16 model, packed ternary model) of the same Llama shape; the packed one has BitNet's sub-norms."""
    from thrifty.models import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**args.model_config)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            dense = LlamaForCausalLM(cfg).eval()
            seed = iter(range(10 ** 6))
            groups: dict = {}  # q/k/v and gate/up quantize their shared input once, as bitnet.pack arranges

            def packed_linear(in_features, out_features, *, name):
                if name.endswith("lm_head"):
                    return torch.nn.Linear(in_features, out_features, bias=False)
                kind = "int8"
                layer = random_packed(out_features, in_features, kind, device, seed=next(seed))
                if name.endswith(("o_proj", "down_proj")):  # sub-norm as BitNet has (part of the cost)
                    sub = PackedBitLinear(in_features, out_features, activation=kind, sub_norm=True, device=device)
                    sub.packed, sub.alpha = layer.packed, layer.alpha
                    return sub
                parent, _, leaf = name.rpartition(".")
                members = 3 if leaf in ("q_proj", "k_proj", "v_proj") else 2
                layer.shared_input = groups.setdefault((parent, members), SharedInput(members))
                return layer

            ternary = LlamaForCausalLM(cfg, linear=packed_linear, activation=relu_squared).eval()
    finally:
        torch.set_default_dtype(old)
    return dense, ternary


def weight_bytes(model) -> dict:
    packed = sum(m.packed.numel() + 4 * m.alpha.numel() for m in model.modules() if isinstance(m, PackedBitLinear))
    linear = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                 if isinstance(m, torch.nn.Linear) and not m.weight.is_meta)
    total = sum(t.numel() * t.element_size() for t in {p.data_ptr(): p for p in model.parameters()}.values())
    total += sum(b.numel() * b.element_size() for b in model.buffers())
    return {"projection_bytes": packed or linear, "total_bytes": total}


@torch.no_grad()
def decode_step_times(model, batch: int, args, device) -> dict:
    from thrifty.models.llama import KVCache

    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, args.context), device=device)
    cache = KVCache()
    model(ids, cache=cache, logits_to_keep=1)
    nxt = ids[:, -1:]

    def step():  # one decode token per sequence; positions follow the cache's length, as generate() does
        model(nxt, cache=cache, logits_to_keep=1)

    for _ in range(args.warmup):
        step()
    eager = time_fn(step, warmup=0, reps=args.decode_steps, device=device).median_ms
    return {"eager_ms": eager, **gpu_busy_ms(step, device), **graph_ms_per_token(model, ids, args, device)}


def graph_ms_per_token(model, ids, args, device) -> dict:
    """ms per new token of graph-replayed decoding: (time for n + 1 new tokens − time for 1) / n, n =
    ``--graph-tokens``. ``graph_ms``: ``generate(..., cuda_graph=True)``, one capture (two warm-up steps + the
    recording) per call, charged to the n tokens. ``graph_reuse_ms``: a ``GraphedDecoder`` called again (the
    graph captured once and replayed across calls, what a server runs); absent from trees without it. Both calls
    of a difference prefill eagerly (host-bound, tens of ms that vary by ±30%), so the reused figure is the median
    of ``--graph-rounds`` alternating long/short pairs over ``--graph-tokens`` tokens: at 64 tokens and 3 + 3
    calls the stacked model's figure moved 1.10–1.79 ms between runs of one commit."""
    import thrifty.models as M

    if device.type != "cuda":
        return {"graph_ms": None}
    n = args.graph_tokens
    out = {"graph_tokens": n}
    try:
        times = {}
        for new in (1, n + 1):
            M.generate(model, ids, new, cuda_graph=new > 1)  # compiles and warms what the timed call runs
            times[new] = time_fn(lambda: M.generate(model, ids, new, cuda_graph=new > 1), warmup=0, reps=3,
                                 device=device).median_ms
        out["graph_ms"] = (times[n + 1] - times[1]) / n
    except Exception as err:  # noqa: BLE001 - the eager and busy figures still stand
        return {"graph_ms": None, "graph_error": f"{type(err).__name__}: {err}"[:300]}
    if hasattr(M, "GraphedDecoder"):
        try:
            decoder = M.GraphedDecoder(model, ids.shape[0], ids.shape[1] + n + 1)
            decoder.generate(ids, n + 1)  # captures; every timed call replays
            per_token = []
            for _ in range(args.graph_rounds):  # long and short calls alternate, so drift hits both alike
                long = time_fn(lambda: decoder.generate(ids, n + 1), warmup=0, reps=1, device=device).median_ms
                short = time_fn(lambda: decoder.generate(ids, 1), warmup=0, reps=1, device=device).median_ms
                per_token.append((long - short) / n)
            out.update(graph_reuse_ms=sorted(per_token)[len(per_token) // 2], graph_reuse_captures=decoder.captures,
                       graph_reuse_rounds_ms=",".join(f"{t:.4f}" for t in per_token))
            decoder.release()
        except Exception as err:  # noqa: BLE001
            out["graph_reuse_error"] = f"{type(err).__name__}: {err}"[:300]
    return out


def gpu_busy_ms(step, device, steps: int = 5) -> dict:
    """Sum of the kernel (and memcpy/memset) durations of one step, from torch.profiler: what the step costs
    the GPU with no launch gaps (the bound a CUDA-graph decode approaches)."""
    if device.type != "cuda":
        return {"gpu_busy_ms": None}
    try:
        table = _kernel_table(lambda: [step() for _ in range(steps)], steps)  # per step
        busy_us = sum(us for _, us in table.values())
        return {"gpu_busy_ms": busy_us / 1e3 if busy_us else None,
                "device_events": round(steps * sum(n for n, _ in table.values()))}
    except Exception as err:  # noqa: BLE001 - the eager time still stands
        return {"gpu_busy_ms": None, "profiler_error": f"{type(err).__name__}: {err}"[:300]}


def kernel_table_rows(args, device, steps: int = 5) -> list[dict]:
    """``--kernel-table``: per kernel name, launches and GPU µs per decode token (batch 1, after ``--context``
    cached tokens) of the bf16 and the stacked ternary model, from torch.profiler, in two modes: ``eager`` (steps
    on the growing ``KVCache``) and ``graph`` (a reused ``GraphedDecoder``'s replays over its static cache, what the
    headline decode figure times; the profiler sees the kernels inside a replay): where a token's time goes."""
    import thrifty.models as M
    from thrifty.bitnet import stack_projections
    from thrifty.models.llama import KVCache

    if device.type != "cuda":
        return [dict(what="decode_kernels", error="needs a GPU")]
    dense, ternary = build_models(args, device)
    stack_projections(ternary)
    rows = []
    for name, model in (("bf16", dense), ("stacked ternary", ternary)):
        ids = torch.randint(0, model.config.vocab_size, (1, args.context), device=device)
        cache = KVCache()
        with torch.no_grad():
            model(ids, cache=cache, logits_to_keep=1)
            nxt = ids[:, -1:]
            for _ in range(3):
                model(nxt, cache=cache, logits_to_keep=1)
            eager = _kernel_table(lambda: [model(nxt, cache=cache, logits_to_keep=1) for _ in range(steps)], steps)
        decoder = M.GraphedDecoder(model, 1, args.context + steps + 2)
        decoder.generate(ids, steps + 1)  # captures; the profiled calls replay
        # a call runs the prefill and the first token eagerly, then one replay per further token: the table of a
        # 1-token call taken from that of a (steps + 1)-token call leaves the replays alone
        long = _kernel_table(lambda: decoder.generate(ids, steps + 1), 1)
        short = _kernel_table(lambda: decoder.generate(ids, 1), 1)
        decoder.release()
        graph = {k: [(v[0] - short.get(k, (0, 0))[0]) / steps, (v[1] - short.get(k, (0, 0))[1]) / steps]
                 for k, v in long.items()}
        graph = {k: v for k, v in graph.items() if v[0] > 0.5 / steps}
        for mode, table in (("eager", eager), ("graph", graph)):
            for kernel, (per_token, us) in sorted(table.items(), key=lambda kv: -kv[1][1]):
                rows.append(dict(what="decode_kernels", model=name, mode=mode, kernel=kernel, per_step=per_token,
                                 us_per_step=us, us_per_launch=us / per_token))
            print(f"  kernel table {name} ({mode}): {sum(t[0] for t in table.values()):.0f} launches, "
                  f"{sum(t[1] for t in table.values()) / 1e3:.3f} ms per token", flush=True)
    return rows


def _kernel_table(run, tokens: int) -> dict:
    """{kernel name: [launches, GPU µs]} per token of ``run`` (which decodes ``tokens`` tokens), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.no_grad():
            run()
        torch.cuda.synchronize()
    table: dict = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            t = table.setdefault(e.name[:90], [0.0, 0.0])
            t[0] += 1 / tokens
            t[1] += e.time_range.elapsed_us() / tokens
    return table


def model_rows(args, device) -> list[dict]:
    from thrifty.bitnet import stack_projections

    dense, ternary = build_models(args, device)
    stacked = copy.deepcopy(ternary)
    stack_projections(stacked)  # q/k/v and gate/up one launch each: what a user of the packed model runs
    rows = []
    for name, model in (("bf16", dense), ("ternary packed (random weights)", ternary),
                        ("stacked ternary, q/k/v and gate/up one launch each (random weights)", stacked)):
        mem = weight_bytes(model)
        for batch in args.batches:
            t = decode_step_times(model, batch, args, device)
            ms = t.get("graph_reuse_ms") or t["graph_ms"] or t["gpu_busy_ms"] or t["eager_ms"]
            busy = t["gpu_busy_ms"] or t["eager_ms"]
            one_shot = t["graph_ms"] or busy
            timed = ("graph reused" if t.get("graph_reuse_ms") else "graph" if t["graph_ms"] else
                     "gpu busy" if t["gpu_busy_ms"] else "eager")
            rows.append(dict(what="decode", model=name, batch=batch, **t, **mem, timed=timed,
                             tokens_per_s=batch / (ms / 1e3), tokens_per_s_gpu_busy=batch / (busy / 1e3),
                             tokens_per_s_graph_one_shot=batch / (one_shot / 1e3),
                             tokens_per_s_eager=batch / (t["eager_ms"] / 1e3)))
            print(f"  decode {name} batch {batch}: {t}", flush=True)
    return rows


def pdl_ab_rows(args, device) -> list[dict]:
    """``--pdl-ab ROUNDS``: the stacked ternary model's reused-graph decode at batch 1 with the decode GEMV's
    programmatic dependent launch on and off (two ``GraphedDecoder``s captured once each, timed in alternation in
    this process: a separate-process baseline drifts by ±5% on this box). Off = ``packed_kernel.pdl_ok`` answering
    False while that decoder captures (the kernels then compile and launch as before PDL)."""
    import thrifty.models as M
    from thrifty.bitnet import stack_projections

    if device.type != "cuda" or not PK.pdl_ok(device):
        return [dict(what="decode_pdl_ab", error="needs an sm_90 GPU")]
    _, model = build_models(args, device)
    stack_projections(model)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context), device=device)
    n = args.graph_tokens
    decoders, real_ok = {}, PK.pdl_ok
    for pdl in (True, False):
        PK.pdl_ok = real_ok if pdl else (lambda _device: False)
        try:
            decoders[pdl] = M.GraphedDecoder(model, 1, args.context + n + 1)
            decoders[pdl].generate(ids, n + 1)  # compiles and captures with this launch mode
            decoders[pdl].generate(ids, 1)
        finally:
            PK.pdl_ok = real_ok
    per_token = {True: [], False: []}
    for _ in range(args.pdl_ab):
        for pdl, decoder in decoders.items():
            long = time_fn(lambda: decoder.generate(ids, n + 1), warmup=0, reps=3, device=device).median_ms
            short = time_fn(lambda: decoder.generate(ids, 1), warmup=0, reps=3, device=device).median_ms
            per_token[pdl].append((long - short) / n)
    for decoder in decoders.values():
        decoder.release()
    med = {pdl: sorted(v)[len(v) // 2] for pdl, v in per_token.items()}
    print(f"  PDL A/B, stacked ternary batch 1, reused graph ms/token: on {per_token[True]}, off {per_token[False]}",
          flush=True)
    return [dict(what="decode_pdl_ab", model="stacked ternary (random weights)", batch=1, pdl=pdl,
                 graph_reuse_ms=med[pdl], rounds_ms=",".join(f"{t:.4f}" for t in per_token[pdl]))
            for pdl in (True, False)]


def baseline_rows(args) -> list[dict]:
    """:func:`layer_rows` of the tree at ``--baseline-src`` (this script run with that tree's thrifty), tagged
    ``tree="baseline"``: old and new kernels timed in one run on one box."""
    from thrifty.bench import rows_from_tree

    passed = ["--rows-only", "--tokens", ",".join(map(str, args.tokens)), "--warmup", str(args.warmup), "--reps",
              str(args.reps), "--device", args.device, "--graph-tokens", str(args.graph_tokens), "--graph-rounds",
              str(args.graph_rounds)] + \
        ["--smoke"] * args.smoke + ["--with-model"] * (not args.no_model)
    return rows_from_tree(__file__, args.baseline_src, passed, ROWS_MARK)


def kv_cache_bytes(cfg: dict, context: int = 32768) -> dict:
    """K and V of every layer at ``context`` tokens, batch 1: bf16, int8, 4-bit, 3-bit (scales left out)."""
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (cfg["hidden_size"] //
                                                                            cfg["num_attention_heads"])
    return {f"kv_{bits}bit_bytes_32k": per_token * context * bits // 8 for bits in (16, 8, 4, 3)}


# ---------------------------------------------------------------------------------------------- report

def summarize(rows: list[dict]) -> dict:
    def speedups(m):
        return [r["speedup_vs_bf16"] for r in rows if r.get("impl") == "thrifty" and r.get("model") == "7B"
                and r.get("tokens") == m and "speedup_vs_bf16" in r and r.get("tree") != "baseline"
                and r.get("what") is None]

    out = {}
    ab = {r["pdl"]: r["graph_reuse_ms"] for r in rows if r.get("what") == "decode_pdl_ab" and "pdl" in r}
    if len(ab) == 2:
        out["decode_pdl_speedup_stacked_b1"] = ab[False] / ab[True]
    for r in rows:  # this tree's layer time over the baseline tree's (--baseline-src), per shape, 1 and 16 tokens
        if r.get("tree") == "baseline" and r.get("impl") == "thrifty" and r.get("tokens") in (1, 16) and "gpu_ms" in r:
            new = next((t for t in rows if t.get("tree") != "baseline" and t.get("impl") == "thrifty"
                        and t.get("shape") == r["shape"] and t.get("tokens") == r["tokens"] and "gpu_ms" in t), None)
            if new:
                out[f"thrifty_speedup_vs_baseline_{r['shape']}_t{r['tokens']}"] = r["gpu_ms"] / new["gpu_ms"]
                out[f"baseline_speedup_vs_bf16_{r['shape']}_t{r['tokens']}"] = r.get("speedup_vs_bf16")
    for key, m in (("gemv_speedup_vs_bf16_b1_min", 1), ("gemv_speedup_vs_bf16_b16_min", 16),
                   ("gemm_speedup_vs_bf16_t2048_min", 2048)):
        s = speedups(m)
        out[key] = min(s) if s else None
    for tag, what in (("", None), ("_graph", "graph")):  # the most a one-launch layer could show, and our share
        for m in (1, 16):
            ours = [r for r in rows if r.get("impl") == "thrifty" and r.get("model") == "7B" and r.get("tokens") == m
                    and r.get("what") == what and "floor_speedup_vs_bf16" in r and r.get("tree") != "baseline"]
            if ours:
                out[f"gemv_floor_speedup_vs_bf16_b{m}{tag}_min"] = min(r["floor_speedup_vs_bf16"] for r in ours)
                out[f"gemv_pct_of_floor_speedup_b{m}{tag}_min"] = min(r["pct_of_floor_speedup"] for r in ours)
                if what:
                    out[f"gemv_speedup_vs_bf16_b{m}_graph_min"] = min(r["speedup_vs_bf16"] for r in ours)
    launch = {r.get("what"): r["gpu_ms"] for r in rows if r.get("impl") == "launch" and "gpu_ms" in r}
    if launch:
        out["launch_floor_us"] = launch.get(None, float("nan")) * 1e3
        out["launch_floor_graph_us"] = launch.get("graph", float("nan")) * 1e3
    for r in rows:  # this tree's decode step over the baseline tree's, per model and batch, same run
        if r.get("tree") == "baseline" and r.get("what") == "decode":
            new = next((t for t in rows if t.get("tree") != "baseline" and t.get("what") == "decode"
                        and t["model"] == r["model"] and t["batch"] == r["batch"]), None)
            tag = f"{r['model'].split()[0]}_b{r['batch']}"
            for key in ("gpu_busy_ms", "graph_reuse_ms", "graph_ms", "eager_ms"):
                if new and r.get(key) and new.get(key):
                    out[f"decode_{key}_speedup_vs_baseline_{tag}"] = r[key] / new[key]
    dec = {(r["model"].split()[0], r["batch"]): r for r in rows
           if r.get("what") == "decode" and r.get("tree") != "baseline"}
    if dec:
        fast = "stacked" if ("stacked", 1) in dec else "ternary"
        b, t = dec[("bf16", 1)], dec[(fast, 1)]
        out["packed_weight_mem_ratio"] = dec[("ternary", 1)]["projection_bytes"] / b["projection_bytes"]
        out["decode_tokens_per_s_ratio_vs_bf16_b1"] = t["tokens_per_s"] / b["tokens_per_s"]
        for batch in sorted({bb for _, bb in dec} - {1}):  # batch 16, and 2 / 4 where --batches has them
            out[f"decode_tokens_per_s_ratio_vs_bf16_b{batch}"] = dec[(fast, batch)]["tokens_per_s"] / \
                dec[("bf16", batch)]["tokens_per_s"]
        out["decode_tokens_per_s_ratio_unstacked_vs_bf16_b1"] = dec[("ternary", 1)]["tokens_per_s"] / b["tokens_per_s"]
        out["decode_tokens_per_s_ratio_vs_bf16_b1_eager"] = t["tokens_per_s_eager"] / b["tokens_per_s_eager"]
        out["decode_tokens_per_s_ratio_vs_bf16_b1_graph_one_shot"] = \
            t["tokens_per_s_graph_one_shot"] / b["tokens_per_s_graph_one_shot"]
        out["decode_tokens_per_s_ratio_vs_bf16_b1_gpu_busy"] = t["tokens_per_s_gpu_busy"] / b["tokens_per_s_gpu_busy"]
        out["decode_timed_by"] = f"{b['timed']} / {t['timed']}"
    else:  # from the layer table: packed bytes over bf16 bytes of the same matrices
        out["packed_weight_mem_ratio"] = 0.125
    gates = [r["match"] for r in rows if "match" in r]
    out["kernels_match_torch_path"] = all(gates) if gates else None
    out.update(kv3_from_kv_benchmark())
    return out


def kv3_from_kv_benchmark() -> dict:
    """The issue's ``kv3_ppl_delta_pct`` is measured by benchmarks/bitnet_kv.py (perplexity needs real weights and
    text, not these random ones): copied here from its newest result file, with the file named."""
    found = sorted(default_results_dir().glob("bitnet_kv_*.json"), key=lambda p: p.stat().st_mtime)
    for path in reversed(found):
        value = json.loads(path.read_text()).get("summary", {}).get("kv3_ppl_delta_pct")
        if value is not None:
            return {"kv3_ppl_delta_pct": value, "kv3_ppl_delta_pct_source": path.name}
    return {"kv3_ppl_delta_pct": None, "kv3_ppl_delta_pct_source": "no benchmarks/results/bitnet_kv_*.json yet"}


def plot(rows: list, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layer = [r for r in rows if r.get("impl") == "thrifty" and "speedup_vs_bf16" in r and r.get("what") is None]
    graphed = [r for r in rows if r.get("impl") == "thrifty" and "speedup_vs_bf16" in r and r.get("what") == "graph"]
    shapes = list(dict.fromkeys(f"{r['model']} {r['shape']}" for r in layer))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5))
    for s in shapes:
        pts = sorted((r["tokens"], r["speedup_vs_bf16"]) for r in layer if f"{r['model']} {r['shape']}" == s)
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        pts = sorted((r["tokens"], r["speedup_vs_bf16"]) for r in graphed if f"{r['model']} {r['shape']}" == s)
        if pts:  # the same layer replayed in a CUDA graph on rotating weight copies
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="x", ls="--", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("tokens")
    ax.set_ylabel("speed-up over bf16 F.linear (GPU time; dashed: CUDA graph, cold weights)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    gbs = [r for r in rows if r.get("tokens") == 1 and r.get("impl") in ("bf16", "thrifty", "thrifty_matmul")
           and "pct_of_hbm" in r and r.get("what") is None]
    impls = ["bf16", "thrifty", "thrifty_matmul"]
    for j, impl in enumerate(impls):
        vals = [next((r["pct_of_hbm"] for r in gbs if r["impl"] == impl and f"{r['model']} {r['shape']}" == s), 0)
                for s in shapes]
        bx.bar([i + j * 0.27 for i in range(len(shapes))], vals, 0.27, label=impl)
    bx.set_xticks([i + 0.27 for i in range(len(shapes))], shapes, rotation=30, fontsize=7)
    bx.set_ylabel("% of measured HBM bandwidth (weight bytes), 1 token")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--batches", default="1,2,4,16", help="batch sizes of the model decode (1 is needed)")
    ap.add_argument("--context", type=int, default=128, help="cached tokens before the timed decode steps")
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--graph-tokens", type=int, default=256, help="new tokens per timed generate(cuda_graph=True)")
    ap.add_argument("--graph-rounds", type=int, default=7,
                    help="alternating long/short GraphedDecoder calls whose median difference is graph_reuse_ms")
    ap.add_argument("--no-model", action="store_true", help="skip the 7B model decode")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile / split sweep")
    ap.add_argument("--no-graph-layers", action="store_true",
                    help="skip the layer calls replayed in a CUDA graph on rotating weight copies")
    ap.add_argument("--pdl-ab", type=int, default=0, metavar="ROUNDS",
                    help="also time the stacked model's decode with the GEMV's dependent launch on / off, alternating")
    ap.add_argument("--kernel-table", action="store_true",
                    help="per-kernel launches and GPU time per decode token, eager and in a reused graph (bf16 and "
                         "stacked ternary)")
    ap.add_argument("--gemm-sweep-tokens", default="", help="token counts of the prefill tile sweep (e.g. 2048)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, results to a temporary folder")
    ap.add_argument("--baseline-src", default=None, help="src/ of another thrifty tree: its layer rows timed too")
    ap.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)  # --baseline-src's subprocess
    ap.add_argument("--with-model", action="store_true", help=argparse.SUPPRESS)  # ... with the model decode rows
    args = ap.parse_args(argv)
    if args.baseline_src is not None and not Path(args.baseline_src, "thrifty").is_dir():
        ap.error(f"--baseline-src: {args.baseline_src!r} holds no thrifty package (give the old tree's src/)")
    args.tokens = [int(t) for t in str(args.tokens).split(",")]
    args.batches = [int(b) for b in str(args.batches).split(",")]
    if 1 not in args.batches:
        ap.error("--batches: batch 1 is needed (the summary's decode ratios are over it)")
    args.gemm_sweep_tokens = [int(t) for t in str(args.gemm_sweep_tokens).split(",") if t]
    args.shapes = SHAPES
    args.model_config = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                             tie_word_embeddings=False)
    if args.smoke:
        args.shapes = {"7B": [(40, 300), (70, 257)], "2B": [(33, 100)]}
        args.tokens, args.warmup, args.reps, args.context, args.decode_steps = [1, 5, 70], 1, 2, 4, 2
        args.model_config = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                 tie_word_embeddings=False)
        args.out = args.out or tempfile.mkdtemp(prefix="bitnet_kernels_smoke_")
    args.check_tokens = set(args.tokens)
    args.graph_tokens_layers = [m for m in args.tokens if m <= 16]
    args.sweep_splits = (1, 2) if args.smoke else (1, 2, 4, 8, 16)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # the PyTorch path's fp32 integer matmul must stay exact
    label = args.label or detect_device(device)
    torch.manual_seed(0)

    asm_gate = choose_decode_asm(device)
    print(f"inline-PTX gate: {asm_gate}", flush=True)
    hbm = hbm_bandwidth_gbs(device, args)
    print(f"HBM copy bandwidth: {hbm:.0f} GB/s", flush=True)
    args.launch_ms = launch_floor_ms(args, device)
    rows = layer_rows(args, device, hbm)
    if args.launch_ms is not None and not args.rows_only:
        rows.append(dict(impl="launch", gpu_ms=args.launch_ms))
    if args.rows_only:  # a --baseline-src subprocess: this tree's layer (and model) rows, nothing written
        if args.with_model:
            rows += model_rows(args, device)
        print(ROWS_MARK + json.dumps(rows), flush=True)
        return 0
    if args.baseline_src:
        rows += baseline_rows(args)
    rows += a48_rows(args, device)
    if not args.no_graph_layers:
        rows += graph_rows(args, device, hbm)
    if not args.no_sweep:
        rows += sweep_rows(args, device)
    if args.gemm_sweep_tokens:
        rows += gemm_sweep_rows(args, device)
    if not args.no_model:
        rows += model_rows(args, device)
    if args.pdl_ab:
        rows += pdl_ab_rows(args, device)
    if args.kernel_table:
        rows += kernel_table_rows(args, device)
    summary = {**summarize(rows), "hbm_copy_gbs": hbm, "inline_ptx": PK.USE_ASM, **kv_cache_bytes(args.model_config)}
    extra = {"args": {k: v for k, v in vars(args).items()}, "inline_ptx_gate": asm_gate,
             "note": "smoke run: tiny shapes, measures nothing" if args.smoke else
             "issue #29; decode model weights are random ternary codes (speed does not depend on values)"}
    results_dir = Path(args.out) if args.out else default_results_dir()
    path = write_result("bitnet_kernels", rows, summary, device=label, extra=extra, results_dir=results_dir)
    plot(rows, path.with_suffix(".png"), f"packed ternary W2A8 vs bf16, {label}")
    print_table([r for r in rows if "impl" in r and r.get("what") is None],
                ["tree", "model", "shape", "tokens", "impl", "gpu_ms", "host_ms", "weight_gbs", "pct_of_hbm",
                 "pct_of_floor", "speedup_vs_bf16", "match"])
    for what in ("graph", "a4.8 activation", "sweep", "gemm sweep", "decode", "decode_kernels"):
        part = [r for r in rows if r.get("what") == what]
        if part:
            print_table(part)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}, indent=1))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
