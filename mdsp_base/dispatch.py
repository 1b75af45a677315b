"""Dispatch modes that follow a rank's work onto its helper threads.

torch's dispatch modes are per thread: work handed to another thread leaves them behind. A mode that
offers ``for_thread()`` (an emulated device's, a profiler's) gives a copy for the other thread to enter.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, TypeVar

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

T = TypeVar("T")


def modes_for_thread() -> list[Any]:
    """The calling thread's modes that follow work onto other threads, copied for another thread."""
    return [m.for_thread() for m in _get_current_dispatch_mode_stack() if hasattr(m, "for_thread")]


def entered(modes: list[Any], stack: ExitStack) -> None:
    """Enter ``modes`` (from :func:`modes_for_thread`) on this thread for the life of ``stack``."""
    for mode in modes:
        stack.enter_context(mode)


def carried(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` to run on another thread under the calling thread's modes that follow work (``fn``
    itself when there are none)."""
    modes = modes_for_thread()
    if not modes:
        return fn

    def under_modes(*args: Any, **kwargs: Any) -> T:
        with ExitStack() as stack:
            entered(modes, stack)
            return fn(*args, **kwargs)

    return under_modes
