"""The node loader where the ranks of a node run in PID namespaces of their own.

Containers that share /dev/shm (``docker --ipc=host``, one rank per container) give each rank a PID
namespace of its own: every rank may be pid 1, and a pid read in one namespace names another process,
or none, in the next. Whether the node's first rank (the segment's creator), its producer or a rank is
alive must therefore be something the kernel answers alike in every namespace, never pid and start
time. What this asks of the loader:

1. the clean-up at a start never removes a live segment whose creator runs in another PID namespace,
   and still removes it once that creator is dead (with a creator in the test's own namespace as
   the control);
2. a job whose ranks each run in a PID namespace of their own trains with the loader on and prints,
   iteration for iteration, the losses of the loader off (the same job in one namespace: the control);
3. when something of one rank dies (the whole rank, or the first rank's producer), the ranks of the
   other namespace stop within seconds with an error that names the failure, not after the loader's
   timeout, here 600 s.

Every process in a PID namespace of its own is started as ``unshare --pid --fork --mount-proc
--kill-child <python> ...``: pid 1 of a new PID namespace, with a /proc of its own, dying with the
``unshare`` process; the tests skip where that is not permitted (it needs root). The controls' jobs,
in this namespace, fork their ranks warm (``main_job_warm``). The other ranks start cold, without
torchrun, with the variables the main job reads (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), a tenth of a second apart as separate containers start (ranks started
within one clock tick share a start time, which would hide a check by pid and start time). Every
wait is bounded: on a hang both process trees are killed and the test fails with their output."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from multirank import free_port
from multirank.warm import WarmLauncher
from tests.helpers.main_job import SCRIPT, SMALL, job_env
from tests.helpers.waits import HANG_S, wait_for

UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
ITERATIONS = 3
JOB_S = 240.0  # hang bound of one job (a cold start imports torch, DeepSpeed and megatron-core on 2 cores)
STOP_S = 30.0  # how soon the other ranks must stop after a failure (the loader's timeout is 600 s)
LAUNCH_GAP_S = 0.1
NAMESPACES = pytest.mark.parametrize(
    "own_namespaces", [True, False], ids=["a PID namespace per rank", "one PID namespace"]
)


@functools.cache
def _unshare_refusal() -> str | None:
    """Why this machine cannot start a process in a PID namespace of its own; None when it can."""
    try:
        probe = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        return "unshare (util-linux) is not installed"
    if probe.returncode:
        return f"`{' '.join(UNSHARE)}` is not permitted here (it needs root): {probe.stderr.strip()}"
    return None


def _need_namespaces(own_namespaces: bool = True) -> None:
    if own_namespaces and (reason := _unshare_refusal()):
        pytest.skip(reason)


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A private directory of this user under /dev/shm (mode 0700, so the loader's parent-directory
    check accepts it): the tests' segments, and nothing else's, are in it."""
    path = tempfile.mkdtemp(prefix="namespaces-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


class Process:
    """A command in a PID namespace of its own (or, for the controls, in this one), its output in
    ``log``. ``pid`` is the command's own process as this namespace numbers it (inside the new
    namespace it is pid 1)."""

    def __init__(self, argv: list[str], log: str, own_namespace: bool, env: dict[str, str]) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.popen = subprocess.Popen(
                (UNSHARE if own_namespace else []) + argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=os.path.dirname(log),
                start_new_session=True,
            )
        self.pid = self.popen.pid
        if own_namespace:
            wait_for(
                lambda: bool(_children(self.popen.pid)) or self.popen.poll() is not None,
                f"the process unshare starts for {argv[:2]}",
            )
            self.pid = next(iter(_children(self.popen.pid)), self.pid)

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def tail(self, chars: int = 4000) -> str:
        return self.output()[-chars:]

    def kill(self) -> None:
        """SIGKILL the command and everything it started; returns once all of it is gone. In its own
        namespace the command's process is pid 1 there: its death takes every process of the
        namespace, and unshare exits only once it has reaped it (so unshare is left to exit by
        itself: killed alongside, it could be reaped while the namespace still dies)."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(HANG_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # whatever of its session is left
        except ProcessLookupError:
            pass
        self.popen.wait()


# -- 1. the clean-up at a start --------------------------------------------------------------------
def hold_a_live_segment(path: str) -> None:
    """A creator: make the segment at ``path``, say "ready", then live (holding what create_segment
    returned, unclosed) until killed. Run in a child process."""
    from megatron_ext.data.shm.ring import RingLayout
    from megatron_ext.data.shm.segment import create_segment

    layout = RingLayout(slots=2, streams=1, micro_batch_size=1, seq_length=8, consumers=1)
    _held = create_segment(path, layout.size, layout.header(os.getpid()))  # referenced until the process dies
    print("ready", flush=True)
    while True:
        signal.pause()


@NAMESPACES
def test_a_live_segment_of_another_pid_namespace_is_kept_and_a_dead_ones_removed(
    own_namespaces, shm_dir, tmp_path
):
    _need_namespaces(own_namespaces)
    from megatron_ext.data.shm.segment import remove_stale_segments, segment_path

    path = segment_path(shm_dir, "namespaces", 0)
    creator = Process(
        [
            sys.executable,
            "-c",
            "import sys; from tests.megatron_ext.data.shm import test_namespaces as t; t.hold_a_live_segment(sys.argv[1])",
            path,
        ],
        str(tmp_path / "creator.log"),
        own_namespaces,
        job_env(),
    )
    try:
        wait_for(
            lambda: "ready" in creator.output() or creator.popen.poll() is not None,
            "the creator's segment",
        )
        assert creator.popen.poll() is None, f"the creator failed:\n{creator.tail()}"
        where = "as pid 1 of another PID namespace" if own_namespaces else "in this PID namespace"

        removed = remove_stale_segments(shm_dir)
        assert os.path.isdir(path) and path not in removed, (
            f"a start's clean-up removed the live segment {path} of a creator that runs {where} "
            f"(pid {creator.pid} here), as if that creator were dead"
        )
    finally:
        creator.kill()

    removed = remove_stale_segments(shm_dir)
    assert path in removed and not os.path.exists(path), (
        f"the segment {path} of a creator that ran {where} and was killed is still there after a "
        f"start's clean-up (removed: {removed})"
    )


# -- the main job, one process per rank ------------------------------------------------------------


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> str:
    """The jobs' generated corpus and index caches, made by the first job and read by the others."""
    return str(tmp_path_factory.mktemp("namespaces-data"))


def _start_job(where, data_cache: str, iterations: int, flags: list[str]) -> list[Process]:
    """Two ranks of the main job (TP=1 x DP=2, one node), each its own process, rank 0 first; their
    logs and rank 0's JSON-lines log (``losses.jsonl``) in ``where``."""
    port = str(free_port())
    ranks: list[Process] = []
    try:
        for rank in range(2):
            env = job_env(
                RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            )
            argv = [sys.executable, *_job_argv(where, data_cache, iterations, flags)]
            ranks.append(Process(argv, str(where / f"rank{rank}.log"), True, env))
            time.sleep(LAUNCH_GAP_S)
    except BaseException:
        for started in ranks:
            started.kill()
        raise
    return ranks


def _job_argv(where: Path, data_cache: str, iterations: int, flags: list[str]) -> list[str]:
    return [
        SCRIPT,
        *SMALL,
        "--train-iters",
        str(iterations),
        "--data-cache-path",
        data_cache,
        "--log-json",
        str(where / "losses.jsonl"),
        *flags,
    ]


def _tails(ranks: list[Process]) -> str:
    return "".join(f"\n--- rank {r} (exit {p.popen.poll()}) ---\n{p.tail()}" for r, p in enumerate(ranks))


def _kill_and_fail(ranks: list[Process], message: str) -> None:
    for p in ranks:
        p.kill()
    pytest.fail(message + _tails(ranks))


def _wait_all(ranks: list[Process], timeout_s: float, what: str) -> float:
    """Wait for every rank's exit, at most ``timeout_s``; once one has failed, the others get
    STOP_S. Returns the seconds the last one took after the first failure (0 when none failed);
    kills them all and fails with their output when they take longer."""
    start, failed_at = time.monotonic(), None
    while any(p.popen.poll() is None for p in ranks):
        now = time.monotonic()
        if failed_at is None and any(p.popen.poll() not in (None, 0) for p in ranks):
            failed_at = now
        if now - start > timeout_s:
            _kill_and_fail(ranks, f"{what}: still running after {timeout_s:.0f} s; killed")
        if failed_at is not None and now - failed_at > STOP_S:
            failed = [r for r, p in enumerate(ranks) if p.popen.poll() not in (None, 0)]
            running = [r for r, p in enumerate(ranks) if p.popen.poll() is None]
            _kill_and_fail(
                ranks,
                f"{what}: rank(s) {failed} failed and rank(s) {running} still ran {now - failed_at:.0f} s "
                f"later (the loader's timeout is longer); killed",
            )
        time.sleep(0.05)
    return 0.0 if failed_at is None else time.monotonic() - failed_at


def _train(where: Path, data_cache: str, flags: list[str], warm: WarmLauncher | None) -> dict[int, float]:
    """Rank 0's losses of the job, its ranks in PID namespaces of their own (started cold, as
    containers start) or, for the controls, forked by ``warm`` in this namespace."""
    where.mkdir()
    what = f"the job ({' '.join(flags) or 'loader off'})"
    if warm is None:
        ranks = _start_job(where, data_cache, ITERATIONS, flags)
        _wait_all(ranks, JOB_S, what)
        failed = [r for r, p in enumerate(ranks) if p.popen.returncode != 0]
        assert not failed, f"{what}: rank(s) {failed} failed:{_tails(ranks)}"
    else:
        log = where / "ranks.log"
        codes = warm.launch(
            _job_argv(where, data_cache, ITERATIONS, flags), where, log, 1, 2, free_port(), JOB_S
        )
        assert codes == [0, 0], f"{what}: exit codes {codes}:\n{log.read_text(errors='replace')[-4000:]}"
    with open(where / "losses.jsonl") as f:
        return {r["iteration"]: r["loss"] for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def losses_loader_off(tmp_path_factory, data_cache, main_job_warm) -> dict[int, float]:
    """The reference: the same job on Megatron's own data path, its ranks in this namespace."""
    return _train(tmp_path_factory.mktemp("loader-off") / "job", data_cache, [], main_job_warm)


# -- 2. training ---------------------------------------------------------------------------------
@pytest.mark.slow
@NAMESPACES
def test_ranks_in_pid_namespaces_of_their_own_train_with_the_loader_as_without_it(
    own_namespaces, shm_dir, tmp_path, data_cache, losses_loader_off, main_job_warm
):
    _need_namespaces(own_namespaces)
    flags = ["--shm-data-loader", "--shm-data-loader-dir", shm_dir]
    on = _train(tmp_path / "on", data_cache, flags, None if own_namespaces else main_job_warm)
    assert sorted(on) == list(range(1, ITERATIONS + 1)), on
    assert on == losses_loader_off, f"losses with the loader {on}, without {losses_loader_off}"
    assert os.listdir(shm_dir) == [], "the loader left files behind after a clean exit"


# -- 3. failures -----------------------------------------------------------------------------------
def _producer_of(rank: Process) -> int:
    """The producer the node's first rank forked (its one child running the rank's own command)."""
    forks = [c for c in _children(rank.pid) if _cmdline(c) == _cmdline(rank.pid)]
    assert len(forks) == 1, (
        f"rank 0 (pid {rank.pid}) has forked children {forks}, expected its producer alone"
    )
    return forks[0]


RANK_KILLED, PRODUCER_KILLED = "rank 1 killed", "the producer of rank 0 killed"
# What the ranks that stop may say: a dead peer in a collective, or the loader's word for a dead rank or
# producer; never the loader's timeout ("nothing after N s") nor any other.
PEER_FAILURE = r"died|Connection (reset|closed) by peer"
PRODUCER_FAILURE = r"producer .*died"
# A rank of another namespace may instead see the first rank close the ring as it stops on that death.
PRODUCER_OR_CLOSE = r"producer .*died|first rank of this node closed the loader"
TIMEOUT = r"nothing after \d+ s|[Tt]imed out|TimeoutError"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "failures"),
    [
        # SIGKILL to rank 1's process, pid 1 of its namespace: all of that namespace dies.
        (RANK_KILLED, {0: PEER_FAILURE}),
        # SIGKILL to rank 0's producer alone: rank 1, in another namespace, must notice it too.
        (PRODUCER_KILLED, {0: PRODUCER_FAILURE, 1: PRODUCER_OR_CLOSE}),
    ],
    ids=["rank 1 killed", "producer killed"],
)
def test_a_death_in_one_namespace_stops_the_other_ranks_within_seconds(
    fault, failures, shm_dir, tmp_path, data_cache
):
    survivors = sorted(failures)
    _need_namespaces()
    flags = ["--shm-data-loader", "--shm-data-loader-dir", shm_dir, "--shm-data-loader-timeout", "600"]
    ranks = _start_job(tmp_path, data_cache, 5000, flags)  # 5000 iterations: far more than it runs
    try:
        wait_for(
            # Megatron's iteration line pads the count: "iteration        1/    5000"
            lambda: (
                re.search(r"iteration\s+1/", ranks[0].output()) is not None
                or any(p.popen.poll() is not None for p in ranks)
            ),
            "rank 0's first iteration",
            JOB_S,
        )
        if any(p.popen.poll() is not None for p in ranks):
            _kill_and_fail(ranks, "a rank stopped before the first iteration was logged")
        if fault == RANK_KILLED:
            ranks[1].kill()
        else:
            os.kill(_producer_of(ranks[0]), signal.SIGKILL)
        start = time.monotonic()
        _wait_all([ranks[r] for r in survivors], STOP_S, f"after {fault}, rank(s) {survivors}")
        took = time.monotonic() - start
        print(f"rank(s) {survivors} stopped {took:.1f} s after {fault}")  # shown by pytest -rP
    except AssertionError as e:
        _kill_and_fail(ranks, str(e))
    finally:
        for p in ranks:
            p.kill()

    for r, failure in failures.items():
        out, code = ranks[r].output(), ranks[r].popen.returncode
        assert code != 0, f"rank {r} exited with 0 after {fault}:{_tails(ranks)}"
        last = "\n".join(out.strip().splitlines()[-3:])
        assert re.search(failure, out) and not re.search(TIMEOUT, out), (
            f"rank {r} stopped {took:.1f} s after {fault}, but its error does not name that failure "
            f"(/{failure}/) or names a timeout: ...{last}"
        )
