"""One process per local rank of a command, over 127.0.0.1, each rank's result handed back in a file.

The launcher sets torch.distributed's variables (``env://`` rendezvous on a free port) and a result
file per rank; a rank calls :func:`write_result` once, and :func:`launch_ranks` returns the values in
rank order. The emulated cluster (``benchmarks.cluster.EmulatedCluster``) uses the same protocol, so
a rank script runs unchanged under either.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULT_ENV = "EMU_RESULT_FILE"
_PR_SET_PDEATHSIG = 1
# Slurm's per-task variables: a rank started inside a Slurm step would take its task id from them
# over RANK (megatron-core and DeepSpeed both look), so every local rank would think it is task 0.
SLURM_TASK_VARS = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE")


class RankError(RuntimeError):
    """A rank failed: it raised, exited non-zero or died."""


def rank_env(rank: int, world_size: int, ranks_per_node: int | None = None, **extra: str) -> dict[str, str]:
    """The whole environment of local rank ``rank``: this process's, without Slurm's task variables,
    with torch.distributed's set (master on 127.0.0.1), one OpenMP thread, and ``extra`` on top.

    Args:
        rank (int): the rank.
        world_size (int): ranks in all.
        ranks_per_node (int, optional): ranks per emulated node (for ``LOCAL_RANK``); None: all.
        **extra: further variables, set last.

    Returns:
        dict[str, str]: the environment.
    """
    per_node = ranks_per_node or world_size
    env = {k: v for k, v in os.environ.items() if k not in SLURM_TASK_VARS}
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        MASTER_ADDR="127.0.0.1",
        # One core per rank is all a small host has; torch would otherwise start a thread per core.
        OMP_NUM_THREADS="1",
        **extra,
    )
    return env


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``): a launcher
    killed outright (SIGKILL, OOM) takes its ranks with it instead of leaving them blocked in gloo."""
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def write_result(result: object) -> None:
    """From inside a rank: store this rank's result for the launcher to return.

    Args:
        result: anything ``json.dumps`` takes.
    """
    path = Path(os.environ[RESULT_ENV])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)  # atomic, so a rank killed mid-write never leaves half a result


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS has just handed out, not one that another job on the
    machine may hold (a fixed or pid-derived port collides by chance)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(
    argv: Sequence[str],
    world_size: int,
    timeout: float,
    env: Mapping[str, str] | None = None,
    ranks_per_node: int | None = None,
    cpus: set[int] | None = None,
) -> list[Any]:
    """Run ``python *argv`` once per rank from the repository root.

    Args:
        argv (Sequence[str]): the command after ``python``.
        world_size (int): ranks to start.
        timeout (float): seconds the run may take.
        env (Mapping[str, str], optional): variables on top of each rank's :func:`rank_env`.
        ranks_per_node (int, optional): ranks per emulated node; None: all on one.
        cpus (set[int], optional): the CPUs every rank is pinned to.

    Returns:
        list: every rank's :func:`write_result` value, in rank order.

    Raises:
        RankError: a rank exited non-zero (the others are killed at once: a peer blocked in a
            collective would otherwise wait for its own timeout) or without a result.
        TimeoutError: the run outlived ``timeout``.
    """
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        common = {
            **(env or {}),
            "MASTER_PORT": str(free_port()),
            # Rank scripts import the project by module path, wherever the caller's cwd is.
            "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH")))),
        }
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        procs = [
            subprocess.Popen(
                [sys.executable, *argv],
                cwd=REPO_ROOT,
                env=rank_env(r, world_size, ranks_per_node, **common, **{RESULT_ENV: f"{tmp}/{r}.json"}),
                preexec_fn=pin,
                start_new_session=True,  # its own process group, so a kill reaches its children too
            )
            for r in range(world_size)
        ]
        try:
            wait_all(procs, timeout)
        finally:
            kill_all(procs)
        missing = [r for r in range(world_size) if not Path(f"{tmp}/{r}.json").exists()]
        if missing:
            raise RankError(f"ranks {missing} of {world_size} exited 0 without write_result()")
        return [json.loads(Path(f"{tmp}/{r}.json").read_text()) for r in range(world_size)]


def kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL the process group of every process of ``procs`` still running, and reap it."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    """Return once every process of ``procs`` exited 0; ``RankError`` at the first that fails,
    ``TimeoutError`` past ``timeout`` seconds (the caller kills the rest: :func:`kill_all`)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            raise RankError(
                f"ranks {failed} of {len(procs)} exited with {[codes[r] for r in failed]}: see their output above"
            )
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            raise TimeoutError(f"ranks {running} of {len(procs)} still running after {timeout:g} s")
        time.sleep(0.05)
