"""Shared fixtures: ``run_ranks(world_size, fn, *args, timeout=...)`` runs ``fn`` on a gloo pool."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from multirank import WorkerPool  # noqa: E402

RunRanks = Callable[..., list[Any]]
# Worker pools by world size, kept between tests: starting one costs seconds of imports per rank.
_pools: dict[int, WorkerPool] = {}
# A ZeRO-3 engine is never freed (DeepSpeed keeps references to its model and hooks), so its gloo
# groups and their polling threads outlive the test that built it. A pool holding that many threads
# takes CPU from everything after it on 2 cores (DeepSpeed's CPU all-reduce spins, so runs using it
# slow down most); it is closed before a test that does not use the pools.
LEAKY_POOL_THREADS = 24


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "run_ranks" in getattr(item, "fixturenames", ()):
        return
    for size, pool in list(_pools.items()):
        if pool.threads() > LEAKY_POOL_THREADS:
            pool.close()
            del _pools[size]


@pytest.fixture(scope="session")
def run_ranks() -> Iterator[RunRanks]:
    def run(
        world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any
    ) -> list[Any]:
        pool = _pools.get(world_size)
        if pool is None or not pool.alive:
            pool = _pools[world_size] = WorkerPool(world_size)
        return pool.run(fn, *args, timeout=timeout, **kwargs)

    yield run
    for pool in _pools.values():
        pool.close()
    _pools.clear()
