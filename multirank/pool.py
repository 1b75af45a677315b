"""A persistent pool of gloo worker processes, for multi-rank tests.

Spawning a process group costs seconds; the pool keeps one alive and runs a module-level function
on every rank per call. Rendezvous is a file (no ports). A call that outlives its timeout kills
the pool (the next call rebuilds it); a rank that raises makes the call raise with that rank's
traceback, after a short grace for the others to fail too (a peer blocked in a collective would
otherwise hang until the timeout).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TypeVar, cast

from .processes import RankError, rank_env

T = TypeVar("T")

ERROR_GRACE_S = 3.0
# Workers are forked from one server process that has imported these once: a spawned worker spent
# seconds of CPU importing them, and every pool started again paid that on each of its ranks.
PRELOAD = [
    "torch",
    "torch.distributed",
    "deepspeed",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
]
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


def _worker_main(rank: int, world_size: int, init_file: str, conn: Connection) -> None:
    env = rank_env(rank, world_size)
    os.environ.clear()  # rank_env leaves Slurm's task variables out: they must go here too
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # What the server imported (torch, DeepSpeed, megatron-core) out of the collector's reach: a full
    # collection walks every object (DeepSpeed runs one per ZeRO-3 engine: 1.3 s per rank at 8 ranks).
    gc.freeze()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            result = ("ok", fn(*args, **kwargs))
        except BaseException:
            result = ("error", traceback.format_exc())
        finally:
            _reset_megatron_state()
        conn.send(result)
    dist.destroy_process_group()


def _reset_megatron_state() -> None:
    """Tests must not leak process groups into the next call: megatron-core's, and every other group
    made on the way (DeepSpeed's, the plugins'). Each gloo group keeps a polling thread, so hundreds
    of leaked groups would take a core from every later test."""
    import sys

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    for group in list(distributed_c10d._world.pg_map):
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)


class WorkerPool:
    """``world_size`` processes joined in one gloo group, running functions on request."""

    def __init__(self, world_size: int, start_timeout_s: float = 120.0) -> None:
        """Fork the workers and join them in one gloo group.

        Args:
            world_size (int): ranks of the group.
            start_timeout_s (float): seconds every rank has to join.

        Raises:
            RankError: a rank failed to start.
            TimeoutError: a rank did not join within ``start_timeout_s``.
        """
        self.world_size = world_size
        self._tmp = tempfile.TemporaryDirectory(prefix="multirank-")
        init_file = os.path.join(self._tmp.name, "rendezvous")
        self._conns: list[Connection] = []
        self._procs = []
        for rank in range(world_size):
            parent, child = _CONTEXT.Pipe()
            proc = _CONTEXT.Process(
                target=_worker_main, args=(rank, world_size, init_file, child), daemon=True
            )
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect(start_timeout_s, what="start")

    def run(self, fn: Callable[..., T], *args: object, timeout: float = 120.0, **kwargs: object) -> list[T]:
        """Run ``fn(*args, **kwargs)`` on every rank.

        Args:
            fn: a module-level function (pickled by reference to each worker).
            *args: its positional arguments, pickled to every rank.
            timeout: seconds all ranks have to answer; past it the pool is killed.
            **kwargs: its keyword arguments, pickled to every rank.

        Returns:
            Every rank's result, in rank order.

        Raises:
            RankError: a rank raised (with that rank's traceback) or died.
            TimeoutError: a rank gave no answer within ``timeout``.
        """
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return cast(list[T], self._collect(timeout, what=getattr(fn, "__name__", repr(fn))))

    def _collect(self, timeout: float, what: str) -> list[object]:
        deadline = time.monotonic() + timeout
        results: dict[int, tuple[str, object]] = {}
        error_deadline: float | None = None
        while len(results) < self.world_size:
            now = time.monotonic()
            if now > deadline or (error_deadline is not None and now > error_deadline):
                break
            for rank, conn in enumerate(self._conns):
                if rank in results:
                    continue
                if not self._procs[rank].is_alive() and not conn.poll():
                    results[rank] = ("error", f"rank {rank} died (exit code {self._procs[rank].exitcode})")
                elif conn.poll(0.01):
                    results[rank] = conn.recv()
                else:
                    continue
                if results[rank][0] == "error" and error_deadline is None:
                    error_deadline = time.monotonic() + ERROR_GRACE_S
        if error_deadline is not None:
            errors = sorted((r, res[1]) for r, res in results.items() if res[0] == "error")
            rank, tb = errors[0]
            self.close(graceful=False)
            raise RankError(f"{what}: rank {rank} of {self.world_size} failed:\n{tb}")
        if len(results) < self.world_size:
            missing = [r for r in range(self.world_size) if r not in results]
            self.close(graceful=False)
            raise TimeoutError(
                f"{what}: ranks {missing} of {self.world_size} gave no answer within {timeout:.0f}s"
            )
        return [results[r][1] for r in range(self.world_size)]

    def threads(self) -> int:
        """Threads of the busiest worker: gloo groups that outlive their test keep theirs."""
        counts = [len(os.listdir(f"/proc/{p.pid}/task")) for p in self._procs if p.is_alive()]
        return max(counts, default=0)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def close(self, graceful: bool = True) -> None:
        """Stop the workers: ask them to leave, or kill them (a rank stuck in a collective never reads).

        Args:
            graceful (bool): ask first and wait briefly; False kills at once.
        """
        for conn, proc in zip(self._conns, self._procs):
            if graceful and proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self._procs:
            if graceful:
                proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs, self._conns = [], []
        self._tmp.cleanup()
