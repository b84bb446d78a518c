"""benchmarks/ (issue #30, "Benchmarks call public names only"): every script reaches thrifty through public names
(no underscore name of the library, imported names in the module's ``__all__`` where it has one); the map in
benchmarks/README.md lists every script; and CPU runs of attention_e2e.py's host section, whose instrumentation
moved to a public hook (``bench.stubbed_launches``), and of the two fixes (bitnet_packed_diag.py at 4 tokens,
neuzip_codec.py on pair-coded tensors). bitnet_profile.py (``bench.count_launches``), neuzip_models.py
(``model.neuzip.observe``) and shadowkv_needle_ablation.py have their own smoke tests."""

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from script_module import load_script

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))


def _load(name):
    return load_script(f"benchmarks/{name}.py", f"bench_{name}")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _submodule(module_name: str, name: str) -> bool:
    """True when ``module_name.name`` is a module (a package's submodule)."""
    if not hasattr(importlib.import_module(module_name), "__path__"):
        return False  # a plain module has no submodules
    try:
        importlib.import_module(f"{module_name}.{name}")
        return True
    except ImportError:
        return False


def _exported(module_name: str, name: str):
    """Why ``module_name.name`` is not a public name, or None when it is."""
    if _private(name):
        return "a private name"
    if name.startswith("__"):
        return None  # __file__, __version__: the module's own attributes
    if _submodule(module_name, name):
        return None  # its own names are checked where they are used
    module = importlib.import_module(module_name)
    exported = getattr(module, "__all__", None)
    if exported is not None and name not in exported:
        return f"not in {module_name}.__all__"
    return None


def _violations(path: Path) -> list:
    tree = ast.parse(path.read_text())
    modules = {}  # local name -> thrifty module it is bound to
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "thrifty":
                    if any(_private(part) for part in a.name.split(".")):
                        out.append((node.lineno, a.name, "a private module"))
                    modules[a.asname or a.name.split(".")[0]] = a.asname and a.name or "thrifty"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "thrifty":
            if any(_private(part) for part in node.module.split(".")):
                out.append((node.lineno, node.module, "a private module"))
                continue
            try:
                importlib.import_module(node.module)
            except ImportError:
                continue  # an older tree's module, imported under try (shadowkv.py's fallback)
            for a in node.names:
                why = _exported(node.module, a.name)
                if why:
                    out.append((node.lineno, f"{node.module}.{a.name}", why))
                elif _submodule(node.module, a.name):
                    modules[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            why = _exported(modules[node.value.id], node.attr)
            if why:
                out.append((node.lineno, f"{modules[node.value.id]}.{node.attr}", why))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
                root = root.func if isinstance(root, ast.Call) else root.value
            if not (isinstance(root, ast.Name) and root.id in ("self", "cls", "torch", "np")):
                # an underscore attribute of some object (a library object, transformers' config): not public
                out.append((node.lineno, ast.unparse(node), "a private attribute"))
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
            func = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if func in ("getattr", "setattr", "hasattr", "delattr", "object") and len(node.args) >= 2:
                arg = node.args[1]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _private(arg.value):
                    out.append((node.lineno, f"{func}(..., {arg.value!r})", "a private name by string"))
        elif isinstance(node, ast.Tuple):  # (module, "_NAME") pairs handed to getattr/setattr later
            strings = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            module_in = any(isinstance(e, ast.Name) and e.id in modules for e in node.elts) or any(
                v.split(".")[0] == "thrifty" for v in strings)
            for v in strings:
                if module_in and _private(v):
                    out.append((node.lineno, ast.unparse(node), "a private name by string"))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(
                r"thrifty(\.\w+)*\._\w+.*", node.value):
            out.append((node.lineno, node.value, "a private name by string"))
    return out


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_uses_public_thrifty_names(path):
    assert _violations(path) == []


def test_the_checker_catches_private_uses(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from thrifty.loss import cce\nfrom thrifty.bench import _spin_cycles\n"
                   "from thrifty.kv.decode_kernel import append_triton\n"
                   "cce._gemm_forward_scratch = None\nmodel.config._attn_implementation = 'x'\n"
                   "setattr(cce, '_x', 1)\nMOD = 'thrifty.neuzip.state._decode'\n"
                   "PATCH = {(cce, '_LAUNCH'): 1}\nPHASES = (('decode', 'thrifty.neuzip.state', 'C', '_decode'),)\n")
    found = {what for _, what, _ in _violations(bad)}
    assert found == {"thrifty.bench._spin_cycles", "thrifty.loss.cce._gemm_forward_scratch",
                     "model.config._attn_implementation", "setattr(..., '_x')", "thrifty.neuzip.state._decode",
                     "(cce, '_LAUNCH')", "('decode', 'thrifty.neuzip.state', 'C', '_decode')"}


def test_readme_maps_every_script():
    """Every benchmark script has a row in the README's map (a script's name in backquotes), and every script the
    map names exists."""
    text = (ROOT / "benchmarks" / "README.md").read_text()
    table = text.split("## Map", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(\w+\.(?:py|sh))", table))
    scripts = {p.name for p in BENCHMARKS} | {"run_on_gpu.sh"}
    assert scripts - named == set(), "not in benchmarks/README.md's map"
    assert named - scripts == set(), "in the map, but no such script"


def _env(**extra):
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", ""))
                                                        if p), **extra}


def test_attention_e2e_host_section_on_the_cpu(tmp_path):
    """attention_e2e.py's host section on the CPU times the host path with bench.stubbed_launches: its rows and keys."""
    env = _env(THRIFTY_RESULTS=str(tmp_path))
    env.pop("TRITON_INTERPRET", None)  # as on a CPU box without the interpreter: the stub turns the kernel path on
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_e2e.py"), "--smoke", "--sections",
                           "host"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(Path(proc.stdout.strip().splitlines()[-1]).read_text())
    calls = {r["call"]: r["us_per_call"] for r in doc["rows"]}
    assert set(calls) == {f"{name} (CPU, launches stubbed)" for name in
                          ("sage_attention", "hf_sage_attention", "decode_attention", "cache_append_fused")}
    assert all(0 < us < 1e5 for us in calls.values()), calls
    assert set(doc["summary"]) == {"host_python_us_per_call_cpu", "host_python_us_per_decode_call_cpu"}


def test_bitnet_packed_diag_at_2_tokens(capsys):
    """2 tokens of a narrow layer plan the decode GEMV (v3; no K split, no groups_per_split): the diagnosis prints its
    plan and checks the decode GEMV and the split-K GEMV beside it (it ended in a KeyError before, at 4 tokens,
    which now plan the tensor-core GEMM)."""
    from thrifty.triton_utils import kernels_available

    if not kernels_available("cpu"):
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it on a CPU machine)")
    diag = _load("bitnet_packed_diag")
    assert diag.main(["--small", "--tokens", "2", "--kinds", "int8"]) == 0
    out = capsys.readouterr().out
    assert "[int8 m=2] plan decode" in out and "int8      m=2    OK" in out
    labels = [label for label, cfg, asm in diag.variants(2, 96, 700, 132)]
    assert labels[:2] == ["planned", "planned"] and "gemv split-epilogue-kernel" in labels


def test_neuzip_codec_decodes_pair_coded_sets_as_single_symbols():
    """neuzip_codec.py's decode variants are the single-symbol kernels: a tensor compress codes in pair symbols
    (the smoke run's slice of the 11008 x 4096 init) is coded single-symbol for them, and decodes bit for bit
    (the smoke run ended in KeyError ('v3', 64) when every such decode failed its check)."""
    from thrifty.neuzip import compress
    from thrifty.neuzip.decode_kernel import decode_into
    from thrifty.triton_utils import kernels_available

    if not kernels_available("cpu"):
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it on a CPU machine)")
    codec = _load("neuzip_codec")
    x = codec.llama_init()["gate_proj_11008x4096"][:2]
    assert compress(x, steps=64).pairs  # why the benchmark asks for single symbols
    c = codec.single_symbol(x, 64)
    assert not c.pairs
    tables, s = codec.decode_tables(c, "cpu"), c.streams
    out = torch.zeros(x.numel(), dtype=torch.bfloat16)
    decode_into(s["words"], s["lane_units"], s["group_offsets"], s["raw"], tables["ref"], out, 7, steps=64,
                groups_per_prog=4, num_warps=4, kernel="v3", v3_table=tables["v3_16"], asm=False)
    assert torch.equal(out.view(torch.int16), x.reshape(-1).view(torch.int16))


def test_shadowkv_pools_needle_files_by_their_prompts(tmp_path):
    """shadowkv.py --needle-json A B: the summary's needle keys are the files' accuracies weighted by their prompts
    per method (a gap pools like the accuracies it is made of), each file is named with its commit and seed, and
    files of different reference budgets are refused."""
    skv = _load("shadowkv")

    def needle(name, trials, dense, shadowkv, quest_b256, budget=512, seed=0):
        doc = {"schema": 1, "name": "shadowkv_needle", "device": "test", "rows": [],
               "meta": {"commit": f"c{seed}"}, "extra": {"settings": {"seed": seed}},
               "summary": {"trials_per_method": trials, "needle_reference_budget": budget, "needle_acc_dense": dense,
                           "needle_acc_shadowkv": shadowkv, "needle_gap_vs_dense_points": 100 * (shadowkv - dense),
                           "needle_acc_quest_b256": quest_b256, "complete": True}}
        path = tmp_path / name
        path.write_text(json.dumps(doc))
        return str(path)

    a = needle("a.json", 420, 0.60, 0.62, 0.50, seed=0)
    b = needle("b.json", 140, 0.80, 0.70, 0.90, seed=1)
    pooled, sources = skv.pooled_needle([a, b])
    assert pooled["needle_acc_dense"] == pytest.approx((420 * 0.60 + 140 * 0.80) / 560)
    assert pooled["needle_acc_quest_b256"] == pytest.approx((420 * 0.50 + 140 * 0.90) / 560)
    assert pooled["needle_gap_vs_dense_points"] == pytest.approx(
        100 * (pooled["needle_acc_shadowkv"] - pooled["needle_acc_dense"]))
    assert pooled["needle_trials_per_method"] == 560 and "complete" not in pooled
    assert [(s["file"], s["commit"], s["seed"], s["trials_per_method"]) for s in sources] == [
        ("a.json", "c0", 0, 420), ("b.json", "c1", 1, 140)]
    assert skv.pooled_needle([]) == ({}, [])
    with pytest.raises(ValueError, match="needle-json"):
        skv.pooled_needle([a, needle("c.json", 420, 0.6, 0.6, 0.6, budget=1024)])
