"""scripts/import_graph.py: the rooms, floors and cycles of the package, and no import cycle in src/thrifty."""

from pathlib import Path

from script_module import load_script

def _load():
    return load_script("scripts/import_graph.py", "import_graph_under_test")


def _package(root: Path, files: dict) -> Path:
    for name, text in {"thrifty/__init__.py": "from . import top\n", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_measures_a_small_package(tmp_path):
    src = _package(tmp_path, {
        "thrifty/base.py": "X = 1\n",
        "thrifty/tech/__init__.py": "from .a import A\n",
        "thrifty/tech/a.py": "from ..base import X\nA = X\n",
        "thrifty/tech/b.py": "from . import a\ndef f():\n    from ..top import T\n",  # lazy: still counts
        "thrifty/top.py": "import thrifty.tech.a\nfrom typing import TYPE_CHECKING\n"
                          "if TYPE_CHECKING:\n    from .tech import b\nT = 2\n",
    })
    m = _load().measure(src)
    assert m["rooms"] == 3 and m["floors"] == 2  # base below the tech <-> top cycle
    assert m["floor_of_room"] == {"base": 0, "tech": 1, "top": 1}
    # tech.b -> top -> tech.a: a cycle between the rooms, none between modules
    assert m["room_cycles"] == [["tech", "top"]] and m["module_cycles"] == []
    assert m["largest_room"]["room"] == "tech" and m["largest_room"]["lines"] == 6


def test_type_checking_imports_do_not_count(tmp_path):
    src = _package(tmp_path, {
        "thrifty/top.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .low import L\n",
        "thrifty/low.py": "from .top import *\n",
    })
    m = _load().measure(src)
    assert m["module_cycles"] == [] and m["floor_of_room"] == {"top": 0, "low": 1}
    (src / "thrifty" / "top.py").write_text("from .low import L\n")
    assert _load().measure(src)["module_cycles"] == [["thrifty.low", "thrifty.top"]]


def test_src_thrifty_has_no_import_cycle():
    m = _load().measure()
    assert m["module_cycles"] == [] and m["room_cycles"] == [], (m["module_cycles"], m["room_cycles"])


# ------------------------------------------------------------------------------ techniques stay apart
# Each technique package is usable alone: it imports no other technique and not the CLI, neither directly nor
# through the shared modules it uses; thrifty.compose and thrifty.cli are where techniques meet.
TECHNIQUES = ("attention", "bitnet", "kvcache", "loss", "neuzip")
SHARED = ("kv", "layers", "fused_layers", "triton_utils", "_checks", "_io", "_graphs", "bench", "paths", "models")
# (importing module, package or module it reaches): a key covers every module under that name.
# Imports of rooms outside SHARED that the tree makes today, with the reason; followed like shared modules.
ALLOWED_EDGES = {
    ("thrifty.neuzip.convert", "thrifty.optim"): "compress_model(..., optimizer=LomoConfig) attaches fused LOMO",
    ("thrifty.models.llama", "thrifty.parallel"): "the reference model's vocab-parallel head "
                                                   "(run_with_gathered_head), lazy",
}
# Imports that break the rule today: shared modules that import a technique, so that every technique using
# them reaches it (kvcache and neuzip use the reference model). Not followed. Any edge not listed here fails.
KNOWN_VIOLATIONS = {
    ("thrifty.models.llama", "thrifty.bitnet"): "LlamaForCausalLM.from_pretrained / save_pretrained read and "
                                                "write BitNet checkpoints (recipe record, packed layers), lazy",
    ("thrifty.parallel.fsdp", "thrifty.loss"): "the gathered LM head runs thrifty.loss (reached through "
                                               "models.llama -> parallel)",
    ("thrifty.parallel.vocab_parallel", "thrifty.loss"): "vocab-parallel cross-entropy is built on the loss "
                                                         "kernels (reached the same way)",
}


def _listed(table: dict, module: str, target: str) -> bool:
    return any(module == src and (target == dst or target.startswith(dst + ".")) for src, dst in table)


def technique_edges(root: Path = None) -> dict[str, list[list[str]]]:
    """{technique: import chains that leave the allowed rooms}: each chain starts at a module of the
    technique and goes through shared modules (every runtime import: module level and inside functions,
    relative ones resolved; not those under ``if TYPE_CHECKING:``) to a module outside the technique and
    :data:`SHARED`: another technique, the CLI, compose, the package root (its lazy names lead to compose)."""
    graph_mod = _load()
    files = graph_mod.module_files(root or graph_mod.ROOT)
    imports = {m: graph_mod.imports_of(m, files) for m in files}
    found = {}
    for tech in TECHNIQUES:
        own = [m for m in files if graph_mod.room_of(m) == tech]
        parent = dict.fromkeys(own)
        todo, chains = list(own), []
        while todo:
            module = todo.pop()
            for target in sorted(imports[module]):
                if target in parent or _listed(KNOWN_VIOLATIONS, module, target):
                    continue
                parent[target] = module
                room = graph_mod.room_of(target)
                if room in (tech, graph_mod.room_of(module)) or room in SHARED or \
                        _listed(ALLOWED_EDGES, module, target):
                    todo.append(target)  # follow it: a shared module must not lead to another technique
                    continue
                chain = [target]
                while parent[chain[-1]] is not None:
                    chain.append(parent[chain[-1]])
                chains.append(chain[::-1])
        if chains:
            found[tech] = chains
    return found


def test_technique_packages_import_no_other_technique_nor_the_cli():
    found = technique_edges()
    assert found == {}, "\n".join(" -> ".join(c) for chains in found.values() for c in chains)
    graph_mod = _load()
    files = graph_mod.module_files()
    stale = [(src, dst) for src, dst in {**ALLOWED_EDGES, **KNOWN_VIOLATIONS}
             if src not in files or not any(_listed({(src, dst): ""}, src, target)
                                            for target in graph_mod.imports_of(src, files))]
    assert stale == [], f"imports listed above that are gone (delete their entries): {stale}"


def test_technique_check_sees_lazy_relative_and_indirect_imports(tmp_path):
    src = _package(tmp_path, {
        "thrifty/top.py": "",
        "thrifty/_checks.py": "",
        "thrifty/models/__init__.py": "def load():\n    from ..bitnet import recipes\n",
        "thrifty/bitnet/__init__.py": "",
        "thrifty/bitnet/recipes.py": "def g():\n    from .. import optimize\n",  # the root: leads to compose
        "thrifty/cli/__init__.py": "",
        "thrifty/loss/__init__.py": "from .. import _checks\n",  # shared: allowed
        "thrifty/loss/cce.py": "def f():\n    import thrifty.cli\n",  # lazy
        "thrifty/neuzip/__init__.py": "from ..models import load\n",  # bitnet through the reference model
        "thrifty/attention/__init__.py": "from . import sage\n",
        "thrifty/attention/sage.py": "from ..kvcache import x\n",
        "thrifty/kvcache/__init__.py": "x = 1\n",
        "thrifty/kvcache/hf.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..loss import cce\n",
    })
    found = technique_edges(src)
    assert found == {
        "attention": [["thrifty.attention.sage", "thrifty.kvcache"]],
        "bitnet": [["thrifty.bitnet.recipes", "thrifty"]],
        "loss": [["thrifty.loss.cce", "thrifty.cli"]],
        "neuzip": [["thrifty.neuzip", "thrifty.models", "thrifty.bitnet.recipes"]],  # (not followed further)
    }, found
