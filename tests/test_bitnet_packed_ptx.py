"""The packed BitNet kernels' sm_90 PTX, on the CPU: what the interpreter cannot show (it runs a block as one
unit, never contracts a product into an FMA).

* ``_splitk_epilogue_kernel`` reads the split-K workspace and zeroes it; the compiler may give the zero store
  another layout than the load, so a ``bar.sync`` must separate every read from every zeroing store (else a warp
  zeroes sums another warp has not read: on the H200 tokens ≥ 2 came out as −Σx·s·α).
* with a bias, ``(y·α) + b`` must not become one ``fma`` (PyTorch rounds the product first); nor ``mean·β + ε``
  in the INT4 activation codes.
* the v3 decode GEMV at its 1-token plans (NOTES.md "Decode GEMV v3"): no spills, ≤ 128 registers (≥ 8 programs
  of 64 threads per SM), one dp4a per word and field, weights in 16-byte vectors — all of a one-chunk row's issued
  as plain loads, a longer row's through 16-byte cp.async two chunks ahead — and no FMA in the bias epilogue.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, re, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from thrifty.bitnet import packed_kernel as PK
    from thrifty.bitnet.reference import EPS

    def compiled(fn, ptrs, consts, opts):
        sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
        return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)

    def ptx(fn, ptrs, consts, opts):
        return compiled(fn, ptrs, consts, opts).asm["ptx"]

    def resources(kernel):  # registers and stack of the cubin, by the cuobjdump Triton bundles
        import os, subprocess, tempfile
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(kernel.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        os.unlink(f.name)
        found = re.search(r"REG:(\\d+) STACK:(\\d+)", text)
        return dict(reg=int(found[1]), stack=int(found[2])) if found else dict(error=text[-500:])

    out = {}
    epi = ptx(PK._splitk_epilogue_kernel, {"ws_ptr": "*i32", "sum_ptr": "*i32", "scale_ptr": "*fp32",
              "alpha_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*fp32"},
              dict(BLOCK_N=PK.EPILOGUE_TILE[0], BLOCK_M=PK.EPILOGUE_TILE[1], HAS_BIAS=True),
              dict(num_warps=4, num_stages=1))
    lines = [l.strip() for l in epi.splitlines()]
    loads = [i for i, l in enumerate(lines) if "ld.global" in l]
    stores = [i for i, l in enumerate(lines) if "st.global" in l]
    bars = [i for i, l in enumerate(lines) if l.startswith("bar.sync")]
    first_store = stores[0]  # the zeroing store precedes the output store
    out["epilogue_ws_loads_before_first_store"] = [i for i in loads if i < first_store][:2]
    out["epilogue_barrier_between"] = any(max(out["epilogue_ws_loads_before_first_store"] or [0]) < b < first_store
                                          for b in bars)
    out["epilogue_fma"] = sum("fma" in l for l in lines)
    for kind, code in PK.KINDS.items():
        act = ptx(PK._act_codes_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp32", "scale_ptr": "*fp32", "codes_ptr": "*i8",
                  "sum_ptr": "*i32", "beta_scale": "fp32", "norm_eps": "fp32"},
                  dict(KIND=code, HAS_NORM=False, KEY_SHIFT=16, KEY_BITS=15, BLOCK_D=4096, EPS_=EPS, PDL=True),
                  dict(num_warps=8, num_stages=3))
        out[f"act_{kind}_fma"] = sum("fma" in l for l in act.splitlines())
    for k in (4096, 11008):  # v3: one chunk per row (plain loads) and three (cp.async pipeline)
        cfg = PK.decode_plan(1, 4096, k)
        v3 = compiled(PK._decode_gemv_v3_kernel, {"codes_ptr": "*i32", "sum_ptr": "*i32", "scale_ptr": "*fp32",
                      "w_ptr": "*i32", "alpha_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*bf16"},
                      dict(BLOCK_N=cfg["BLOCK_N"], KW=cfg["KW"], STAGES=cfg["num_stages"], HAS_BIAS=True,
                           USE_ASM=True, PDL=True), dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
        lines = v3.asm["ptx"].splitlines()
        count = lambda text: sum(text in l for l in lines)
        out[f"v3_k{k}"] = dict(resources(v3), rows=cfg["BLOCK_N"], stages=cfg["num_stages"], dp4a=count("dp4a"),
                               weight_v4=count("ld.global.L1::evict_first.L2::cache_hint.v4.b32"),
                               weight_scalar=count("ld.global.L1::evict_first.L2::cache_hint.b32"),
                               codes_v4=count("ld.global.v4.b32"), cp_async=count("cp.async.cg.shared.global"),
                               cp_async_16=sum("cp.async.cg.shared.global" in l and "0x10" in l for l in lines),
                               fma=count("fma"))
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise AssertionError(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_split_k_epilogue_reads_the_whole_tile_before_zeroing_it(report):
    assert report["epilogue_ws_loads_before_first_store"], report
    assert report["epilogue_barrier_between"], report


def test_no_fma_where_pytorch_rounds_twice(report):
    assert report["epilogue_fma"] == 0, report
    for kind in ("int8", "int4", "topk_int8"):
        assert report[f"act_{kind}_fma"] == 0, (kind, report)


def test_decode_v3_loads_16_byte_vectors_without_spills_or_replication(report):
    for k in (4096, 11008):
        v3 = report[f"v3_k{k}"]
        assert "error" not in v3, v3
        assert v3["stack"] == 0 and v3["reg"] <= 128, v3  # no spill; >= 8 two-warp programs per SM
        assert v3["dp4a"] == 16 * v3["rows"], v3  # per thread: 4 words per row, 4 fields, nothing replicated
        assert v3["fma"] == 0 and v3["weight_scalar"] == 0, v3
        if v3["stages"] == 1:  # one chunk: every row's 16-byte vector and the 4 field vectors, plain loads
            assert v3["weight_v4"] == v3["rows"] and v3["codes_v4"] == 4 and v3["cp_async"] == 0, v3
        else:  # pipelined: 16-byte cp.async only, the first two chunks issued before the loop
            assert v3["weight_v4"] == 0 and v3["cp_async"] == v3["cp_async_16"] >= 2 * (v3["rows"] + 4), v3
