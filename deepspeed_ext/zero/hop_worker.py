"""Asynchronous hops: work handles that complete when the hops do.

A flat ZeRO-3 all-gather returns at once and DeepSpeed waits on its handle only when the parameters
are needed, which is what lets prefetching and ``overlap_comm`` hide it. Hops are several
collectives in sequence plus a reordering copy, so they need an owner that runs them after the
call returns:

* CPU tensors (gloo blocks the calling thread): one worker thread per engine runs every hop
  collective of that engine, gathers and reduce-scatters alike, in the order they were asked for.
  Every rank asks in the same order (DeepSpeed issues its collectives identically on all ranks), so
  the hop groups see the same sequence everywhere, as a communication stream would give them.
* CUDA tensors (ROCm reports "cuda" too): the collectives are queued on the current stream of the
  output tensor's device (DeepSpeed's all-gather stream), which is asynchronous already; the
  handle's ``wait`` makes that device's current stream wait for an event recorded after the hops, as
  NCCL/RCCL work handles do.
* Any other device type is refused with an error naming it: the hops have no owner for it.

A failed collective re-raises in ``wait``. Waits are bounded by the process group's timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from deepspeed_ext import comm


class _FutureHandle:
    """Work handle of hops running on the worker thread."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        self._future.result()
        return True

    def is_completed(self) -> bool:
        return self._future.done()


class _EventHandle:
    """Work handle of hops queued on a CUDA stream of ``device``."""

    def __init__(self, event: Any, device: torch.device) -> None:
        self._event = event
        self._device = device

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        torch.cuda.current_stream(self._device).wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return bool(self._event.query())


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

    def submit(self, device: torch.device, fn: Callable[[], Any]) -> _FutureHandle | _EventHandle:
        """Start ``fn`` (collectives on this engine's groups, whose output lies on ``device``); the
        handle completes when it has run."""
        if _on_stream(device):
            with torch.no_grad():
                fn()
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            return _EventHandle(event, device)
        return _FutureHandle(self._on_thread(fn))

    def run(self, device: torch.device, fn: Callable[[], Any]) -> Any:
        """``fn`` run in its turn among the submitted hops; returns its result."""
        if _on_stream(device):
            with torch.no_grad():
                return fn()
        return self._on_thread(fn).result()

    def _on_thread(self, fn: Callable[[], Any]) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hierarchical-zero-hops")
        counter = comm.active_counter()
        phase = counter.current_phase if counter is not None else "other"

        def attributed() -> Any:  # counted in the phase of the thread that asked
            with torch.no_grad():
                if counter is None:
                    return fn()
                with counter.phase(phase):
                    return fn()

        return self._pool.submit(attributed)

    def shutdown(self) -> None:
        """Finish what was submitted and stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
