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
# takes CPU from everything after it on 2 cores (an idle 8-rank pool with 75 threads per worker took
# 16-19 % of a core); it is closed before a test that does not use the pools.
LEAKY_POOL_THREADS = 24
# Tests that start training processes of their own run first, before any pool exists, so that no
# idle pool's polling threads share the 2 cores with their ranks.
OWN_PROCESSES = ("upstream", "slurm", "netns", "slow")


def _starts_its_own_processes(item: pytest.Item) -> bool:
    if "run_ranks" in getattr(item, "fixturenames", ()):
        return False
    return any(item.get_closest_marker(name) for name in OWN_PROCESSES)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not _starts_its_own_processes(item))  # stable: order kept otherwise


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "run_ranks" in getattr(item, "fixturenames", ()):
        return
    for size, pool in list(_pools.items()):
        if pool.threads() > LEAKY_POOL_THREADS:
            pool.close(graceful=False)  # a graceful exit tears the leaked groups down: seconds per rank
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
        pool.close(graceful=False)  # nothing is left to check; the leaked groups make an exit slow
    _pools.clear()
