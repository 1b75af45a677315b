"""Floors: each plugin imports the common base (``mdsp_base``) and itself, never another plugin nor
anything above the plugins (the configuration assembler, the Megatron glue, the main job). Every
module of a plugin must import in a fresh interpreter where those packages cannot be found."""

from __future__ import annotations

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
