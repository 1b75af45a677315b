"""Bytes held, read from torch's CPU allocator through the profiler's allocation events.

A trace records every allocation and free while it is open. The live total at a moment is what the
traced code allocated up to then minus its frees of those addresses; its peak is the most it held
at once. Allocations made inside a collective or on threads that issue none are the backend's
(gloo copies its inputs on its own threads; NCCL allocates nothing of torch's) and left out, so
a CPU figure stands for what the same code holds on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import TracebackType
from typing import Any

from torch.profiler import ProfilerActivity, profile


class AllocationTrace:
    """Open while the traced code runs; :meth:`peak` reads the result."""

    def __init__(self) -> None:
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self) -> AllocationTrace:
        self._profile.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._profile.__exit__(kind, error, tb)

    def peak(self, region: str | None = None) -> int:
        """Most bytes live at once over the whole trace, or only while the ``record_function``
        named ``region`` ran (what was live when it began counts)."""
        from torch._C._profiler import _EventType

        events = sorted(_walk(self._profile.profiler.kineto_results.experimental_event_tree()), key=_start)
        start, end = 0, None
        if region is not None:
            spans = [e for e in events if e.name == region]
            if not spans:
                raise ValueError(f"no record_function({region!r}) ran inside the trace")
            start, end = spans[-1].start_time_ns, spans[-1].end_time_ns
        issuers = {e.start_tid for e in events if e.name.startswith("c10d::")}
        ours: set[int] = set()
        live, peak = 0, None
        for event in events:
            if event.typed[0] != _EventType.Allocation:
                continue
            if end is not None and event.start_time_ns > end:
                break
            if peak is None and event.start_time_ns >= start:
                peak = live  # what the region began with
            alloc = event.typed[1]
            if alloc.alloc_size < 0:  # a free, on whichever thread: counted where it was allocated
                if alloc.ptr not in ours:
                    continue
                ours.discard(alloc.ptr)
            elif (issuers and event.start_tid not in issuers) or _inside_collective(event):
                continue
            else:
                ours.add(alloc.ptr)
            live += alloc.alloc_size
            if peak is not None:
                peak = max(peak, live)
        return live if peak is None else peak


def _start(event: Any) -> int:
    return event.start_time_ns


def _walk(events: list) -> Iterator[Any]:
    for event in events:
        yield event
        yield from _walk(event.children)


def _inside_collective(event: Any) -> bool:
    while event is not None:
        if event.name.startswith(("c10d::", "gloo:")):
            return True
        event = event.parent
    return False
