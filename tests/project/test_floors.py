"""Floors: each plugin imports the common base (``mdsp_base``) and itself, never another plugin nor
anything above the plugins (the configuration assembler, the Megatron glue, the main job). Every
module of a plugin must import in a fresh interpreter where those packages cannot be found. And no
module of the project imports itself through others: a loop between files is found by reading every
import statement, so it fails here before it forces an ``Any`` or a function-level import."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ABOVE = ["megatron_ext.integration", "megatron_ext.trainer", "megatron_ext.launch"]
ZERO = "deepspeed_ext.zero"
PLUGINS = {
    ZERO: ["megatron_ext", *ABOVE],
    "megatron_ext.data": ["deepspeed_ext", "megatron_ext.layers", *ABOVE],
    "megatron_ext.layers": ["deepspeed_ext", "megatron_ext.data", *ABOVE],
    # Inside hierarchical ZeRO: the cost model below the engine, the engine below the tools. The cost
    # model only computes, so the planning commands start without importing torch or DeepSpeed.
    f"{ZERO}.cost": [f"{ZERO}.engine", f"{ZERO}.tools", "megatron_ext", *ABOVE, "torch", "deepspeed"],
    f"{ZERO}.engine": [f"{ZERO}.tools", "megatron_ext", *ABOVE],
}
PROBE = """
import importlib, importlib.abc, pkgutil, sys
plugin, blocked = sys.argv[1], sys.argv[2:]

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in blocked):
            raise ImportError(f"{plugin} imports {name}, which is not its floor")
        return None

sys.meta_path.insert(0, Blocked())
package = importlib.import_module(plugin)
for module in pkgutil.walk_packages(package.__path__, plugin + "."):
    importlib.import_module(module.name)
print("imported", plugin, flush=True)
import os
os._exit(0)  # the check is done: skip the teardown of what it imported (see mdsp_base.shutdown)
"""


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[subprocess.Popen, Path]]]:
    """Every plugin's fresh interpreter, all started at once (each is one process bound by its
    imports: side by side they use every core), and the file its output goes to."""
    out = tmp_path_factory.mktemp("floors")
    runs = {}
    for plugin, blocked in PLUGINS.items():
        log = out / f"{plugin}.log"
        with open(log, "w") as f:
            argv = [sys.executable, "-c", PROBE, plugin, *blocked]
            runs[plugin] = (subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT), log)
    yield runs
    for run, _ in runs.values():
        run.kill()
        run.wait()


@pytest.mark.parametrize("plugin", sorted(PLUGINS))
def test_each_plugin_imports_with_only_the_base_and_itself(plugin, probes):
    run, log = probes[plugin]
    code = run.wait(timeout=300)
    output = log.read_text()
    assert code == 0, output[-3000:]
    assert f"imported {plugin}" in output


PACKAGES = ["mdsp_base", "deepspeed_ext", "megatron_ext", "multirank", "benchmarks"]


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(module: str, path: Path, modules: set[str]) -> set[str]:
    """The project modules ``module`` names in any import statement, at any depth (a function-level
    or TYPE_CHECKING import still ties the two files together for a reader)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from a import b`` names the module a.b when there is one, else a name inside a.
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        found.update(name for name in names if name in modules and name != module)
    return found


def import_graph() -> dict[str, set[str]]:
    """Every project module and the project modules it imports."""
    files = {_module_of(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    return {module: _imports(module, path, set(files)) for module, path in files.items()}


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for child in graph[node]:
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_loop_finder_finds_a_two_file_loop():
    assert loops({"a": {"b"}, "b": {"a", "c"}, "c": set()}) == [["a", "b"]]


def test_no_module_of_the_project_imports_itself_through_others():
    graph = import_graph()
    assert len(graph) > 150, "the reading found too few modules to be the project"
    assert loops(graph) == []
