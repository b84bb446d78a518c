"""The structure of ``src/thrifty`` as a newcomer reads it from its imports.

    python scripts/import_graph.py [--json] [--src DIR]

``--src`` measures another tree's ``src`` folder, e.g. an older commit's:
``git archive <sha> src | tar -x -C /tmp/old && python scripts/import_graph.py --src /tmp/old/src``.

A *room* is a subpackage of ``thrifty`` (``loss/``, ``neuzip/``, ...) or a top-level module (``cli.py``,
``bench.py``, ...); ``thrifty/__init__.py`` and ``__main__.py`` are the entrance, not rooms. A *floor* is a
room's height: rooms that import no other room are on floor 0, every other room sits one floor above the
highest room it imports (the rooms of an import cycle share a floor). Every import that runs counts, also
those inside functions (a lazy import still ties the two rooms together); those under ``if TYPE_CHECKING:``
do not (they never run). Imports a package's ``__init__`` runs implicitly
do not count (every submodule would otherwise import its whole package).

Prints rooms, floors, the import cycles between modules and between rooms, and the largest room by lines.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "thrifty"
ENTRANCE = {"__init__", "__main__"}


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (``pkg/__init__.py`` is ``pkg``)."""
    files = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    return files


def _is_package(name: str, files: dict[str, Path]) -> bool:
    return files[name].name == "__init__.py"


def _resolve(node: ast.ImportFrom, module: str, files: dict[str, Path]) -> str:
    """The absolute name ``from ... import`` refers to, relative levels resolved against ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if _is_package(module, files) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:``: annotation-only imports never run."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in ast.walk(child))
            continue
        yield node
        yield from _runtime_nodes(node)


def imports_of(module: str, files: dict[str, Path]) -> set[str]:
    """The package's own modules that ``module`` imports (``from pkg import sub`` imports the submodule only)."""
    found = set()
    for node in _runtime_nodes(ast.parse(files[module].read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node, module, files)
            for alias in node.names:  # a submodule, else a name the package (or module) itself defines
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in files else target)
    return {name for name in found if name in files and name != module}


def room_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ENTRANCE:
        return None
    return parts[1]


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components (iterative: no recursion limit on deep graphs)."""
    index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], [0]

    def visit(start):
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each node's floor: 0 when it imports nothing, else one above the highest thing it imports; the members
    of a cycle share the floor of the whole cycle."""
    component_of = {}
    for component in strongly_connected(graph):
        for node in component:
            component_of[node] = frozenset(component)
    height: dict[frozenset, int] = {}

    def height_of(component):  # the condensation is acyclic; its depth is the number of rooms at most
        if component not in height:
            below = {component_of[t] for n in component for t in graph[n]} - {component}
            height[component] = 1 + max(map(height_of, below)) if below else 0
        return height[component]

    return {node: height_of(component_of[node]) for node in graph}


def measure(root: Path = ROOT) -> dict:
    files = module_files(root)
    module_graph = {m: imports_of(m, files) for m in files}
    rooms = sorted({r for m in files if (r := room_of(m))})
    room_graph = {r: set() for r in rooms}
    lines = dict.fromkeys(rooms, 0)
    for module, targets in module_graph.items():
        room = room_of(module)
        if room is None:
            continue
        lines[room] += len(files[module].read_text().splitlines())
        room_graph[room].update(t for target in targets if (t := room_of(target)) not in (None, room))
    floor = floors(room_graph)
    largest = max(rooms, key=lines.get)
    return {
        "rooms": len(rooms),
        "floors": 1 + max(floor.values()),
        "floor_of_room": {r: floor[r] for r in sorted(rooms, key=lambda r: (floor[r], r))},
        "module_cycles": sorted(sorted(c) for c in strongly_connected(module_graph) if len(c) > 1),
        "room_cycles": sorted(sorted(c) for c in strongly_connected(room_graph) if len(c) > 1),
        "largest_room": {"room": largest, "lines": lines[largest], "share": lines[largest] / sum(lines.values())},
        "lines": sum(lines.values()),
    }


def report(m: dict) -> str:
    out = [f"rooms: {m['rooms']}  floors: {m['floors']}  lines: {m['lines']}",
           f"largest room: {m['largest_room']['room']} ({m['largest_room']['lines']} lines, "
           f"{m['largest_room']['share']:.0%})",
           f"module cycles: {len(m['module_cycles'])}"]
    out += [f"  {' <-> '.join(c)}" for c in m["module_cycles"]]
    out.append(f"room cycles: {len(m['room_cycles'])}")
    out += [f"  {' <-> '.join(c)}" for c in m["room_cycles"]]
    by_floor: dict[int, list[str]] = {}
    for room, level in m["floor_of_room"].items():
        by_floor.setdefault(level, []).append(room)
    out += [f"floor {level}: {', '.join(rooms)}" for level, rooms in sorted(by_floor.items(), reverse=True)]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the measures as JSON")
    ap.add_argument("--src", type=Path, default=ROOT, help="the folder that holds the thrifty package")
    args = ap.parse_args(argv)
    if not (args.src / PACKAGE / "__init__.py").is_file():
        ap.error(f"--src: {args.src} holds no {PACKAGE}/__init__.py")
    m = measure(args.src)
    print(json.dumps(m, indent=1) if args.json else report(m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
