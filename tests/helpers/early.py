"""Servers started as a whole-suite session starts, while its tests are collected.

Collection runs in the pytest process alone, so one of the two cores idles while it imports the test
modules (~10 s); a warm server's imports (torch, DeepSpeed, Megatron: ~6 s of one core each) fit in
that time instead of holding up the first test that needs the server. A fixture takes its server
with :func:`take`; a server whose fixture no selected test uses is stopped as collection ends. The
gloo pools' fork server starts the same way (``tests/conftest.py``) and lives until the session ends.

Only a session of the whole suite starts them (``pytest`` alone, or with the tests' directory, and
no ``-m`` or ``-k``): a smaller one would mostly pay for imports it never uses.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from multirank.warm import WarmLauncher

TESTS = Path(__file__).resolve().parents[1]
_EARLY = pytest.StashKey[dict[str, WarmLauncher]]()


def starts_early(config: pytest.Config) -> bool:
    """Whether this session runs the whole suite, unfiltered (so it starts servers as it starts)."""
    if config.option.collectonly or config.option.markexpr or config.option.keyword:
        return False
    paths = {(config.invocation_params.dir / arg.split("::")[0]).resolve() for arg in config.args}
    return TESTS in paths or TESTS.parent in paths


def start_early(config: pytest.Config, fixture: str, make: Callable[[], WarmLauncher | None]) -> None:
    """Start ``make()`` (None: nothing to start) for the fixture ``fixture``, if :func:`starts_early`."""
    if not starts_early(config):
        return
    launcher = make()
    if launcher is not None:
        config.stash.setdefault(_EARLY, {})[fixture] = launcher


def take(config: pytest.Config, fixture: str, make: Callable[[], WarmLauncher]) -> WarmLauncher:
    """The server started early for ``fixture``, or ``make()`` now."""
    early = config.stash.get(_EARLY, {}).pop(fixture, None)
    return early if early is not None else make()


def pytest_collection_finish(session: pytest.Session) -> None:
    early = session.config.stash.get(_EARLY, {})
    for fixture in list(early):
        if not any(fixture in getattr(item, "fixturenames", ()) for item in session.items):
            early.pop(fixture).close()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Servers no fixture took (the session stopped before their tests)."""
    early = session.config.stash.get(_EARLY, {})
    while early:
        early.popitem()[1].close()
