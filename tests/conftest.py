"""Shared fixtures: ``run_ranks(world_size, fn, *args, timeout=...)`` runs ``fn`` on a gloo pool.

The tests mirror the packages (``tests/deepspeed_ext/zero/engine/`` tests ``deepspeed_ext.zero.engine``);
what several of them share lives in :mod:`tests.helpers`."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from multirank import WorkerPool  # noqa: E402
from tests.helpers.early import starts_early  # noqa: E402
from tests.helpers.fork_server import start_fork_server  # noqa: E402

# Fixtures that live with their helpers: ``slurm`` (skips without a responding cluster),
# ``main_job_warm`` and ``upstream_warm`` (ranks forked warm; their servers start as the session
# starts: ``early``) and ``ab_quick`` (the A/B command's quick run, started in the background as the
# tests start).
pytest_plugins = [
    "tests.helpers.early",
    "tests.helpers.slurm",
    "tests.helpers.main_job",
    "tests.helpers.upstream_warm",
    "tests.helpers.ab_quick",
]

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


def pytest_sessionstart(session: pytest.Session) -> None:
    """The pools' fork server imports while the tests are collected (``tests.helpers.early``)."""
    if starts_early(session.config):
        start_fork_server()


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


@pytest.fixture
def own_ranks() -> Iterator[RunRanks]:
    """``run_ranks`` on a pool of this test's own, closed after it: for a test that leaves its
    ranks' groups broken (a timed-out peer), so that the shared pools stay usable whatever runs next."""
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
        pool.close(graceful=False)


@pytest.fixture
def forked() -> Iterator[Callable[..., Any]]:
    """``forked(target, *args)`` starts ``target(*args)`` in a child forked from the test; whatever
    of them still runs once the test is over is killed, so that a failing test leaves none behind
    (and a child may wait for its end as long as it likes)."""
    import multiprocessing as mp

    context = mp.get_context("fork")
    children = []

    def start(target: Callable[..., Any], *args: Any) -> Any:
        child = context.Process(target=target, args=args)
        child.start()
        children.append(child)
        return child

    yield start
    for child in children:
        if child.is_alive():
            child.kill()
        child.join()


# -- the shared-memory loader's data --------------------------------------------------------------
@pytest.fixture(scope="session")
def gpt_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(prefix, index cache) of a 60-document corpus: 428 samples of helpers.shm.SEQ tokens, so
    that one epoch is short and resumes cross epoch boundaries. The cache is built here, once,
    before any rank reads it (the mask settings are not part of its key: every variant shares it)."""
    from megatron_ext.trainer.corpus import synthetic_documents, write_indexed_dataset
    from tests.helpers.shm import gpt_dataset

    root = tmp_path_factory.mktemp("gpt-corpus")
    prefix, cache = str(root / "corpus"), str(root / "cache")
    write_indexed_dataset(prefix, synthetic_documents(60))
    assert len(gpt_dataset(prefix, cache)) == 428
    return prefix, cache


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(prefix, index cache) of a 40-document corpus, its training split's cache built here, once."""
    from megatron_ext.trainer.corpus import build_train_dataset, synthetic_documents, write_indexed_dataset
    from tests.helpers.shm import SEQ

    root = tmp_path_factory.mktemp("small-corpus")
    prefix, cache = str(root / "corpus"), str(root / "cache")
    write_indexed_dataset(prefix, synthetic_documents(40))
    build_train_dataset(prefix, SEQ, 10, 1234, cache)
    return prefix, cache


@pytest.fixture(scope="session")
def shm_dataset(small_corpus: tuple[str, str]) -> Any:
    """The training split of ``small_corpus`` (sequences of helpers.shm.SEQ tokens)."""
    from megatron_ext.trainer.corpus import build_train_dataset
    from tests.helpers.shm import SEQ

    prefix, cache = small_corpus
    return build_train_dataset(prefix, SEQ, 10, 1234, cache)


@pytest.fixture
def shm_path() -> Iterator[str]:
    """A fresh segment path in /dev/shm; the test fails if anything of it is left behind."""
    import glob
    import uuid

    from megatron_ext.data.shm.segment import segment_path

    path = segment_path("/dev/shm", f"test{uuid.uuid4().hex[:8]}", 0)
    yield path
    assert glob.glob(path + "*") == [], "a segment was left behind"


# -- attacks on it by another local user (root only) -----------------------------------------------
@pytest.fixture(scope="session")
def users() -> Iterator[dict[str, tuple[int, int]]]:
    """uid and gid of the attacker and of a non-root victim (helpers.shm.ATTACKER, VICTIM); created
    here when absent, and removed again after the session."""
    import pwd
    import subprocess

    from tests.helpers.shm import ATTACKER, VICTIM

    made, ids = [], {}
    for name in (ATTACKER, VICTIM):
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            cmd = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name]
            done = subprocess.run(cmd, capture_output=True, text=True)
            try:
                pw = pwd.getpwnam(name)  # a concurrent run may have made it first
            except KeyError:
                pytest.fail(f"useradd {name} failed: {done.stderr}")
            if done.returncode == 0:
                made.append(name)
        ids[name] = (pw.pw_uid, pw.pw_gid)
    yield ids
    for name in made:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A fresh directory like /dev/shm (root's, mode 1777), so planted files stay out of the real one."""
    import shutil
    import uuid

    path = f"/dev/shm/shmsec-{uuid.uuid4().hex[:8]}"
    os.mkdir(path)
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def lone_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    """This process as a job of one rank: no launcher's variables, the test's directory as the
    working directory (returned)."""
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_NTASKS",
        "SLURM_PROCID",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path
