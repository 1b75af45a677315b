"""How long a step waits for its parameters: the time spent in ZeRO-3's parameter fetch.

DeepSpeed's ``PartitionedParameterCoordinator.fetch_sub_module`` runs before every module's forward
and backward: it launches the module's all-gather unless a prefetch did, blocks until the parameters
are whole, then launches the next prefetches. Its wall time is what computation waited on gathers
(the part no prefetch hid) plus the launches, for stock ZeRO-3, hpZ and ours alike (ours runs under
the same coordinator). Process-wide: while a :class:`GatherWait` is entered, the coordinator's method
is wrapped; the original is put back on exit.
"""

from __future__ import annotations

import functools
import threading
import time
from types import TracebackType
from typing import Any


class GatherWait:
    """Context manager: ``seconds`` spent in parameter fetches and ``fetches`` counted while entered,
    and of those seconds the ones before forward passes (``forward_seconds``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.forward_seconds = 0.0
        self.fetches = 0
        self._lock = threading.Lock()  # backward hooks may run on autograd's threads
        self._original: Any = None

    def __enter__(self) -> GatherWait:
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C

        if getattr(C.fetch_sub_module, "_gather_wait", False):
            raise RuntimeError("a GatherWait is already timing parameter fetches: nest none")
        original = C.fetch_sub_module

        @functools.wraps(original)
        def timed(coordinator: Any, current_submodule: Any, forward: bool, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(coordinator, current_submodule, forward, *args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                with self._lock:
                    self.seconds += elapsed
                    self.forward_seconds += elapsed if forward else 0.0
                    self.fetches += 1

        timed._gather_wait = True  # type: ignore[attr-defined]
        self._original = original
        C.fetch_sub_module = timed
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C

        C.fetch_sub_module = self._original
        self._original = None
