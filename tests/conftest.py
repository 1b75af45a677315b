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


@pytest.fixture(scope="session")
def run_ranks() -> Iterator[RunRanks]:
    pools: dict[int, WorkerPool] = {}

    def run(
        world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any
    ) -> list[Any]:
        pool = pools.get(world_size)
        if pool is None or not pool.alive:
            pool = pools[world_size] = WorkerPool(world_size)
        return pool.run(fn, *args, timeout=timeout, **kwargs)

    yield run
    for pool in pools.values():
        pool.close()
