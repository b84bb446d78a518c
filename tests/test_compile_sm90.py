"""Every Triton kernel in src/ compiles for the H100 (sm_90), on the CPU: what the interpreter cannot show.

The compile runs in a subprocess without TRITON_INTERPRET (in this process the kernels were jitted for the
interpreter at import, and the kernel modules chose their interpreter configs); ``tests/sm90_kernels.py`` holds
the table of kernels × launch variants and prints a JSON report. Not marked ``cuda``: CI runs it on the CPU.
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
SCRIPT = ROOT / "tests" / "sm90_kernels.py"


def _clean_env(extra_path: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(ROOT / "src"), *([extra_path] if extra_path else []), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def _run(args: list, extra_path: str | None = None, timeout: int = 900) -> dict:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=_clean_env(extra_path), capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr[-5000:]}")
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def report():
    return _run([str(SCRIPT)])


def test_every_module_imports(report):
    assert not report["import_errors"], report["import_errors"]


def test_every_entry_kernel_has_a_compile_entry(report):
    assert report["kernels"], "the scanner found no @triton.jit kernel in thrifty"
    assert not report["unlisted"], (
        "new kernel with no compile entry in tests/sm90_kernels.py (add an entry() per launch variant): "
        + ", ".join(report["unlisted"]))
    assert not report["hidden"], ("@triton.jit functions that are not module-level objects (the scanner cannot "
                                  "see them; define them at module level): " + ", ".join(report["hidden"]))
    assert not report["stale"], "compile entries for kernels that no longer exist: " + ", ".join(report["stale"])


def test_every_entry_compiles_for_sm90(report):
    limit = report["smem_limit"]
    bad = []
    for r in report["results"]:
        if not r["ok"]:
            bad.append(f"{r['kernel']} [{r['label']}] {r['options']}: {r['error']}")
        elif r["shared"] > limit:
            bad.append(f"{r['kernel']} [{r['label']}] {r['options']}: {r['shared']} B of shared memory > {limit}")
    assert report["results"]
    assert not bad, f"{len(bad)} of {len(report['results'])} compile entries fail on sm_90:\n\n" + "\n\n".join(bad)


def test_gluon_kernel_does_not_spill(report):
    """Every launch variant of the Gluon attention kernel fits its registers (a stack frame is spilled
    registers: 128-row, 128-key tiles at D=64 run at the 240 registers setmaxnreg gives each consumer)."""
    rows = [r for r in report["results"] if r["kernel"].endswith("gluon_kernel:_sage_fwd_gluon_kernel") and r["ok"]]
    assert rows
    spilled = [f"[{r['label']}]: {r['stack']} B of stack" for r in rows if r["stack"]]
    assert not spilled, "\n".join(spilled)


@pytest.mark.parametrize("kernel", ["_grad_tile_gluon_kernel", "_lse_gluon_kernel"])
def test_gluon_tile_kernel_does_not_spill(report, kernel):
    """Every listed variant of the CCE Gluon kernels (the backward's gradient tiles, the forward's LSE) fits its
    registers (the consumers' 240 from setmaxnreg hold the 128-register accumulator and the epilogue; a
    softcapped 128x128 gradient tile in one pass spilled)."""
    rows = [r for r in report["results"] if r["kernel"].endswith(f"gluon_tile:{kernel}") and r["ok"]]
    assert rows
    spilled = [f"[{r['label']}]: {r['stack']} B of stack" for r in rows if r["stack"]]
    assert not spilled, "\n".join(spilled)


def test_scanner_flags_a_kernel_without_an_entry(tmp_path):
    """A module with an entry kernel, the device helper it calls and an unlisted kernel: the same scanner
    the real test uses must name exactly the unlisted one. And the compile step fails where the GPU would, on
    a plain module global read in a kernel (which the interpreter accepts)."""
    (tmp_path / "tiny_kernels.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.jit
        def _helper(x):
            return x * 2

        @triton.jit
        def listed_kernel(x_ptr, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, _helper(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)

        @triton.jit
        def forgotten_kernel(x_ptr, BLOCK: tl.constexpr):
            tl.store(x_ptr + tl.arange(0, BLOCK), 0.0)

        NEG = -1.0e30

        @triton.jit
        def global_kernel(x_ptr, BLOCK: tl.constexpr):
            tl.store(x_ptr + tl.arange(0, BLOCK), tl.full((BLOCK,), NEG, tl.float32))
    """))
    check = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, "tests")
        import sm90_kernels as S
        import tiny_kernels as T
        kernels = S.jit_kernels([T])
        specs = [S.entry(k, "only", dict(BLOCK=128), {"x_ptr": "*fp32"}) for k in (T.listed_kernel, T.global_kernel)]
        ok, bad = map(S.compile_spec, specs)
        print(json.dumps(dict(entry={k: v["entry"] for k, v in kernels.items()},
                              unlisted=S.unlisted(kernels, specs), ok=ok["ok"], bad=bad.get("error", ""))))
    """)
    out = _run(["-c", check], extra_path=str(tmp_path))
    assert out["entry"] == {"tiny_kernels:_helper": False, "tiny_kernels:forgotten_kernel": True,
                            "tiny_kernels:global_kernel": True, "tiny_kernels:listed_kernel": True}
    assert out["unlisted"] == ["tiny_kernels:forgotten_kernel"]
    assert out["ok"]
    assert "Cannot access global variable NEG" in out["bad"]
