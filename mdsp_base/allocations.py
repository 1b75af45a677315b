"""Bytes held, read from torch's CPU allocator while a trace is open.

Two readings of one trace: :meth:`AllocationTrace.peak`, the calling thread's own bytes (a
collective's backend buffers left out; it can only run high, so repeat it and take the least), and
:meth:`AllocationTrace.process_peak`, every thread's bytes from c10's running total (the traced code
should free nothing older than itself). How each is read, and why: docs/hierarchical_zero.md,
"Memory, measured"."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

_REPORT_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


def _report_flag() -> ctypes.c_bool:
    library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    return ctypes.c_bool.in_dll(library, _REPORT_FLAG)


class AllocationTrace:
    """Open while the traced code runs; :meth:`peak` and :meth:`process_peak` read the result."""

    def __init__(self) -> None:
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._flag = _report_flag()
        self._was = self._flag.value

    def __enter__(self) -> AllocationTrace:
        self._profile.__enter__()
        self._flag.value = True  # every thread's allocations and frees into the running total
        # The running total also holds blocks of earlier traces that were freed unseen: the first
        # event, this byte's allocation, gives the level this trace starts from.
        self._marker = torch.empty(1, dtype=torch.uint8)
        self._marker_ptr = self._marker.data_ptr()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._flag.value = self._was
        self._profile.__exit__(kind, error, tb)
        del self._marker

    def peak(self, region: str | None = None) -> int:
        """Most bytes the calling thread held at once over the whole trace, or only while the
        ``record_function`` named ``region`` ran (what was live when it began counts)."""
        events = self._events()
        return _peak_over(self._own_levels(events), *self._span(events, region))

    def process_peak(self, region: str | None = None) -> int:
        """Most bytes the whole process held at once (of what it allocated since the trace opened),
        sampled at the calling thread's allocations, over the trace or the ``region``."""
        events = self._events()
        return _peak_over(self._process_levels(events), *self._span(events, region))

    def _own_levels(self, events: list[Any]) -> Iterator[tuple[int, int]]:
        """(time, bytes the calling thread holds) after each of its allocations and their frees."""
        issuers = {e.start_tid for e in events if e.name.startswith("c10d::")}
        ours: set[int] = set()
        live = 0
        for event in _allocations(events):
            alloc = event.typed[1]
            if alloc.ptr == self._marker_ptr:
                continue
            if alloc.alloc_size < 0:  # a free, on whichever thread: counted where it was allocated
                if alloc.ptr not in ours:
                    continue
                ours.discard(alloc.ptr)
            elif (issuers and event.start_tid not in issuers) or _inside_collective(event):
                continue
            else:
                ours.add(alloc.ptr)
            live += alloc.alloc_size
            yield event.start_time_ns, live

    @staticmethod
    def _process_levels(events: list[Any]) -> Iterator[tuple[int, int]]:
        """(time, the process's running total above the marker's) at each recorded allocation."""
        allocations = _allocations(events)
        base = next(allocations).typed[1].total_allocated  # the marker
        for event in allocations:
            yield event.start_time_ns, event.typed[1].total_allocated - base

    def _events(self) -> list[Any]:
        profiler = self._profile.profiler
        assert profiler is not None and profiler.kineto_results is not None  # read once the trace closed
        return sorted(_walk(profiler.kineto_results.experimental_event_tree()), key=_start)

    @staticmethod
    def _span(events: list[Any], region: str | None) -> tuple[int, int | None]:
        if region is None:
            return 0, None
        spans = [e for e in events if e.name == region]
        if not spans:
            raise ValueError(f"no record_function({region!r}) ran inside the trace")
        return spans[-1].start_time_ns, spans[-1].end_time_ns


def _peak_over(levels: Iterable[tuple[int, int]], start: int, end: int | None) -> int:
    """Most of ``levels`` ((time, bytes), in time order) between ``start`` and ``end`` (None: to the
    last), the level in force at ``start`` included."""
    before, peak = 0, None
    for time, level in levels:
        if end is not None and time > end:
            break
        if time < start:
            before = level
            continue
        peak = max(before if peak is None else peak, level)
    return before if peak is None else peak


def _allocations(events: list[Any]) -> Iterator[Any]:
    return (e for e in events if e.typed[0] == _EventType.Allocation)


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
