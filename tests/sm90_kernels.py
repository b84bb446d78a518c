"""Every Triton kernel of thrifty, compiled for the H100 (sm_90) on a machine without a GPU.

The Triton interpreter (how CI runs kernels) accepts code the real compiler refuses: a plain module global read
inside ``@triton.jit`` code, block shapes that need more shared memory than the GPU has. Triton's whole pipeline
(TTIR → TTGIR → LLVM → PTX → cubin with the bundled ptxas) runs on the CPU when the target is given, so here
every kernel is compiled as its launcher would compile it on the GPU box (``tests/test_compile_sm90.py`` runs
this).

:data:`SPECS` is the table: one :class:`Spec` per (kernel, launch variant). Its constexprs and launch options come
from the objects the launchers read (``attn_kernel.kernel_config``, ``quant_kernel.STATS_CONFIG``,
``decode_kernel.DECODE_CONFIG``, the CCE autotuner's configs, ...), so a changed tile size is compiled here too;
the few numbers that are literals inside a launcher are marked ``# literal in <launcher>``. A new kernel needs one
:func:`entry` per launch variant (each dtype and flag a public path really launches it with).

Must run with TRITON_INTERPRET unset: the kernel modules pick their GPU configs and GPU helpers at import.

    python tests/sm90_kernels.py [--jobs N] [--only SUBSTRING]     # prints a JSON report on stdout
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import inspect
import itertools
import json
import math
import multiprocessing
import os
import pkgutil
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import JITFunction

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    raise RuntimeError("tests/sm90_kernels.py compiles for the GPU: run it with TRITON_INTERPRET unset "
                       "(the kernel modules choose their GPU configs when imported)")

SM90 = GPUTarget("cuda", 90, 32)  # H100 / H200
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KB)
CUDA = torch.device("cuda")  # what the launchers' config functions are asked about (no GPU needed)
PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def kernel_key(fn) -> str:
    return f"{fn.fn.__module__}:{fn.fn.__name__}"


@dataclass(frozen=True)
class Spec:
    kernel: JITFunction
    label: str
    signature: dict  # argument name -> "*bf16", "i32", "fp32", "constexpr", ...
    constexprs: dict  # constexpr argument name -> value
    options: dict  # num_warps / num_stages as the launcher passes them (absent: Triton's defaults)
    aligned: tuple = ()  # integer arguments the launcher passes as multiples of 16 (Triton specializes on that)

    @property
    def name(self) -> str:
        return kernel_key(self.kernel)

    def key(self):
        return (self.name, tuple(self.signature.items()), tuple(self.constexprs.items()),
                tuple(sorted(self.options.items())), self.aligned)


def entry(kernel, label: str, consts: dict, ptrs: dict, *, fp32: str = "", i64: str = "", ones: str = "",
          nones: str = "", aligned: str = "", num_warps: int | None = None, num_stages: int | None = None) -> Spec:
    """One compile entry. ``ptrs``: {"name1 name2": "*bf16", ...} (space-separated argument names per pointer
    type); ``fp32`` / ``i64``: space-separated names of float / 64-bit integer arguments; ``ones``: integer
    arguments the launcher passes as 1 (innermost strides: Triton turns an int 1 into a constexpr); ``nones``:
    arguments it passes as None (an unused descriptor: a constexpr None too); ``aligned``:
    integer arguments it passes as multiples of 16 (row lengths and strides of the widths listed: Triton then
    knows their divisibility, which decides the vector width of loads and stores); every other runtime argument is
    an i32. ``consts``: a value for each constexpr argument. Names are checked."""
    params = {p.name: p for p in kernel.params}
    sig = {}
    for names, typ in [*ptrs.items(), (fp32, "fp32"), (i64, "i64"), (ones, "constexpr"), (nones, "constexpr")]:
        for n in names.split():
            if n not in params or params[n].is_constexpr:
                raise KeyError(f"{kernel_key(kernel)} [{label}]: no runtime argument {n!r}")
            sig[n] = typ
    want = {n for n, p in params.items() if p.is_constexpr}
    if set(consts) != want:
        raise KeyError(f"{kernel_key(kernel)} [{label}]: constexprs {sorted(consts)} != the kernel's {sorted(want)}")
    sig = {n: "constexpr" if n in want else sig.get(n, "i32") for n in kernel.arg_names}
    consts = {n: 1 if n in ones.split() else None if n in nones.split() else consts[n] for n in kernel.arg_names
              if sig[n] == "constexpr"}
    options = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    for n in aligned.split():
        if sig.get(n) not in ("i32", "i64"):
            raise KeyError(f"{kernel_key(kernel)} [{label}]: aligned {n!r} is no integer argument")
    return Spec(kernel, label, sig, consts, options, tuple(aligned.split()))


def _unique(specs):
    seen, out = set(), []
    for s in specs:
        if s.key() not in seen:
            seen.add(s.key())
            out.append(s)
    return out


# --------------------------------------------------------------------------------------------- attention
def _sage_call(D, dtype, *, causal=False, qk_bits=8, pv="fp8", smooth_k=True, smooth_v=False, smooth_q=None,
               return_lse=False):
    """The launches of one ``sage_attention(..., impl="triton")`` call on the GPU, as attn_kernel.quantize_inputs,
    quant_kernel.quantize_kv and attn_kernel.launch make them."""
    from thrifty.attention import attn_kernel as A, quant_kernel as Q

    smooth_q = qk_bits == 4 if smooth_q is None else smooth_q  # SageConfig's default
    cfg = A.kernel_config(D, CUDA)
    qmax = 127.0 if qk_bits == 8 else 7.0
    fp8_v = pv == "fp8"
    t = PTR[dtype]
    label = (f"D{D} {NAME[dtype]} {'causal' if causal else 'full'} qk{qk_bits} pv={pv}"
             + " smooth_k" * smooth_k + " smooth_v" * smooth_v + " smooth_q" * smooth_q + " lse" * return_lse)
    has_stats = smooth_k or fp8_v or smooth_v
    sc = Q.STATS_CONFIG  # the statistics pass always runs: it also finds the non-finite keys
    yield entry(Q._kv_partial_stats_kernel, label,
                dict(D=D, BLOCK_S=sc["block_s"], SMOOTH_K=smooth_k, V_STATS=fp8_v or smooth_v),
                {"k_ptr v_ptr": t, "part_ptr": "*fp32", "bad_ptr": "*i32"}, ones="k_sd v_sd",
                num_warps=sc["num_warps"], num_stages=3)  # literal in quantize_kv
    k_per_token = qk_bits == 4  # as attn_kernel.quantize_inputs
    yield _quantize_entry(label, D, dtype, cfg["block_n"], qmax, smooth_k, smooth_v, fp8_v, has_stats,
                          k_per_token=k_per_token)
    fold = cfg["fold"] and cfg["fast_cvt"] and fp8_v and not smooth_q and not k_per_token
    yield entry(A._sage_fwd_kernel, label,
                dict(HEAD_DIM=D, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], QMAX=qmax, CAUSAL=causal,
                     PV_FP8=fp8_v, P_SCALE=Q.FP8_MAX if fp8_v else 1.0, HAS_VMEAN=smooth_v, RETURN_LSE=return_lse,
                     PRE_ROUND=Q.INTERPRET, FAST_CVT=cfg["fast_cvt"], REVERSE=causal and cfg["reverse"],
                     WS=cfg["ws"], FOLD=fold, FTZ=cfg["ftz"] and not Q.INTERPRET,
                     LOG2_P_SCALE=math.log2(Q.FP8_MAX) if fp8_v else 0.0, SMOOTH_Q=smooth_q,
                     SMOOTH_ROWS=A.SMOOTH_Q_BLOCK, K_PER_TOKEN=k_per_token, MAX_SPLIT=Q.MAX_SPLIT),
                {"Q Out KR": t, "K": "*i8", "Ks Stats": "*fp32", "FirstBad": "*i32", "V": "*fp8e4nv" if fp8_v else t,
                 "Lse": "*fp32" if return_lse else t},
                fp32="qk_scale", ones="stride_qd stride_od stride_kd", num_warps=cfg["num_warps"],
                num_stages=min(cfg["num_stages"], A.FP32_V_MAX_STAGES) if t == "*fp32" and not fp8_v
                else cfg["num_stages"])


def _quantize_entry(label, D, dtype, block, qmax, smooth_k, smooth_v, fp8_v, has_stats, v_perm16=False,
                    k_per_token=False):
    """quant_kernel._quantize_kv_kernel as quantize_kv launches it."""
    from thrifty.attention import quant_kernel as Q

    t = PTR[dtype]
    return entry(Q._quantize_kv_kernel, label + " v_perm16" * v_perm16,
                 dict(QMAX=qmax, V_QMAX=Q.FP8_MAX, D=D, BLOCK=block, SMOOTH_K=smooth_k, SMOOTH_V=smooth_v,
                      V_FP8=fp8_v, HAS_STATS=has_stats, PRE_ROUND=Q.INTERPRET, V_PERM16=v_perm16,
                      K_PER_TOKEN=k_per_token),
                 {"k_ptr v_ptr": t, "part_ptr stats_ptr k_scale_ptr": "*fp32", "k_out_ptr": "*i8",
                  "v_out_ptr": "*fp8e4nv" if fp8_v else t}, ones="k_sd v_sd",
                 num_warps=4, num_stages=3)  # literal in quantize_kv


def _attention():
    from thrifty.attention.sage import KERNEL_HEAD_DIMS

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    for D in KERNEL_HEAD_DIMS:
        yield from _sage_call(D, bf16)
        yield from _sage_call(D, bf16, causal=True)
        yield from _sage_call(D, bf16, causal=True, pv="fp16")
        yield from _sage_call(D, bf16, causal=True, qk_bits=4, return_lse=True)  # SageAttention2-4b: smooth_q on
        yield from _sage_call(D, bf16, qk_bits=4, pv="fp16")
        yield from _sage_call(D, bf16, causal=True, qk_bits=4, smooth_q=False)  # 4 bits, K smoothing only
        yield from _sage_call(D, bf16, causal=True, smooth_v=True, return_lse=True)
        yield from _sage_call(D, bf16, pv="fp16", smooth_k=False)  # no statistics pass
        yield from _sage_call(D, fp16, causal=True)
        yield from _sage_call(D, fp32, causal=True)
        yield from _sage_call(D, fp32, pv="fp16")  # fp32 V tiles through the 16-bit P·V path


# the ping-pong schedule (gluon_config pingpong=True) on the tiles it is benchmarked with: 64 query rows per
# consumer (a 128x128 D=64 tile would hold S, P̃ in flight, the P̃·V fragment and acc: > 240 registers)
PINGPONG_TILES = ((128, dict(v_perm16=False, block_n=128, stages=3)), (128, dict(block_n=64, scale_block=64)),
                  (64, dict(block_m=64)), (64, dict(block_m=64, v_perm16=False)))


def _attention_gluon():
    """gluon_kernel._sage_fwd_gluon_kernel (issue #28) as gluon_kernel.launch makes it: D 64/128, causal on/off,
    each structure (one or two consumer warpgroups beside a producer warp), the default config with LSE and V smoothing, fp16 and fp32 Q/out; P̃ from the accumulator
    registers (v_perm16) and its pre-pass; at D=64 both its default 128x128 tiles (``gluon_kernel.D64_TILES``) and
    the 64x64 ones (``SMALL_D64_TILES``); at D=128 without a mask both its default 256-key tiles
    (``D128_FULL_TILES``) and the 128-key ones (``NARROW_D128_TILES``)."""
    from thrifty.attention import gluon_kernel as G

    bf16 = torch.bfloat16
    variants = [dict(consumers=1, pingpong=False), dict(consumers=2)]  # the last: each head_dim's default
    calls = [(D, causal, bf16, False, False, v) for D in G.GLUON_HEAD_DIMS for causal in (False, True)
             for v in variants]  # at D=64 on its default 128x128 tiles
    calls += [(64, causal, bf16, False, False, dict(v, **G.SMALL_D64_TILES)) for causal in (False, True)
              for v in variants]
    calls += [(D, True, dtype, True, True, {}) for D in G.GLUON_HEAD_DIMS for dtype in (torch.float16, torch.float32)]
    calls += [(128, False, dtype, True, True, {}) for dtype in (torch.float16, torch.float32)]  # 256-key tiles
    calls += [(128, causal, bf16, False, False, dict(v_perm16=False, pingpong=False)) for causal in (False, True)]
    calls += [(128, False, bf16, False, False, dict(G.NARROW_D128_TILES))]  # full D=128 on 128-key tiles
    calls += [(D, causal, bf16, False, False, dict(pingpong=True, **tiles)) for causal in (False, True)
              for D, tiles in PINGPONG_TILES]
    for call in calls:
        yield gluon_entry(*call)
    # the pre-pass with Vᵀ in v_slot order (the Triton path's entries cover the rest of the Gluon pre-pass)
    for D in G.GLUON_HEAD_DIMS:
        for dtype, smooth_v in ((bf16, False), (torch.float16, True), (torch.float32, True)):
            block = G.gluon_config(D, False)["scale_block"]  # the pre-pass: mask-independent
            yield _quantize_entry(f"D{D} {NAME[dtype]} gluon" + " smooth_v" * smooth_v, D, dtype, block, 127.0,
                                  True, smooth_v, True, True, v_perm16=True)


def gluon_entry(D, causal, dtype, lse, smooth_v, variant) -> Spec:
    """One launch of the Gluon kernel (``variant``: a gluon_config override), as gluon_kernel.launch makes it."""
    from thrifty.attention import gluon_kernel as G, quant_kernel as Q

    cfg = dict(G.gluon_config(D, causal), **variant)
    k_layout, v_layout = G.shared_layouts(D, cfg["block_n"])
    t = PTR[dtype]
    label = (f"D{D} {NAME[dtype]} {'causal' if causal else 'full'} consumers={cfg['consumers']}"
             f" block_m={cfg['block_m']} block_n={cfg['block_n']}" + " v_perm16" * cfg["v_perm16"] + " lse" * lse
             + " smooth_v" * smooth_v + " pingpong" * cfg["pingpong"])
    return entry(G._sage_fwd_gluon_kernel, label,
                 dict(HEAD_DIM=D, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], KS_BLOCK=cfg["scale_block"],
                      STAGES=cfg["stages"], QMAX=127.0, CAUSAL=causal, HAS_VMEAN=smooth_v, RETURN_LSE=lse,
                      REVERSE=causal and cfg["reverse"], CONSUMERS=cfg["consumers"],
                      PRODUCER_REGS=cfg["producer_regs"], CONSUMER_REGS=cfg["consumer_regs"],
                      LOG2_P_SCALE=G.LOG2_FP8_MAX, MAX_SPLIT=Q.MAX_SPLIT, V_PERM16=cfg["v_perm16"],
                      PINGPONG=cfg["pingpong"]),
                 {"Q Out": t, "Ks Stats": "*fp32", "FirstBad": "*i32", "Lse": "*fp32" if lse else t,
                  "k_desc": f"tensordesc<i8[{cfg['block_n']}, {D}],{k_layout!r}>",
                  "v_desc": f"tensordesc<fp8e4nv[{D}, {cfg['block_n']}],{v_layout!r}>"},
                 fp32="qk_scale", ones="stride_qd stride_od", num_warps=cfg["num_warps"])


def _attention_decode():
    """kv.decode_kernel.decode_forward_triton (split + merge) and append_triton, for 1–16 query rows and every
    cache width (packed 8/4/3-bit codes; the 3-bit mode reads its first-token plane). ShadowKV's launches of the
    same kernels (masked_decode_attention) are with the rest of ShadowKV in _kvcache."""
    from thrifty.kv import decode_kernel as K
    from thrifty.kv.decode import DECODE_HEAD_DIMS
    from thrifty.kv.quantized import CACHE_BITS

    cfg = K.DECODE_CONFIG
    assert K.decode_config() is cfg
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    for D in DECODE_HEAD_DIMS:
        # (q dtype, query heads per kv head, query rows, causal): ROWS = 16 (decode), 64 and 128 (drafts, GQA 8)
        for dtype, G, Sq, causal in ((bf16, 3, 1, True), (bf16, 4, 16, True), (bf16, 8, 16, False),
                                     (fp16, 3, 1, True), (fp32, 3, 1, True)):
            rows = max(16, 1 << (G * Sq - 1).bit_length())  # as decode_forward_triton
            label = f"D{D} {NAME[dtype]} G{G} Sq{Sq} rows{rows} {'causal' if causal else 'full'}"
            for bits in CACHE_BITS:
                yield entry(K._decode_split_kernel, f"{label} {bits}-bit",
                            dict(G=G, ROWS=rows, HEAD_DIM=D, BLOCK_N=cfg["block_n"], CAUSAL=causal, BITS=bits),
                            {"Q": PTR[dtype], "K V Ksink Vsink": "*u8", "Ks Vs Valid Part ML": "*fp32"},
                            fp32="qk_scale", ones="s_qd", num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
            yield entry(K._decode_merge_kernel, label, dict(G=G, ROWS=rows, HEAD_DIM=D, S_BLOCK=1),
                        {"Part ML": "*fp32", "Out": PTR[dtype]}, ones="s_od",
                        num_warps=4, num_stages=1)  # literals in decode_forward_triton
        for bits in CACHE_BITS:
            for dtype in ((bf16, fp16, fp32) if bits == 8 else (bf16,)):
                yield entry(K._append_kernel, f"D{D} {NAME[dtype]} {bits}-bit", dict(BITS=bits, HEAD_DIM=D),
                            {"X": PTR[dtype], "Codes Sink": "*u8", "Scale": "*fp32"}, ones="s_xd",
                            num_warps=1, num_stages=1)  # literal in append_triton


# --------------------------------------------------------------------------------------------- ShadowKV
def _kvcache():
    """kvcache.decode.kernel_decode_step: landmark logits + select (score_and_select), slot fill (fill_slots),
    split-K attention + merge (kv.decode_kernel.masked_decode_attention)."""
    from thrifty.kv import decode_kernel as AK
    from thrifty.kvcache import fill_kernel as FK, score_kernel as SK
    from thrifty.kvcache.config import ShadowKVConfig

    chunk = ShadowKVConfig().chunk_size
    chunks, block_t = FK.block_shape(chunk)
    block_n = inspect.signature(AK.masked_decode_attention).parameters["block_n"].default
    tu = SK.TUNING
    hist = dict(NB=tu.hist_bins, SHIFT=tu.hist_shift)
    for G in (1, 3, 4, 8):  # the score kernel reads fp32 logits only: one entry per group size and split count
        g_pad, g_p2 = SK.g_pads(G)
        for s_pad in (1, 64, 128):  # splits: 1 (large batch) .. 66 (batch 1 at 122K on 132 SMs) .. 128
            yield entry(SK._score_hist_kernel, f"G{G} S{s_pad}",
                        dict(G=G, G_PAD=g_pad, G_P2=g_p2, S_PAD=s_pad, BLOCK=tu.score_block, **hist),
                        {"logit_ptr part_m_ptr part_l_ptr score_ptr": "*fp32", "sel_ptr": "*i8",
                         "hist_ptr ref_ptr": "*i32"}, num_warps=SK.SCORE_WARPS)
    tail = {"mark_ptr valid_ptr": "*i8", "hist_ptr mseg_ptr cseg_ptr kseg_ptr count_ptr path_ptr miss_ptr cand_ptr ckey_ptr "
            "slot_ids_ptr slot_of_ptr work_ptr": "*i32"}
    mark = {"score_ptr": "*fp32", "sel_ptr mark_ptr valid_ptr": "*i8",
            "hist_ptr ref_ptr mseg_ptr cseg_ptr kseg_ptr count_ptr slot_of_ptr": "*i32"}

    def plan(k_pad, s_pad):  # as score_and_select
        return dict(K_PAD=k_pad, C_SIZE=chunk, C_PAD=triton.next_power_of_2(chunk), S_PAD=s_pad,
                    OB=tu.tail_cols(s_pad), TAIL_BLOCK=tu.select_block, RANK_BLOCK=tu.rank_block, NB=tu.hist_bins)

    for k_pad, s_pad in ((32, 128), (128, 128), (256, 128), (512, 128), (256, 1)):  # no dtype
        yield entry(SK._select_tail_kernel, f"K{k_pad} S{s_pad}", plan(k_pad, s_pad), tail, num_warps=SK.TAIL_WARPS)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for D in (64, 128):
            # the dtype only changes the new token's append (K and the splits are run-time values here)
            yield entry(SK._mark_kernel, f"D{D} {NAME[dtype]}",
                        dict(D=D, NB=tu.hist_bins, SHIFT=tu.hist_shift, BLOCK=tu.score_block),
                        mark | {"knew_ptr vnew_ptr kbuf_ptr vbuf_ptr": PTR[dtype], "ngen_ptr": "*i64"},
                        num_warps=SK.MARK_WARPS)
            # SmolLM2's 9/3 heads; Llama's 32/4, 64/8; MHA (the 7B reference model's static-cache decode)
            for G in ((1, 3, 8) if dtype == torch.bfloat16 else (1, 4)):
                g_pad = SK.g_pads(G)[0]  # as score_and_select / masked_decode_attention (dot_rows)
                assert g_pad == AK.dot_rows(G, 1)
                label = f"D{D} {NAME[dtype]} G{G}"
                for radius in (True, False):
                    yield entry(SK._landmark_logits_kernel, f"{label} radius={radius}",
                                dict(G=G, G_PAD=g_pad, D=D, BLOCK_C=tu.logit_block, NB=tu.hist_bins, RADIUS=radius),
                                {"q_ptr lm_ptr": PTR[dtype], "sel_ptr": "*i8",
                                 "rad_ptr logit_ptr part_m_ptr part_l_ptr": "*fp32", "hist_ptr": "*i32"},
                                fp32="scale rad_w")
                # BITS 0: float rows + validity; Sq = 1 and the innermost strides are 1 (Triton specializes them)
                yield entry(AK._decode_split_kernel, f"{label} rows",
                            dict(G=G, ROWS=g_pad, HEAD_DIM=D, BLOCK_N=block_n, CAUSAL=False, BITS=0),
                            {"Q K V": PTR[dtype], "Ks Vs Ksink Vsink Valid": "*i8", "Part ML": "*fp32"},
                            fp32="qk_scale", ones="s_qd Sq", num_warps=4, num_stages=3)
                for s_block in (1, 8, AK.MERGE_BLOCK):  # min(MERGE_BLOCK, next_power_of_2(splits))
                    yield entry(AK._decode_merge_kernel, f"{label} S{s_block}",
                                dict(G=G, ROWS=g_pad, HEAD_DIM=D, S_BLOCK=s_block),
                                {"Part ML": "*fp32", "Out": PTR[dtype]}, ones="s_od Sq", num_warps=4, num_stages=3)
            label = f"D{D} {NAME[dtype]} c{chunk}"
            for host in ("native", "fp8"):  # ShadowKVConfig.host_values
                yield entry(FK._fill_slots_kernel, f"{label} host={host}",
                            dict(C_SIZE=chunk, CHUNKS=chunks, BLOCK_T=block_t, HALF=D // 2, BLOCK_R=FK.BLOCK_R,
                                 HAS_SCALE=host == "fp8"),
                            {"work_ptr": "*i32", "u_ptr sv_ptr kbuf_ptr vbuf_ptr": PTR[dtype],
                             "cos_ptr sin_ptr": "*fp32", "src_ptr": "*fp8e4nv" if host == "fp8" else PTR[dtype],
                             "scale_ptr": "*fp32" if host == "fp8" else PTR[dtype]})


# --------------------------------------------------------------------------------------------- CCE
def _loss():
    """loss.forward.lse_forward (autotuned for 16-bit inputs: every config), lse_forward_gemm's row pass and
    loss.backward.linear_ce_backward."""
    from thrifty.loss import backward as B, forward as F

    base = F.forward_config(False)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        t = PTR[dtype]
        ptrs = {"E C BIAS": t, "ROWS TGT": "*i64", "OUT": "*fp32"}
        if dtype == torch.float32:  # fp32 runs the plain kernel with the fp32 tiles
            configs = [({**base, **F.FP32_TILES}, "fp32 tiles")]
        else:  # 16-bit: the autotuner picks among its configs on the GPU, so each must compile
            configs = [(dict(BLOCK_N=base["BLOCK_N"], BLOCK_V=base["BLOCK_V"], **c.kwargs, num_warps=c.num_warps,
                             num_stages=c.num_stages), f"autotune {i}") for i, c in enumerate(F._TUNED_CONFIGS)]
        for i, (cfg, name) in enumerate(configs):
            cfg = dict(cfg)
            options = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
            for bias, softcap in ((False, False), (True, True)) if i == 0 else ((False, False),):
                yield entry(F._lse_forward_kernel, f"{NAME[dtype]} {name} bias={bias} softcap={softcap}",
                            dict(HAS_BIAS=bias, HAS_SOFTCAP=softcap, **cfg), ptrs, fp32="softcap", **options)

        for bias, softcap in ((False, False), (True, True)):  # the GEMM forward's row pass over fp32 logits
            yield entry(F._row_stats_kernel, f"{NAME[dtype]} bias={bias} softcap={softcap}",
                        dict(HAS_BIAS=bias, HAS_SOFTCAP=softcap, BLOCK=2048),
                        {"X OUT": "*fp32", "BIAS": t, "TGT": "*i64"}, fp32="softcap", num_warps=8)

        cfg = B.backward_config(False)
        if dtype == torch.float32:
            cfg.update(B.FP32_TILES)
        options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        bn, bv, split = cfg["BLOCK_N"], cfg["BLOCK_V"], cfg["SPLIT"]
        g_t = "*fp32" if dtype == torch.float32 else "*bf16"  # the gradient tiles' dtype (fp16 inputs: bf16)
        lists_needed = g_t != t  # cuBLAS cannot take the tiles: the sparse GEMMs run, with work lists
        # (filter, sorted vocabulary, bias (+ dbias), softcap): exact default; filtering (always sorted) with
        # everything on; exact with a bias whose dbias this chunk does not need (the "dc" chunks of the two-pass end)
        variants = ((False, False, False, False, False), (True, True, True, True, True),
                    (False, False, True, False, False))
        for filt, order, bias, dbias, softcap in variants if dtype == torch.bfloat16 else variants[:2]:
            yield entry(B._grad_tile_kernel, f"{NAME[dtype]} filter={filt} order={order} bias={bias}/{dbias} "
                        f"softcap={softcap}",
                        dict(HAS_BIAS=bias, HAS_SOFTCAP=softcap, HAS_ORDER=order, FILTER=filt, NEED_DBIAS=dbias,
                             SPLIT=split, LISTS=filt or lists_needed, BLOCK_N=bn, BLOCK_V=bv * split,
                             BLOCK_D=cfg["BLOCK_D_TILE"]),
                        {"E C BIAS": t, "ROWS TGT ORDER": "*i64", "LSE W DBIAS": "*fp32", "G": g_t,
                         "CNT_DC LIST_DC CNT_DE LIST_DE CNT_ALL": "*i32"},
                        fp32="softcap z_loss onehot_weight uniform_weight filter_eps", **options)
        for order in (False, True):
            yield entry(B._dc_kernel, f"{NAME[dtype]} order={order}",
                        dict(HAS_ORDER=order, BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=cfg["BLOCK_D_DC"]),
                        {"G": g_t, "CNT_DC LIST_DC": "*i32", "E DC": t, "ROWS ORDER": "*i64"}, **options)
            # dE is always accumulated in fp32 (16-bit inputs: an fp32 accumulator; fp32 inputs: in place)
            yield entry(B._de_kernel, f"{NAME[dtype]} order={order} dE=fp32",
                        dict(HAS_ORDER=order, DE_BY_ROW=False, BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=cfg["BLOCK_D_DE"]),
                        {"G": g_t, "CNT_DE LIST_DE": "*i32", "C": t, "ORDER ROWS": "*i64", "DE": "*fp32"}, **options)
        if dtype != torch.float32:  # dE's fp32 accumulator rounded from its two halves (16-bit inputs)
            for block, warps in ((1024, 4), (4096, 8), (16384, 16)):  # as _FP32Accumulator.round_into_de
                yield entry(B._round_halves_kernel, f"{NAME[dtype]} BLOCK={block}", dict(BLOCK=block),
                            {"LEFT RIGHT": "*fp32", "OUT": t}, num_warps=warps)



def _loss_gluon():
    """loss.gluon_tile._grad_tile_gluon_kernel as gluon_tile.grad_tiles launches it (bf16 only): the default
    config (a TMA store of the tiles where the chunk's rows are 16-byte aligned), the chunk's width (the tiles' row
    stride too) a multiple of 16 (plan_chunks' chunks) or not (the last chunk of an odd vocabulary: stores from
    registers, 2 bytes wide); softcapped calls with SOFTCAP_TILE_CONFIG (stores from registers)."""
    from thrifty.loss import gluon_tile as GT

    for aligned in (True, False):
        yield loss_gluon_entry(GT.TILE_CONFIG, False, aligned, "default")
        yield loss_gluon_entry(GT.SOFTCAP_TILE_CONFIG, True, aligned, "softcap")
    for softcap in (False, True):
        yield loss_gluon_lse_entry(GT.LSE_CONFIG, softcap)


def loss_gluon_entry(cfg, softcap: bool, aligned: bool, name: str) -> Spec:
    """One launch of the Gluon tile kernel (``cfg``: a gluon_tile config), as gluon_tile.grad_tiles makes it."""
    from thrifty.loss import gluon_tile as GT

    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    e_layout, c_layout = GT.shared_layouts(bm, bn, bk)
    tile_m = GT.HALVES * bm
    tma_store = cfg["tma_store"] and not softcap and aligned  # as grad_tiles decides (16-byte aligned rows)
    label = (f"bf16 {name} block_m={bm} block_n={bn} stages={cfg['stages']} "
             f"softcap={softcap} cur%16={'0' if aligned else 'any'} tma_store={tma_store}")
    descs = {"e_desc": f"tensordesc<bf16[{bm}, {bk}],{e_layout!r}>",
             "c_desc": f"tensordesc<bf16[{bn}, {bk}],{c_layout!r}>"}
    if tma_store:
        descs["g_desc"] = f"tensordesc<bf16[{bm}, {bn}],{GT.grad_store_layout(bm, bn)!r}>"
    return entry(GT._grad_tile_gluon_kernel, label,
                 dict(HAS_SOFTCAP=softcap, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=cfg["stages"],
                      A_SUB=GT.HALVES, GROUP_M=max(1, GT.GROUP_ROWS // tile_m),
                      CONSUMER_REGS=cfg["consumer_regs"], PRODUCER_REGS=cfg["producer_regs"], TMA_STORE=tma_store),
                 {"TGT": "*i64", "LSE W": "*fp32", "G": "*bf16", **descs},
                 fp32="softcap z_loss onehot_weight uniform_weight", nones="" if tma_store else "g_desc",
                 aligned="VC stride_g" if aligned else "", num_warps=cfg["num_warps"])


def loss_gluon_lse_entry(cfg, softcap: bool) -> Spec:
    """One launch of the Gluon LSE forward kernel (``cfg``: a gluon_tile config), as
    gluon_tile.lse_forward_gluon makes it (softcap off and on)."""
    from thrifty.loss import gluon_tile as GT

    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    e_layout, c_layout = GT.shared_layouts(bm, bn, bk)
    label = f"bf16 lse block_m={bm} block_n={bn} stages={cfg['stages']} softcap={softcap}"
    return entry(GT._lse_gluon_kernel, label,
                 dict(HAS_SOFTCAP=softcap, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=cfg["stages"],
                      A_SUB=GT.HALVES, GROUP_M=max(1, GT.GROUP_ROWS // (GT.HALVES * bm)),
                      CONSUMER_REGS=cfg["consumer_regs"],
                      PRODUCER_REGS=cfg["producer_regs"]),
                 {"TGT": "*i64", "PART": "*fp32",
                  "e_desc": f"tensordesc<bf16[{bm}, {bk}],{e_layout!r}>",
                  "c_desc": f"tensordesc<bf16[{bn}, {bk}],{c_layout!r}>"},
                 fp32="softcap", num_warps=cfg["num_warps"])


# --------------------------------------------------------------------------------------------- NeuZip
def _neuzip():
    """decode_kernel.decode_into (v3 default; v1/v2 on request), block_decode.BlockPack.decode_into and the
    lossless encoder (encode_kernel.encode_lossless_triton)."""
    from thrifty.neuzip import block_decode as BD, decode_kernel as DK, encode_kernel as EK, reference as R

    defaults = inspect.signature(DK.decode_into).parameters
    warps = defaults["num_warps"].default

    def layout(dtype, mantissa_bits):
        bits, shift, _ = R.DTYPES[dtype]
        kept = R.field_layout(dtype, mantissa_bits)[0]
        return bits, dict(FIELD_BITS=kept + 1, KEPT=kept, SYM_SHIFT=shift, SIGN_SHIFT=bits - 1)

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    # (dtype, mantissa bits (None: lossless), lane steps, small first-level table)
    v3 = [(bf16, None, R.STEPS, False), (fp16, None, R.STEPS, False), (fp32, None, R.STEPS, False),
          *[(bf16, m, R.STEPS, False) for m in R.LOSSY_MANTISSA_BITS if m != R.DTYPES[bf16][2]],
          *[(bf16, None, s, False) for s in R.LANE_STEPS if s != R.STEPS],
          (bf16, None, R.STEPS, True)]
    for dtype, mbits, steps, small in v3:
        bits, fields = layout(dtype, mbits)
        table_t = "*i16" if bits == 16 else "*i32"  # decompress's default table16 for 16-bit dtypes
        label = f"{NAME[dtype]} m={mbits} steps={steps}" + " small" * small
        yield entry(DK._decode_kernel_v3, label,
                    dict(STEPS=steps, GROUP=R.GROUP, GROUPS_PER_PROG=4,  # literal in decode_into (v3)
                         **fields, ASM=True,
                         TSIZE=bits // 8, SMALL=small, LANE_SHIFT=R.lane_unit(steps).bit_length() - 1),
                    {"words_ptr": "*i32", "lane_bits_ptr": "*u8", "group_off_ptr": "*i64",
                     "raw_ptr": "*u8", "table_ptr small_ptr": table_t, "out_ptr": "*i16" if bits == 16 else "*i32"},
                    num_warps=warps, num_stages=3)  # literal in decode_into
    for kern in (DK._decode_kernel, DK._decode_kernel_pipelined):  # kernel="v1" / "v2"
        for dtype, small in ((bf16, False), (bf16, True), (fp32, False)):
            bits, fields = layout(dtype, None)
            yield entry(kern, f"{NAME[dtype]} small={small}",
                        dict(STEPS=R.STEPS, GROUP=R.GROUP, GROUPS_PER_PROG=2,  # literal in decode_into (v1/v2)
                             **fields,
                             TABLE_BITS=R.MAX_CODE_BITS, SMALL_TABLE=small,
                             LANE_SHIFT=R.lane_unit(R.STEPS).bit_length() - 1),
                        {"words_ptr table_ptr": "*i32", "lane_bits_ptr": "*u8", "group_off_ptr": "*i64",
                         "raw_ptr": "*u8", "small_ptr": "*i16" if small else "*i32",
                         "out_ptr": "*i16" if bits == 16 else "*i32"}, num_warps=warps)
    block = [(bf16, None, R.STEPS), (bf16, 3, R.STEPS), (bf16, 1, R.STEPS), (bf16, 0, R.STEPS), (fp16, None, R.STEPS),
             (fp32, None, R.STEPS), *[(bf16, None, s) for s in R.LANE_STEPS if s != R.STEPS]]
    for (dtype, mbits, steps), (gpp, warps) in itertools.product(block, (BD.WIDE, BD.NARROW)):
        bits, fields = layout(dtype, mbits)
        yield entry(BD._block_decode_kernel, f"{NAME[dtype]} m={mbits} steps={steps} g{gpp}w{warps}",
                    dict(STEPS=steps, GROUP=R.GROUP, GROUPS_PER_PROG=gpp, **fields, ASM=True,
                         TSIZE=bits // 8, LANE_SHIFT=R.lane_unit(steps).bit_length() - 1, META_W=BD.META),
                    {"meta_ptr goff_ptr": "*i64", "words_ptr pair_tables_ptr": "*i32", "lanes_ptr raw_ptr": "*u8",
                     "tables_ptr out_ptr": "*i16" if bits == 16 else "*i32"},
                    num_warps=warps, num_stages=3)  # literal in BlockPack.decode_into
    for dtype in (bf16, fp16, fp32):  # one launch per kernel and block; pairs or not: per tensor, at run time
        bits, shift, kept = R.DTYPES[dtype]
        x_t = "*i16" if bits == 16 else "*i32"
        tp = triton.next_power_of_2(7)  # a transformer block's 7 linears (TP: the table's power-of-two width)
        hist = dict(TP=tp, META_W=EK.META_W, HIST_W=EK.HIST_W, BLOCK=EK.HIST_BLOCK, BITS=bits, SHIFT=shift)
        yield entry(EK._sym_hist_kernel, NAME[dtype], hist, {"x_ptr": x_t, "meta_ptr": "*i64", "hist_ptr": "*i32"})
        yield entry(EK._pair_hist_kernel, NAME[dtype], dict(hist, WINDOW=EK.WINDOW),
                    {"x_ptr": x_t, "meta_ptr": "*i64", "rank_ptr symof_ptr hist_ptr": "*i32"})
        lanes = dict(TP=tp, META_W=EK.META_W, STEPS=R.STEPS, GROUP=R.GROUP, GROUPS_PER_PROG=EK.GROUPS_PER_PROG,
                     BITS=bits, SHIFT=shift)
        unit = R.lane_unit(R.STEPS)
        for check, width in ((False, R.PAIR_SYMBOLS), (True, 256)):  # a fresh code / a reused covering code
            yield entry(EK._lane_bits_kernel, f"{NAME[dtype]} check={check}",
                        dict(lanes, CHECK=check, UNIT=unit, TAB_W=width),
                        {"x_ptr": x_t, "meta_ptr sizes_ptr": "*i64", "pairs_ptr tab_ptr padded_ptr": "*i32",
                         "units_ptr": "*u8"})
            yield entry(EK._pack_kernel, f"{NAME[dtype]} width={width}",
                        dict(lanes, KEPT=kept, RAW_BYTES=R.field_layout(dtype, None)[1] // 8, TAB_W=width),
                        {"x_ptr": x_t, "meta_ptr ends_ptr wbase_ptr goff_ptr": "*i64",
                         "pairs_ptr tab_ptr padded_ptr words_ptr": "*i32", "raw_ptr": "*u8"})


# --------------------------------------------------------------------------------------------- BitNet
def _topk_16bit(x_dtype, y_dtype, D: int, norm: bool, ones: str = "") -> Spec:
    """bitnet.topk_kernel as ``launch`` runs it for (n, D) rows of a 16-bit dtype (norm weight fp32)."""
    from thrifty.bitnet import topk_kernel as TK
    from thrifty.bitnet.reference import EPS

    cfg = TK.launch_config(D)
    return entry(TK._topk_int8_kernel, f"{NAME[x_dtype]}->{NAME[y_dtype]} D={D} norm={norm}",
                 dict(D=D, HAS_NORM=norm, ROWS=cfg["ROWS"], PAIRS=cfg["PAIRS"], KEY_BITS=TK.KEY_BITS,
                      BAD=TK.BAD_KEY[x_dtype],
                      EPS_=EPS, COMPILED=TK.COMPILED),
                 {"x_ptr": PTR[x_dtype], "y_ptr": PTR[y_dtype], "w_ptr rstd_ptr": "*fp32"}, fp32="norm_eps",
                 ones=ones, num_warps=cfg["num_warps"], num_stages=3)


def _bitnet():
    """bitnet.quant_kernel: the input kernel for every fused quantizer a recipe uses (with and without the
    sub-norm, fp32 input -> bf16 out as under autocast, bf16 in and out), the sub-norm backward, the ternary
    weight."""
    from thrifty.bitnet import quant_kernel as QK, topk_kernel as TK
    from thrifty.bitnet.bitlinear import FUSED_KINDS
    from thrifty.bitnet.recipes import RECIPES
    from thrifty.bitnet.reference import EPS

    used = {v[0] if isinstance(v, tuple) else v for r in RECIPES.values() if r for v in r.values()}
    bf16, fp32 = torch.bfloat16, torch.float32
    for kind in sorted(used & set(FUSED_KINDS)):
        # the 30m preset's widths (384, 1024), SmolLM2's (576, 1536), the longest row the kernel takes
        for x_dtype, y_dtype, D, norm in ((fp32, bf16, 384, False), (bf16, bf16, 384, True), (bf16, bf16, 1024, True),
                                          (fp32, bf16, 576, False), (bf16, bf16, 1536, True),
                                          (bf16, bf16, QK.MAX_ROW[kind], False), (fp32, fp32, 576, True)):
            if kind == "topk_int8" and x_dtype in TK.BAD_KEY:  # 16-bit TopK rows: topk_kernel (quant_kernel._launch)
                yield _topk_16bit(x_dtype, y_dtype, D, norm)
                continue
            block = triton.next_power_of_2(D)
            shift, key_bits = QK.KEYS[x_dtype]
            yield entry(QK._quantize_rows_kernel, f"{kind} {NAME[x_dtype]}->{NAME[y_dtype]} D={D} norm={norm}",
                        dict(KIND=QK.KINDS[kind], HAS_NORM=norm, KEY_SHIFT=shift, KEY_BITS=key_bits, BLOCK_D=block,
                             EPS_=EPS),
                        {"x_ptr": PTR[x_dtype], "y_ptr": PTR[y_dtype], "w_ptr rstd_ptr": "*fp32"},
                        fp32="beta_scale norm_eps", num_warps=QK._num_warps(block), num_stages=3)  # as _launch
        yield entry(QK._quantize_rows_kernel, f"{kind} fp32 D=1 (Triton makes D a constant 1) norm=True",
                    dict(KIND=QK.KINDS[kind], HAS_NORM=True, KEY_SHIFT=0, KEY_BITS=31, BLOCK_D=1, EPS_=EPS),
                    {"x_ptr y_ptr w_ptr rstd_ptr": "*fp32"}, fp32="beta_scale norm_eps", ones="D", num_warps=1,
                    num_stages=3)
    # topk_kernel's other launch shapes (D is a constexpr: padding words fold away): fp16 rows, the 7B width
    # (2 warps), fp32 output, one row of one feature (Triton makes every integer argument a constant 1)
    yield _topk_16bit(torch.float16, torch.float16, 384, True)
    yield _topk_16bit(bf16, bf16, 4096, False)
    yield _topk_16bit(bf16, fp32, 576, False)
    yield _topk_16bit(bf16, bf16, 1, True, ones="n_rows stride_x stride_y k_keep")
    for dtype, D in ((bf16, 384), (bf16, 1024), (bf16, 1536), (fp32, 576)):
        block = triton.next_power_of_2(D)
        yield entry(QK._norm_backward_kernel, f"{NAME[dtype]} D={D}", dict(ROWS=QK.NORM_BACKWARD_ROWS, BLOCK_D=block),
                    {"x_ptr g_ptr dx_ptr": PTR[dtype], "w_ptr rstd_ptr dw_part_ptr": "*fp32"},
                    num_warps=QK._num_warps(block), num_stages=3)  # as norm_backward
    for dtype in (bf16, fp32):
        yield entry(QK._ternary_kernel, NAME[dtype], dict(BLOCK=QK.WEIGHT_BLOCK, EPS_=EPS),
                    {"w_ptr l1_ptr": "*fp32", "out_ptr": PTR[dtype]}, i64="",
                    num_warps=8, num_stages=3)  # literal in ternary_weight


def _optim_lomo():
    """lomo_kernel.adamw_update: float states (fp32, bf16) for bf16/fp16/fp32 weights and bf16/fp32 gradients;
    8-bit states at the smallest, the default and the largest state block (tile8 picks rows and warps)."""
    from thrifty.optim import lomo_kernel as LK

    ptr = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
    scalars = "decay_mul lerp_w lerp_small b2 one_minus_b2 sqrt_bc2 eps step_size"
    for w, g, st, decay in itertools.product(ptr, (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                             (False, True)):
        yield entry(LK._adamw_kernel, f"w {NAME[w]} g {NAME[g]} states {NAME[st]} decay={decay}",
                    dict(HAS_DECAY=decay, BLOCK=LK.BLOCK),
                    {"w_ptr": ptr[w], "g_ptr": ptr[g], "m_ptr v_ptr": ptr[st]}, fp32=scalars,
                    num_warps=4, num_stages=1)  # literal in adamw_update
    for w, block, decay in itertools.product((torch.bfloat16, torch.float32), (16, 256, 4096), (False, True)):
        rows, warps = LK.tile8(block)
        yield entry(LK._adamw8_kernel, f"w {NAME[w]} block {block} decay={decay}",
                    dict(HAS_DECAY=decay, QBLOCK=block, ROWS=rows),
                    {"w_ptr g_ptr": ptr[w], "mq_ptr": "*i8", "vq_ptr": "*u8", "ms_ptr vs_ptr mt_ptr vt_ptr": "*fp32"},
                    fp32=scalars + " m_per_octave v_per_octave", num_warps=warps, num_stages=1)


def _bitnet_packed():
    """bitnet.packed_kernel: the activation-codes kernel per recipe quantizer (with and without the sub-norm,
    fp32/bf16 inputs, the widths of a 2B and a 7B layer and the longest row), and the matmuls at every plan()
    a 7B / 2B layer takes for 1, 2, 4, 16 and 2048 tokens, with and without split-K and bias."""
    from thrifty.bitnet import packed_kernel as PK
    from thrifty.bitnet.pack import padded_k
    from thrifty.bitnet.reference import EPS

    bf16, fp32 = torch.bfloat16, torch.float32
    for kind in PK.KINDS:
        for x_dtype, D, norm in ((bf16, 4096, False), (bf16, 11008, True), (fp32, 2560, False),
                                 (bf16, 6912, True), (bf16, PK.MAX_ROW[kind], False)):
            block = triton.next_power_of_2(padded_k(D))
            shift, key_bits = PK.KEYS[x_dtype]
            yield entry(PK._act_codes_kernel, f"{kind} {NAME[x_dtype]} D={D} norm={norm}",
                        dict(KIND=PK.KINDS[kind], HAS_NORM=norm, KEY_SHIFT=shift, KEY_BITS=key_bits, BLOCK_D=block,
                             EPS_=EPS, PDL=True),
                        {"x_ptr": PTR[x_dtype], "w_ptr scale_ptr": "*fp32", "codes_ptr": "*i8", "sum_ptr": "*i32"},
                        fp32="beta_scale norm_eps", num_warps=max(1, min(16, block // 512)), num_stages=3)
        block = triton.next_power_of_2(padded_k(4096))  # a model in bf16: the sub-norm weight is bf16 too
        yield entry(PK._act_codes_kernel, f"{kind} bf16 D=4096 norm=True (bf16 norm weight)",
                    dict(KIND=PK.KINDS[kind], HAS_NORM=True, KEY_SHIFT=16, KEY_BITS=15, BLOCK_D=block, EPS_=EPS,
                         PDL=True),
                    {"x_ptr w_ptr": "*bf16", "scale_ptr": "*fp32", "codes_ptr": "*i8", "sum_ptr": "*i32"},
                    fp32="beta_scale norm_eps", num_warps=max(1, min(16, block // 512)), num_stages=3)
        if kind not in PK.STREAM_KINDS:
            continue
        # the streaming codes kernel (quantize_codes from PK.STREAM_MIN_ROWS rows on): the same widths and flags
        for x_dtype, w_dtype, D, norm in ((bf16, fp32, 4096, False), (bf16, fp32, 11008, True),
                                          (fp32, fp32, 2560, False), (bf16, fp32, 6912, True),
                                          (bf16, fp32, PK.MAX_ROW[kind], False), (bf16, bf16, 4096, True),
                                          (bf16, fp32, 4096, True), (bf16, fp32, 11008, False)):
            chunk = min(PK.STREAM_CHUNK, triton.next_power_of_2(padded_k(D)))
            yield entry(PK._act_codes_stream_kernel, f"{kind} {NAME[x_dtype]} D={D} norm={norm}"
                        + f" ({NAME[w_dtype]} norm weight)" * (w_dtype != fp32),
                        dict(KIND=PK.KINDS[kind], HAS_NORM=norm, CHUNK=chunk, EPS_=EPS),
                        {"x_ptr": PTR[x_dtype], "w_ptr": PTR[w_dtype], "scale_ptr": "*fp32", "codes_ptr": "*i8",
                         "sum_ptr": "*i32"},
                        fp32="beta_scale norm_eps", aligned="D KP stride_x stride_c",  # every width: 16·n
                        num_warps=max(1, min(PK.STREAM_WARPS, chunk // 256)), num_stages=1)  # quantize_codes
    plans, v3 = set(), set()
    for n, k in ((4096, 4096), (11008, 4096), (4096, 11008), (2560, 2560), (6912, 2560), (2560, 6912),
                 (12288, 4096), (22016, 4096), (1024, 2560), (64, 1100)):  # + the stacked 7B q/k/v, gate/up
        for m in (1, 2, 3, 4, 16, 32, 64, 128, 256, 2048):  # every tile class of plan()
            if m == 1:  # v3, decode_plan's (the tile does not depend on the tokens: one grid row each)
                cfg = PK.decode_plan(m, n, k)
                v3.add((cfg["BLOCK_N"], cfg["KW"], cfg["num_warps"], cfg["num_stages"]))
            cfg = PK.plan(m, n, k)
            if cfg["kernel"] != "decode":
                plans.add((cfg["kernel"], cfg["BLOCK_N"], cfg["BLOCK_M"], cfg["split"] > 1, cfg["num_warps"],
                           cfg["num_stages"]))
    # decode GEMV v3 at every decode plan: bf16 and fp32 outputs, with and without bias
    for bn, kw, warps, stages in sorted(v3):
        for dtype, bias, pdl in ((bf16, False, True), (fp32, True, True), (bf16, False, False)):
            yield entry(PK._decode_gemv_v3_kernel, f"decode v3 {bn}x1 KW={kw} stages={stages} {NAME[dtype]} "
                        f"bias={bias} pdl={pdl}", dict(BLOCK_N=bn, KW=kw, STAGES=stages, HAS_BIAS=bias,
                                                       USE_ASM=PK.USE_ASM, PDL=pdl),
                        {"codes_ptr sum_ptr w_ptr": "*i32", "scale_ptr alpha_ptr bias_ptr": "*fp32",
                         "out_ptr": PTR[dtype]}, num_warps=warps, num_stages=stages)
    for kernel, bn, bm, split, warps, stages in sorted(plans):
        # split mode as matmul_codes passes it: 0 none, 1 workspace + epilogue kernel; the GEMM's tiles of few
        # tokens in both launch modes (gemm_launches_early also counts programs), wider tiles without
        pdls = (None,) if kernel == "gemv" else (False, True) if bm <= PK.GEMM_PDL_MAX_TOKENS else (False,)
        for (dtype, bias, mode), pdl in itertools.product(((bf16, False, int(split)), (fp32, True, int(split))), pdls):
            fn = PK._gemv_kernel if kernel == "gemv" else PK._gemm_kernel
            w, x = ("*i32", "*i32") if kernel == "gemv" else ("*u8", "*i8")
            extra = dict(STAGES=stages) if kernel == "gemv" else dict(PDL=pdl)
            yield entry(fn, f"{kernel} {bn}x{bm} split={mode} {NAME[dtype]} bias={bias}"
                        + ("" if pdl is None else f" pdl={pdl}"),
                        dict(BLOCK_N=bn, BLOCK_M=bm, SPLIT=mode, HAS_BIAS=bias, USE_ASM=PK.USE_ASM, **extra),
                        {"w_ptr": w, "x_ptr": x, "ws_ptr sum_ptr": "*i32",
                         "scale_ptr alpha_ptr bias_ptr": "*fp32", "out_ptr": PTR[dtype]}, num_warps=warps,
                        num_stages=stages)
    # the plain-Triton decode, which benchmarks/bitnet_kernels.py falls back to if the inline PTX were wrong
    for fn, w, x, bn, bm, extra in ((PK._gemv_kernel, "*i32", "*i32", 32, 1, dict(STAGES=4)),
                                    (PK._gemm_kernel, "*u8", "*i8", 64, 16, dict(PDL=False))):
        yield entry(fn, f"USE_ASM=False {bn}x{bm}", dict(BLOCK_N=bn, BLOCK_M=bm, SPLIT=1, HAS_BIAS=False,
                                                         USE_ASM=False, **extra),
                    {"w_ptr": w, "x_ptr": x, "ws_ptr sum_ptr": "*i32", "scale_ptr alpha_ptr bias_ptr": "*fp32",
                     "out_ptr": PTR[bf16]}, num_warps=4, num_stages=4)
    # the norm in front of a stacked INT8 projection writing its codes (stacked.CodesRMSNorm via norm_codes): the
    # fused RMSNorm's launch shape (fused_layers._norm_launch) at the 7B / 2B widths and a tiny one (zero tail)
    from thrifty.fused_layers import _norm_launch

    for D, dtype, add, kind in ((4096, bf16, False, 0), (4096, bf16, True, 0), (2560, fp32, True, 0),
                                (4096, bf16, True, 1), (64, bf16, False, 0)):
        launch, kp = _norm_launch(D), padded_k(D)
        tail = triton.next_power_of_2(kp - launch["BLOCK"]) if kp > launch["BLOCK"] else 0
        yield entry(PK._norm_codes_kernel, f"norm codes D={D} {NAME[dtype]} add={add} kind={kind}",
                    dict(ADD=add, KIND=kind, BLOCK=launch["BLOCK"], TAIL=tail, EPS_=EPS, PDL=True),
                    {"X R W S Y": PTR[dtype], "codes_ptr": "*i8", "scale_ptr": "*fp32", "sum_ptr": "*i32"},
                    fp32="eps beta_scale", num_warps=launch["num_warps"], num_stages=1)
    # the GLU in front of a packed down projection making its codes (packed_kernel.glu_codes): the 7B / 2B FFN
    # widths and a short one, as the launcher specializes them (row lengths and strides multiples of 16)
    for D, dtype, relu2, kind, norm in ((11008, bf16, True, 0, True), (11008, bf16, False, 1, True),
                                        (6912, fp32, True, 0, False), (96, bf16, True, 0, True)):
        block = triton.next_power_of_2(padded_k(D))
        yield entry(PK._glu_codes_kernel, f"glu codes D={D} {NAME[dtype]} relu2={relu2} kind={kind} norm={norm}",
                    dict(RELU2=relu2, KIND=kind, HAS_NORM=norm, BLOCK_D=block, EPS_=EPS, PDL=True),
                    {"G U Y w_ptr": PTR[dtype], "codes_ptr": "*i8", "scale_ptr": "*fp32", "sum_ptr": "*i32"},
                    fp32="beta_scale norm_eps", aligned="D KP stride_g stride_u stride_c",
                    num_warps=max(1, min(16, block // 512)), num_stages=3)
    bn, bm = PK.EPILOGUE_TILE
    for dtype, bias in ((bf16, False), (fp32, True)):
        yield entry(PK._splitk_epilogue_kernel, f"{NAME[dtype]} bias={bias}", dict(BLOCK_N=bn, BLOCK_M=bm, HAS_BIAS=bias),
                    {"ws_ptr sum_ptr": "*i32", "scale_ptr alpha_ptr bias_ptr": "*fp32", "out_ptr": PTR[dtype]},
                    num_warps=4, num_stages=1)  # literal in matmul_codes


def _fused_layers():
    """fused_layers.rms_norm / add_rms_norm / glu / rope as the reference model's inference calls make them: every float dtype, the
    widths of the presets and the 7B shape (rms_norm's BLOCK = next power of two of D), head_dim 64 and 128."""
    from thrifty import fused_layers as FL

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for w_dtype in dict.fromkeys((dtype, torch.float32)):
            out = PTR[torch.promote_types(dtype, w_dtype)]
            for block in (512, 1024, 4096, 8192):
                yield entry(FL._rms_norm_kernel, f"{NAME[dtype]} w={NAME[w_dtype]} BLOCK={block}", dict(BLOCK=block),
                            {"X": PTR[dtype], "W": PTR[w_dtype], "Y": out}, fp32="eps", ones="",
                            num_warps=4 if block <= 4096 else 8)
                yield entry(FL._add_rms_norm_kernel, f"{NAME[dtype]} w={NAME[w_dtype]} BLOCK={block}",
                            dict(BLOCK=block), {"X R S": PTR[dtype], "W": PTR[w_dtype], "Y": out}, fp32="eps",
                            num_warps=4 if block <= 4096 else 8)
        for relu2 in (False, True):
            yield entry(FL._glu_kernel, f"{NAME[dtype]} relu2={relu2}", dict(RELU2=relu2, BLOCK=2048),
                        {"G U Y": PTR[dtype]}, num_warps=4)
        for half in (32, 64):
            yield entry(FL._rope_kernel, f"{NAME[dtype]} Dh={2 * half}", dict(HALF=half, BLOCK=half),
                        {"X Y": PTR[dtype], "COS SIN": "*fp32"}, num_warps=1)
            # the static cache's one-launch RoPE + write (positions int64 from torch.arange, buffers of q's dtype)
            yield entry(FL._rope_qk_into_cache_kernel, f"{NAME[dtype]} Dh={2 * half}", dict(HALF=half, BLOCK=half),
                        {"Q K V QO KB VB": PTR[dtype], "COS SIN": "*fp32", "POS": "*i64"}, num_warps=1)


SPECS = _unique([*_attention(), *_attention_gluon(), *_attention_decode(), *_kvcache(), *_loss(), *_loss_gluon(),
                 *_neuzip(), *_optim_lomo(),
                 *_bitnet(), *_bitnet_packed(), *_fused_layers()])


# --------------------------------------------------------------------------------------------- scanning
def package_modules(package: str = "thrifty") -> tuple[list, dict]:
    """(every module of ``package``, imported; {module name: import error})."""
    pkg = importlib.import_module(package)
    modules, errors = [pkg], {}
    for info in pkgutil.walk_packages(pkg.__path__, package + "."):
        try:
            modules.append(importlib.import_module(info.name))
        except Exception as e:  # noqa: BLE001 - reported, the test fails on it
            errors[info.name] = f"{type(e).__name__}: {e}"
    return modules, errors


def _resolve(node, scope):
    """The object an ``f`` / ``mod.f`` call target names in ``scope`` (a module's globals), or None."""
    if isinstance(node, ast.Name):
        return scope.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, scope)
        return getattr(base, node.attr, None) if base is not None else None
    return None


def _unwrap(obj):
    """The JITFunction under ``triton.autotune`` / ``triton.heuristics`` wrappers (their ``.fn``), or None."""
    while obj is not None and not isinstance(obj, JITFunction):
        obj = getattr(obj, "fn", None) if hasattr(obj, "run") else None
    return obj


def jit_kernels(modules) -> dict:
    """{"module:name": {"fn": JITFunction, "entry": bool}} for every ``@triton.jit`` function defined at module
    level in ``modules``. Entry kernels are those no other jit function calls or names (the others are device
    helpers and combine functions, compiled inside the kernels that use them); names are read from each
    function's AST and resolved in its
    module's globals, so an aliased import (``from .x import f as g``) counts too."""
    found = {}
    for mod in modules:
        for obj in map(_unwrap, vars(mod).values()):
            if obj is not None and obj.fn.__module__ == mod.__name__:
                found[kernel_key(obj)] = obj
    called = set()  # called, or passed as a combine function (tl.reduce(x, 1, f)): compiled inside its user
    for fn in found.values():
        for node in ast.walk(ast.parse(fn.src)):
            if isinstance(node, (ast.Name, ast.Attribute)):
                target = _resolve(node, fn.fn.__globals__)
                if isinstance(target, JITFunction) and target is not fn:
                    called.add(kernel_key(target))
    return {k: {"fn": fn, "entry": k not in called} for k, fn in sorted(found.items())}


def hidden_kernels(modules) -> list:
    """``@triton.jit`` functions in the modules' source that are not module-level objects (nested in a
    function, or rebound): the scanner cannot see them, so they cannot be checked."""
    out = []
    for mod in modules:
        try:
            tree = ast.parse(inspect.getsource(mod))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                obj = _unwrap(getattr(mod, node.name, None))
                if not (obj is not None and obj.fn.__module__ == mod.__name__):
                    out.append(f"{mod.__name__}:{node.name}")
    return out


def unlisted(kernels: dict, specs) -> list:
    """Entry kernels with no compile entry."""
    listed = {s.name for s in specs}
    return [k for k, v in kernels.items() if v["entry"] and k not in listed]


# --------------------------------------------------------------------------------------------- compiling
def compile_kernel(spec: Spec):
    """triton.compile of one entry for sm_90 (pointers 16-byte aligned, as fresh PyTorch allocations are)."""
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(spec.signature.items())
             if t.startswith("*") or n in spec.aligned}
    source = GluonASTSource if spec.kernel.is_gluon() else ASTSource  # Gluon kernels are TTGIR already
    return triton.compile(source(spec.kernel, spec.signature, spec.constexprs, attrs), target=SM90,
                          options=spec.options)


def cuda_tool(name: str) -> str:
    """Path of one of Triton's bundled CUDA tools (ptxas, cuobjdump, nvdisasm)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def resources(cubin: bytes) -> dict:
    """Registers per thread at launch and stack-frame bytes (spills and local arrays) of a cubin, as
    ``cuobjdump -res-usage`` reads them (a warp-specialized kernel's partitions then resize by setmaxnreg)."""
    import re
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuda_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return dict(regs=int(m.group(1)), stack=int(m.group(2))) if m else {}


def code_hash(ptx: str) -> str:
    """A hash of the PTX's instructions only (no debug sections, line markers or comments; the kernel's mangled
    name normalised): equal across two trees when a change left this variant's machine code as it was, which
    needs no GPU run to show (compare the ``code`` fields of two reports by label)."""
    ptx = ptx.split(".section\t.debug", 1)[0]
    lines = [line for line in ptx.splitlines() if not re.match(r"\s*(\.loc|//|\.file)", line)]
    body = re.sub(r"\b[A-Za-z_]\w*_kernel\w*", "KERNEL", "\n".join(lines))
    return hashlib.sha1(body.encode()).hexdigest()[:16]


def compile_spec(spec: Spec) -> dict:
    """Compiles one entry for sm_90; the report's row (shared memory, registers, stack bytes, the instructions'
    hash, or the error)."""
    t0 = time.perf_counter()
    out = dict(kernel=spec.name, label=spec.label, options=spec.options)
    try:
        k = compile_kernel(spec)
        out.update(ok=True, shared=k.metadata.shared, num_warps=k.metadata.num_warps, **resources(k.asm["cubin"]),
                   code=code_hash(k.asm["ptx"]))
    except Exception as e:  # noqa: BLE001 - the compiler's message is the report
        out.update(ok=False, error=f"{type(e).__name__}: {e}"[-3000:])
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def _compile_index(i: int) -> dict:
    return compile_spec(SPECS[i])


def report(jobs: int = 2, only: str | None = None) -> dict:
    modules, import_errors = package_modules()
    kernels = jit_kernels(modules)
    specs = [s for s in SPECS if not only or only in s.name or only in s.label]
    idx = [SPECS.index(s) for s in specs]
    t0 = time.perf_counter()
    if jobs > 1:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            results = list(pool.map(_compile_index, idx))
    else:
        results = [compile_spec(s) for s in specs]
    return dict(
        import_errors=import_errors,
        kernels={k: dict(entry=v["entry"], specs=sum(s.name == k for s in SPECS)) for k, v in kernels.items()},
        unlisted=unlisted(kernels, SPECS), hidden=hidden_kernels(modules),
        stale=sorted({s.name for s in SPECS} - set(kernels)),
        smem_limit=SMEM_LIMIT, results=results, compile_seconds=round(time.perf_counter() - t0, 1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=min(8, len(os.sched_getaffinity(0))))
    ap.add_argument("--only", help="compile only entries whose kernel or label contains this")
    args = ap.parse_args(argv)
    json.dump(report(args.jobs, args.only), sys.stdout, indent=1)


if __name__ == "__main__":
    main()
