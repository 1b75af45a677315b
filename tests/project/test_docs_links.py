"""What the README and the docs name exists: every repository path (in backticks or a link) and
every ``python -m`` module they tell a user to run."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "benchmarks" / "results").glob("*.md")),
]
TOP = tuple(p.name + "/" for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")) + (
    "setup.py",
    "megatron_ext/integration/plugin_config.py",
    "pyproject.toml",
    "README.md",
)
PATH = re.compile(r"`([A-Za-z_][\w./-]*)`|\]\(([^)#\s]+)\)")
MODULE = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")
NOT_OURS = {"torch.distributed.run", "pytest", "pip", "venv", "benchmarks.run_all"}


def _paths(text: str, page: Path) -> set[Path]:
    out = set()
    for backticked, linked in PATH.findall(text):
        if linked:
            if "://" not in linked:
                out.add((page.parent / linked).resolve())
        elif backticked.startswith(TOP) and "<" not in backticked and "*" not in backticked:
            out.add(ROOT / backticked.split("::")[0])
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_page_names_exists(page: Path) -> None:
    missing = sorted(str(p) for p in _paths(page.read_text(), page) if not p.exists())
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_a_page_runs_exists(page: Path) -> None:
    modules = set(MODULE.findall(page.read_text())) - NOT_OURS
    missing = sorted(m for m in modules if importlib.util.find_spec(m.split(".")[0]) is None or _absent(m))
    assert not missing, f"{page.relative_to(ROOT)} runs modules that do not exist: {missing}"


def _absent(module: str) -> bool:
    """Without importing it (a module may import torch or start a job): its file or package."""
    parts = module.split(".")
    base = ROOT.joinpath(*parts)
    if base.with_suffix(".py").exists() or (base / "__init__.py").exists() or (base / "__main__.py").exists():
        return False
    if (ROOT / parts[0]).is_dir() or (ROOT / parts[0]).with_suffix(".py").exists():
        return True  # one of ours, and neither its file nor its package is there
    return importlib.util.find_spec(parts[0]) is None


def test_every_docs_page_is_linked_from_another_page() -> None:
    """Each page under docs/ is reachable: the README or another page links to it."""
    docs = sorted((ROOT / "docs").glob("*.md"))
    linked: set[Path] = set()
    for page in (ROOT / "README.md", *docs):
        for target in re.findall(r"\]\(([^)#\s]+)", page.read_text()):
            path = (page.parent / target).resolve()
            if path != page.resolve():
                linked.add(path)
    unlinked = sorted(str(p.relative_to(ROOT)) for p in docs if p.resolve() not in linked)
    assert not unlinked, f"pages no other page links to: {unlinked}"
