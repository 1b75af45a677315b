"""The one owner of process-wide changes.

A plugin that changes something beyond its own objects (a library's function swapped, a thread or
process started, an environment variable, ``sys.path``, a logger, a process group) makes the change
through an :class:`Installer`, which records who made it and what it is, and undoes every change
in reverse order when it closes. The main job holds one for its whole run; the upstream launcher
holds one around the upstream script, and the upstream hooks add to it, so an upstream run also
ends with its engines destroyed, its patches undone and its threads stopped.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")
_ABSENT = object()


@dataclass(frozen=True)
class Change:
    """One process-wide change, as the installer lists it."""

    owner: str
    """The module that made it."""
    what: str
    """What it changes, in one line."""


class Installer:
    """Process-wide changes, undone in reverse order by :meth:`close` (or leaving the ``with``)."""

    def __init__(self) -> None:
        self._undo: list[tuple[Change, Callable[[], Any]]] = []
        self.closed = False
        """True once every change has been undone."""

    @property
    def changes(self) -> list[Change]:
        """The changes in force, oldest first."""
        return [change for change, _ in self._undo]

    def add(self, owner: str, what: str, undo: Callable[[], Any]) -> None:
        """Record a change already made; ``undo`` reverses it."""
        if self.closed:
            raise RuntimeError(f"{owner}: {what} made after the installer closed: nothing would undo it")
        self._undo.append((Change(owner, what), undo))

    def enter(self, owner: str, what: str, manager: contextlib.AbstractContextManager[T]) -> T:
        """Enter ``manager`` now and leave it when the installer closes; returns what it gives."""
        stack = contextlib.ExitStack()
        value = stack.enter_context(manager)
        self.add(owner, what, stack.close)
        return value

    def setattr(self, owner: str, what: str, target: Any, name: str, value: Any) -> None:
        """``target.name = value`` until the installer closes (then the old value, or none)."""
        before = target.__dict__.get(name, _ABSENT) if hasattr(target, "__dict__") else getattr(target, name)

        def restore() -> None:
            if before is _ABSENT:
                delattr(target, name)
            else:
                setattr(target, name, before)

        setattr(target, name, value)
        self.add(owner, what, restore)

    def setenv(self, owner: str, what: str, name: str, value: str) -> None:
        """Environment variable ``name`` set to ``value`` until the installer closes (then its old
        value, or unset)."""
        before = os.environ.get(name)

        def restore() -> None:
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before

        os.environ[name] = value
        self.add(owner, what, restore)

    def close(self) -> None:
        """Undo every change, newest first. Every undo runs even when one fails; the first
        failure is raised afterwards (the others are logged)."""
        failures: list[BaseException] = []
        while self._undo:
            change, undo = self._undo.pop()
            try:
                undo()
            except BaseException as exc:  # the remaining undos must still run
                logger.error("undoing %s's change (%s) failed: %r", change.owner, change.what, exc)
                failures.append(exc)
        self.closed = True
        if failures:
            raise failures[0]

    def __enter__(self) -> Installer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
