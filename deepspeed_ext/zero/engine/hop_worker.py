"""Asynchronous hops: work handles that complete when the hops do, as a flat collective's does.

Hops are several collectives plus a reordering copy, so they need an owner that runs them after
the call returns: on CPU a worker thread per engine (and a lane thread per group for pipelined
stages), on CUDA/ROCm the output device's current stream (a stream per group for stages); any
other device is refused. Every group sees one order of collectives on every rank. A failed
collective re-raises in ``wait``; waits are bounded by the process group's timeout. Details:
docs/hierarchical_zero_modules.md."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mdsp_base import comm, dispatch, spans


@dataclass(frozen=True)
class Stage:
    """One collective of a pipelined hop operation."""

    group: dist.ProcessGroup
    """The group its collective runs on: it runs on that group's lane, in the order asked for."""
    run: Callable[[], Any]
    """The collective; returns the tensor it made (kept alive until the operation is waited for)."""
    after: tuple[int, ...] = ()
    """Indices of earlier stages of the same operation whose output it needs."""


class _FutureHandle:
    """Work handle of hops running on worker threads: complete when every future is."""

    def __init__(self, *futures: Future) -> None:
        self._futures = futures

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        with spans.span("wait hops", "wait"):
            for future in self._futures:
                future.result()
        return True

    def is_completed(self) -> bool:
        return all(future.done() for future in self._futures)


class _EventHandle:
    """Work handle of hops queued on CUDA streams of ``device``."""

    def __init__(self, events: Sequence[Any], device: torch.device, keep: Any = None) -> None:
        self._events = events
        self._device = device
        self._keep = keep  # what the streams read and write, released once the caller waits

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        for event in self._events:
            torch.cuda.current_stream(self._device).wait_event(event)
        self._keep = None
        return True

    def is_completed(self) -> bool:
        return all(event.query() for event in self._events)


def _on_stream(device: torch.device) -> bool:
    """True for CUDA devices (stream path), False for the CPU (worker thread); refuses the rest."""
    if device.type == "cuda":
        return True
    if device.type == "cpu":
        return False
    raise ValueError(
        f"hierarchical ZeRO hops cannot run on {device.type!r} tensors: they run on 'cpu' (a worker "
        "thread) and 'cuda' (CUDA or ROCm streams) devices"
    )


class HopWorker:
    """Runs one engine's hop collectives after the call returns (see the module docstring)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lanes: dict[int, tuple[dist.ProcessGroup, ThreadPoolExecutor]] = {}
        self._last: dict[int, Future] = {}  # per lane, its latest stage
        self._fence: Future | None = None  # the latest whole operation
        self._streams: dict[tuple[int, torch.device], Any] = {}  # CUDA: a stream per (group, device)

    def submit(self, device: torch.device, fn: Callable[[], Any]) -> _FutureHandle | _EventHandle:
        """Start ``fn`` (collectives on this engine's groups, whose output lies on ``device``); the
        handle completes when it has run."""
        if _on_stream(device):
            with torch.no_grad():
                fn()
            return _record_event(device)
        return _FutureHandle(self._on_thread(fn))

    def run(self, device: torch.device, fn: Callable[[], Any]) -> Any:
        """``fn`` run in its turn among the submitted hops; returns its result."""
        if _on_stream(device):
            with torch.no_grad():
                return fn()
        future = self._on_thread(fn)
        with spans.span("wait hops", "wait"):
            return future.result()

    def submit_stages(self, device: torch.device, stages: Sequence[Stage]) -> _FutureHandle | _EventHandle:
        """Start a pipelined operation (stages listed so that each comes after those it needs); the
        handle completes when every stage has run."""
        if _on_stream(device):
            return self._on_streams(device, stages)
        futures: list[Future] = []
        for stage in stages:
            needs = [futures[i] for i in stage.after] + ([self._fence] if self._fence is not None else [])
            future = self._lane(stage.group).submit(_after, needs, _attributed(stage.run))
            self._last[id(stage.group)] = future
            futures.append(future)
        return _FutureHandle(*futures)

    def _on_streams(self, device: torch.device, stages: Sequence[Stage]) -> _EventHandle:
        ready = torch.cuda.current_stream(device).record_event()
        events: list[torch.cuda.Event] = []
        made: list[Any] = []
        for stage in stages:
            stream = self._streams.get((id(stage.group), device))
            if stream is None:
                stream = self._streams[(id(stage.group), device)] = torch.cuda.Stream(device)
            stream.wait_event(ready)
            for i in stage.after:
                stream.wait_event(events[i])
            with torch.cuda.stream(stream), torch.no_grad():
                made.append(stage.run())
            events.append(stream.record_event())
        return _EventHandle(events, device, keep=(stages, made))

    def _lane(self, group: dist.ProcessGroup) -> ThreadPoolExecutor:
        lane = self._lanes.get(id(group))
        if lane is None or lane[0] is not group:
            name = f"hierarchical-zero-hops-lane{len(self._lanes)}"
            lane = self._lanes[id(group)] = (group, ThreadPoolExecutor(1, thread_name_prefix=name))
        return lane[1]

    def _on_thread(self, fn: Callable[[], Any]) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hierarchical-zero-hops")
        # a whole operation waits for every stage asked for before it, and fences the later ones
        self._fence = self._pool.submit(_after, list(self._last.values()), _attributed(fn))
        self._last.clear()
        return self._fence

    def shutdown(self) -> None:
        """Finish what was submitted and stop the threads."""
        for executor in (*(lane for _, lane in self._lanes.values()), self._pool):
            if executor is not None:
                executor.shutdown(wait=True)
        self._pool, self._fence = None, None
        self._lanes.clear()
        self._last.clear()
        self._streams.clear()


def _record_event(device: torch.device) -> _EventHandle:
    return _EventHandle([torch.cuda.current_stream(device).record_event()], device)


def _after(needs: Sequence[Future], fn: Callable[[], Any]) -> Any:
    """Run ``fn`` once every future in ``needs`` is done (re-raising the first failure)."""
    for future in needs:
        future.result()
    return fn()


def _attributed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` without autograd, its bytes counted in the phase of the thread that asked for it, its
    wait to start and its run recorded as spans, under the asking thread's modes that follow work onto
    other threads (``mdsp_base.dispatch``)."""
    counter = comm.active_counter()
    phase = counter.current_phase if counter is not None else "other"
    modes = dispatch.modes_for_thread()
    asked = time.perf_counter()

    def attributed() -> Any:
        spans.record("hop queue", "queue", asked, time.perf_counter())  # behind what it runs after
        with torch.no_grad(), ExitStack() as stack, spans.span("hops", "hop"):
            dispatch.entered(modes, stack)
            if counter is None:
                return fn()
            with counter.phase(phase):
                return fn()

    return attributed
