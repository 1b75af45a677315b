"""The worker pools' fork server, started as the session starts.

:class:`multirank.WorkerPool` forks its ranks from one server that has imported ``multirank.pool``'s
``PRELOAD`` once. Starting it ahead of the first pool lets those imports run while the tests are
collected; the first pool's workers then wait for it instead of paying for them."""

from __future__ import annotations

from multiprocessing import forkserver

import multirank.pool  # noqa: F401  (sets the fork server's preload list before it starts)


def start_fork_server() -> None:
    """Start the pools' fork server now, ahead of the first pool; it imports in the background."""
    forkserver.ensure_running()
