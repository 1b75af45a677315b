"""The upstream runs' warm server: ranks forked from one interpreter that has imported what both
trees' ``pretrain_gpt.py`` import from the installation, launched with torchrun's variables.

What they import is discovered by each tree's ``pretrain_gpt.py --help`` through the launcher, and
kept beside the trees (``warm-imports.json``) for the same trees, Python and installed packages (a
fresh clone's new environment of the same versions finds it): the --help runs take seconds of both
cores, and their answer changes only with those. With the list kept, the server starts as the
session starts (:mod:`tests.helpers.early`); the upstream tests take it as ``upstream_warm``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from multirank.warm import WarmLauncher
from tests.helpers.early import start_early
from tests.helpers.upstream import TARBALLS, Tree, prepared, tool_env

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = "upstream_warm"
# torch and DeepSpeed first, so that the --help runs, forked after them, import only the rest
PRELOAD = ["torch", "deepspeed"]


def rank_env() -> dict[str, str]:
    """What an upstream rank starts from: the tools' environment, DeepSpeed on CPU, this project
    first on the path, and every thread's Python stack printed when a signal kills it."""
    return {**tool_env(), "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"}


def _installed() -> str:
    """A digest of this interpreter's installed distributions, names and versions (each once: a
    checkout with the project's egg-info on the path lists the project twice, one without once)."""
    from importlib.metadata import distributions

    names = sorted({f"{d.metadata['Name']}=={d.version}" for d in distributions()})
    return hashlib.sha256("\n".join(names).encode()).hexdigest()


def _help_runs(trees: dict[str, Tree]) -> list[list[str]]:
    return [
        ["-m", "megatron_ext.launch", str(trees[kind].pristine / "pretrain_gpt.py"), "--help"]
        for kind in TARBALLS
    ]


def _kept(trees: dict[str, Tree]) -> tuple[Path, dict[str, object]]:
    """Where the list is kept, and what it is kept for: the --help runs, Python, the packages."""
    key = {"preload": PRELOAD, "discover": _help_runs(trees), "python": sys.version, "packages": _installed()}
    return trees["megatron-lm"].pristine.parent / "warm-imports.json", key


def kept_launcher(trees: dict[str, Tree]) -> WarmLauncher | None:
    """A server preloading the kept list, if one was kept for these trees, Python and packages."""
    path, key = _kept(trees)
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: discovered and written again
        return None
    if found.get("key") != key:
        return None
    return WarmLauncher(rank_env(), preload=PRELOAD + found["modules"])


def launcher(trees: dict[str, Tree], cwd: Path) -> WarmLauncher:
    """:func:`kept_launcher`, or a server that discovers the list (the --help runs in ``cwd``) and
    keeps it."""
    kept = kept_launcher(trees)
    if kept is not None:
        return kept
    path, key = _kept(trees)
    discovering = WarmLauncher(rank_env(), preload=PRELOAD, discover=_help_runs(trees), cwd=cwd)
    partial = path.with_suffix(f".{os.getpid()}")
    partial.write_text(json.dumps({"key": key, "modules": discovering.discovered}))
    partial.replace(path)  # whole or not at all, whichever session writes last
    return discovering


def pytest_sessionstart(session: pytest.Session) -> None:
    def make() -> WarmLauncher | None:
        trees = prepared()  # never built here: a session that must build them starts its server later
        return None if trees is None else kept_launcher(trees)

    start_early(session.config, FIXTURE, make)
