"""Bytes held, read from torch's CPU allocator while a trace is open.

Two readings of one trace:

* :meth:`AllocationTrace.peak`: the calling thread's own bytes. The profiler records allocations and
  frees on the thread that opened it; the live total at a moment is what that thread allocated
  minus the frees of those addresses, and allocations made inside a collective are the backend's
  (gloo copies its inputs; NCCL allocates nothing of torch's) and left out. A tensor whose last
  reference a backend thread drops is freed unseen, so this reading can only run high; repeat it
  and take the least.
* :meth:`AllocationTrace.process_peak`: every thread's bytes. While the trace is open, c10's CPU
  memory reporter keeps the process's running total of what was allocated since it opened (its
  ``caffe2_report_cpu_memory_usage`` flag), frees on any thread included, and each recorded
  allocation carries that total. Backend buffers count here. A block allocated before the trace
  and freed inside it lowers the total, so the traced code should free nothing older than itself.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch
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
        self._flag.value = True  # every thread's allocations and frees into the running total
        self._profile.__enter__()
        # The running total also holds blocks of earlier traces that were freed unseen: the first
        # event, this byte's allocation, gives the level this trace starts from.
        self._marker = torch.empty(1, dtype=torch.uint8)
        self._marker_ptr = self._marker.data_ptr()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._profile.__exit__(kind, error, tb)
        self._flag.value = self._was
        del self._marker

    def peak(self, region: str | None = None) -> int:
        """Most bytes the calling thread held at once over the whole trace, or only while the
        ``record_function`` named ``region`` ran (what was live when it began counts)."""
        from torch._C._profiler import _EventType

        events = self._events()
        start, end = self._span(events, region)
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
            if peak is not None:
                peak = max(peak, live)
        return live if peak is None else peak

    def process_peak(self, region: str | None = None) -> int:
        """Most bytes the whole process held at once (of what it allocated since the trace opened),
        sampled at the calling thread's allocations, over the trace or the ``region``."""
        from torch._C._profiler import _EventType

        events = self._events()
        start, end = self._span(events, region)
        total, peak, base = 0, None, None
        for event in events:
            if event.typed[0] != _EventType.Allocation:
                continue
            if base is None:  # the marker: the level the trace starts from
                base = event.typed[1].total_allocated
                continue
            if end is not None and event.start_time_ns > end:
                break
            if peak is None and event.start_time_ns >= start:
                peak = total  # what the region began with
            total = event.typed[1].total_allocated - base
            if peak is not None:
                peak = max(peak, total)
        return total if peak is None else peak

    def _events(self) -> list[Any]:
        return sorted(_walk(self._profile.profiler.kineto_results.experimental_event_tree()), key=_start)

    @staticmethod
    def _span(events: list[Any], region: str | None) -> tuple[int, int | None]:
        if region is None:
            return 0, None
        spans = [e for e in events if e.name == region]
        if not spans:
            raise ValueError(f"no record_function({region!r}) ran inside the trace")
        return spans[-1].start_time_ns, spans[-1].end_time_ns


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
