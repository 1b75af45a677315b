"""The names users type or patched trees import stay where the docs give them, whatever the
package layout: the four commands run, and ``megatron_ext.upstream.megatron_lm`` /
``.megatron_deepspeed`` are the integration's modules themselves (one set of hooks, and the
``--spec`` attributes Megatron-LM reads by name)."""

from __future__ import annotations

import importlib
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


@pytest.mark.parametrize("name", ["megatron_lm", "megatron_deepspeed"])
def test_the_module_names_patched_trees_import_are_the_integrations_modules(name):
    own = importlib.import_module(f"megatron_ext.integration.upstream.{name}")
    assert importlib.import_module(f"megatron_ext.upstream.{name}") is own
    # the patches' form: from megatron_ext.upstream import megatron_lm
    assert getattr(importlib.import_module("megatron_ext.upstream"), name) is own
