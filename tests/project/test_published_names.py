"""The names users type or patched trees import stay where the docs give them, whatever the
package layout: the four commands run, and every module the patches import from the suite
exists (``megatron_ext.integration.upstream.megatron_lm`` / ``.megatron_deepspeed``: one set of
hooks, and the ``--spec`` attributes Megatron-LM reads by name)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("command", "usage"),
    [
        ("deepspeed_ext.zero.probe", "usage: python -m deepspeed_ext.zero.probe"),
        ("deepspeed_ext.zero.plan", "usage: python -m deepspeed_ext.zero.plan"),
        ("deepspeed_ext.zero.bench", "usage: python -m deepspeed_ext.zero.bench"),
        ("megatron_ext.launch", "usage: python -m megatron_ext.launch"),
    ],
)
def test_each_documented_command_runs_under_its_published_name(command, usage):
    done = subprocess.run(
        [sys.executable, "-m", command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(usage), done.stdout[:300]


PATCH_IMPORT = re.compile(r"^\+\s*from (megatron_ext[\w.]*) import (\w+)", re.MULTILINE)


@pytest.mark.parametrize("patch", sorted((ROOT / "patches").glob("*.patch")), ids=lambda p: p.name)
def test_the_modules_the_patches_import_exist(patch):
    imports = PATCH_IMPORT.findall(patch.read_text())
    assert imports, f"{patch.name} imports nothing from megatron_ext"
    for package, name in imports:
        assert importlib.import_module(f"{package}.{name}").__name__ == f"{package}.{name}"
