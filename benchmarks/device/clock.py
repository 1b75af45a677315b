"""A rank's virtual device: one clock per stream, the host running ahead of it.

An op issued at host time ``t`` on a stream starts at ``max(t, the stream's end, its inputs'
ready time)`` and ends its charged duration later; the host does not wait. It waits only at a sync
point (:meth:`VirtualDevice.wait_until`), sleeping until the virtual device gets there, as a GPU's
host blocks on an event. Times are host ``time.perf_counter()`` seconds, so real transfers over the
emulated links and virtual compute share one time line; while a span log records
(:mod:`mdsp_base.spans`), each op is a ``device`` span on its stream's track.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.device.tables import DeviceTable
from mdsp_base import spans


@dataclass
class DeviceStats:
    """What the device was charged, for the run's report."""

    ops: int = 0
    """Ops charged."""
    busy_s: float = 0.0
    """Charged device seconds (dilated and slowed by contention) over every stream."""
    contended_ops: int = 0
    """Ops issued while a collective was in flight."""
    waited_s: float = 0.0
    """Host seconds spent sleeping at sync points."""
    by_kind: dict[str, float] = field(default_factory=dict)
    """Charged seconds per kind: matmul, attention, memory."""


class VirtualDevice:
    """The virtual device of one rank: streams (one per issuing thread), collectives in flight."""

    def __init__(self, table: DeviceTable, dilation: float = 1.0, contention: float = 0.0) -> None:
        if dilation <= 0:
            raise ValueError(f"dilation={dilation} must be > 0 (1 runs the device at its own speed)")
        if not 0 <= contention < 1:
            raise ValueError(f"contention={contention} must be in [0, 1): the share compute slows by")
        self.table = table
        self.dilation = dilation
        """Device durations are multiplied by it (the links are divided by it elsewhere)."""
        self.contention = contention
        """Device ops issued while a collective is in flight take ``1 + contention`` times longer."""
        self.stats = DeviceStats()
        self._ends: dict[int, float] = {}
        self._in_flight: list[Any] = []
        self._lock = threading.Lock()

    def charge(self, seconds: float, after: float, kind: str) -> float:
        """Queue ``seconds`` of undilated device work on the calling thread's stream, starting no
        earlier than ``after``; returns when it ends (host clock)."""
        duration = max(seconds, self.table.kernel_floor_us * 1e-6) * self.dilation
        contended = self.contention > 0 and self._collective_in_flight()
        if contended:
            duration *= 1 + self.contention
        stream = threading.get_ident()
        with self._lock:
            start = max(time.perf_counter(), self._ends.get(stream, 0.0), after)
            end = self._ends[stream] = start + duration
            self.stats.ops += 1
            self.stats.busy_s += duration
            self.stats.contended_ops += contended
            self.stats.by_kind[kind] = self.stats.by_kind.get(kind, 0.0) + duration
            lane = list(self._ends).index(stream)
        spans.record(kind, "device", start, end, f"virtual device stream {lane}")
        return end

    def wait_until(self, when: float) -> None:
        """Block the host until the virtual device reaches ``when`` (a sync point)."""
        now = time.perf_counter()
        delay = when - now
        if delay > 0:
            time.sleep(delay)
            spans.record("wait for device", "device wait", now, time.perf_counter())
            with self._lock:
                self.stats.waited_s += delay

    def synchronize(self) -> None:
        """Block until every stream is idle (the step's end, ``torch.cuda.synchronize``). What the
        step sent has arrived by then, so no collective is in flight after it: a send whose handle
        nobody waited on reports itself incomplete for ever, and would slow the next steps' compute."""
        with self._lock:
            last = max(self._ends.values(), default=0.0)
        self.wait_until(last)
        with self._lock:
            self._in_flight.clear()

    def collective_started(self, work: Any) -> None:
        """Note an asynchronous collective's work handle: compute slows while it runs."""
        if self.contention > 0 and work is not None:
            with self._lock:
                self._in_flight.append(work)

    def _collective_in_flight(self) -> bool:
        with self._lock:
            self._in_flight = [w for w in self._in_flight if not w.is_completed()]
            return bool(self._in_flight)
