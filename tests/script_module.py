"""A repository script (benchmarks/, scripts/) loaded as a module by its path, for the tests that call its
functions: those folders are not packages. Not registered in ``sys.modules``, so every call runs the file anew."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(path, name: str):
    """The module of ``path`` (relative to the repository root, or absolute) under the module name ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
