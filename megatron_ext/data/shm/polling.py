"""The loader's one way to wait on another process: poll, with a growing sleep, and check that the
other side is alive every ~50 ms."""

from __future__ import annotations

import time
from collections.abc import Callable

from megatron_ext.data.shm.ring import RingError


def wait_until(
    ready: Callable[[], bool],
    check: Callable[[], None],
    timeout_s: float | None,
    what: str,
    max_sleep_s: float,
) -> float:
    """Poll ``ready`` until true; ``check`` (which raises on a dead or failed peer) runs every
    ~50 ms. Returns the seconds waited; raises :class:`RingError` after ``timeout_s``. None: no
    clock limit, for a wait that ``check`` bounds by the life of the processes it waits for."""
    if ready():
        return 0.0
    start = time.monotonic()
    next_check = start
    sleep = 20e-6
    while True:
        now = time.monotonic()
        if now >= next_check:
            try:
                check()
            except Exception:
                # The peer may have published what we wait for and then left (the first rank
                # reads its last batch and closes): what it wrote before leaving still counts.
                if ready():
                    return time.monotonic() - start
                raise
            next_check = now + 0.05
        if ready():
            return time.monotonic() - start
        if timeout_s is not None and now - start > timeout_s:
            raise RingError(
                f"{what}: nothing after {timeout_s:.0f} s (shm_data_loader.timeout_s); the peer is alive but stuck, "
                "or a pause (checkpoint save, evaluation) lasts longer than the timeout: raise timeout_s"
            )
        time.sleep(sleep)
        sleep = min(sleep * 2, max_sleep_s)
