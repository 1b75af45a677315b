"""No import circle among the benchmarks and the A/B tool, imports inside functions included (a
circle broken only by a deferred import still ties the two modules together); and no standing
benchmark imports a one-off study."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("benchmarks", "deepspeed_ext/zero/tools")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[name] = path
    return out


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules ``path`` imports anywhere in it (``from package import module`` too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found & known.keys()


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(path, known) - {name} for name, path in known.items()}


def _circle_through(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A path of imports from ``start`` back to itself, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        name, path = stack.pop()
        for imported in graph[name]:
            if imported == start:
                return [*path, start]
            if imported not in seen:
                seen.add(imported)
                stack.append((imported, [*path, imported]))
    return None


def test_no_module_imports_itself_through_others():
    graph = _graph()
    circles = [circle for name in sorted(graph) if (circle := _circle_through(name, graph))]
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_standing_benchmarks_import_no_study():
    graph = _graph()
    standing = [name for name in graph if name.startswith("benchmarks.") and ".studies" not in name]
    leaks = {name: sorted(i for i in graph[name] if i.startswith("benchmarks.studies")) for name in standing}
    assert not {name: studies for name, studies in leaks.items() if studies}
