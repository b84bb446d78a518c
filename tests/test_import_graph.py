"""scripts/import_graph.py: the rooms, floors and cycles of the package, and no import cycle in src/thrifty."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("import_graph_under_test", ROOT / "scripts" / "import_graph.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
