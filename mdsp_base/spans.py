"""Timed spans of one process's work, for a step's trace: what ran on which thread, when.

While a :class:`SpanLog` is entered, code that knows what it is doing marks it
with :func:`span` (a block on the calling thread) or :func:`record` (an interval it timed itself,
such as a virtual device's op). With no log entered both cost one check, so the hot paths call them
unconditionally. Times are host ``time.perf_counter()`` seconds, the clock the virtual device and
the step timers use. Process-wide: one log at a time, the previous one put back on exit.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Span:
    """One interval of work."""

    name: str
    """What ran, for a reader of the trace (``all_gather inter_node``)."""
    category: str
    """What kind of time it is (``gather``, ``wait``, ``copy`` ...): the trace's summary sums by it."""
    thread: str
    """The thread it ran on (or a virtual device stream's name)."""
    start: float
    """``time.perf_counter()`` at its start."""
    end: float
    """``time.perf_counter()`` at its end."""
    args: dict[str, Any] = field(default_factory=dict)
    """Facts about it (``link``, ``bytes``, ``forward``): JSON values."""

    @property
    def seconds(self) -> float:
        return self.end - self.start


class SpanLog:
    """The spans recorded while entered, from every thread of the process."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def add(self, span: Span) -> None:
        with self._lock:
            self.spans.append(span)

    def __enter__(self) -> SpanLog:
        global _active
        self._previous, _active = _active, self
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        _active = self._previous


_active: SpanLog | None = None


def active() -> bool:
    """Whether a log is recording (callers skip work that only feeds a span)."""
    return _active is not None


def record(
    name: str, category: str, start: float, end: float, thread: str | None = None, **args: Any
) -> None:
    """An interval timed by the caller, on ``thread`` (default: the calling thread)."""
    log = _active
    if log is not None:
        log.add(Span(name, category, thread or threading.current_thread().name, start, end, args))


@contextlib.contextmanager
def _timed(log: SpanLog, name: str, category: str, args: dict[str, Any]) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        log.add(Span(name, category, threading.current_thread().name, start, time.perf_counter(), args))


def span(name: str, category: str, **args: Any) -> contextlib.AbstractContextManager[None]:
    """``with span(...):`` records the block on the calling thread (nothing when no log is on)."""
    log = _active
    if log is None:
        return contextlib.nullcontext()
    return _timed(log, name, category, args)
