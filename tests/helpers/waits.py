"""Waits on observable events (a condition that becomes true, a message on a multiprocessing
queue, a blocking call that returns), each failing loudly with what it waited for. Their bound is
a hang bound, far above how long the event takes: never a claim about speed."""

from __future__ import annotations

import contextlib
import queue as queue_module
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

HANG_S = 30.0  # how long a wait on an event may take before the test fails naming it


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = HANG_S) -> None:
    """Poll ``condition`` until true; fail naming ``what`` after ``timeout_s`` (a hang bound)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting for {what} after {timeout_s:.0f} s")
        time.sleep(0.005)


def receive(queue: Any, what: str, timeout_s: float = HANG_S) -> Any:
    """The next message on a multiprocessing queue; fail naming ``what`` when none comes."""
    try:
        return queue.get(timeout=timeout_s)
    except queue_module.Empty:
        raise AssertionError(f"no {what} within {timeout_s:.0f} s") from None


def first_error(queue: Any, who: str, timeout_s: float = HANG_S) -> str:
    """The message of the first ("error", message) a child reports, skipping its other reports."""
    while True:
        item = receive(queue, f"error from {who}", timeout_s)
        if item[0] == "error":
            return item[1]


@contextlib.contextmanager
def hang_guard(what: str, timeout_s: float = HANG_S) -> Iterator[None]:
    """Fail naming ``what`` when the block has not finished after ``timeout_s`` (a blocking call,
    such as opening a FIFO, is interrupted by SIGALRM; a pending alarm is put back after). Main
    thread only."""

    def hung(signum: int, frame: Any) -> None:
        raise AssertionError(f"{what} still running after {timeout_s:.0f} s")

    previous = signal.signal(signal.SIGALRM, hung)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:  # an alarm was pending (pytest-timeout's): it keeps what is left of its time
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3))
