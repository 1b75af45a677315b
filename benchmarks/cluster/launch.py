"""Run an emulated cluster: build it, launch one process per rank in its namespace, tear it down."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from multirank.processes import RESULT_ENV, die_with_parent
from multirank.warm import Rank, WarmLauncher

from . import netns
from .spec import ClusterSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
MASTER_PORT = 29500
_TAIL_CHARS = 2000


class RankFailure(RuntimeError):
    """One or more ranks failed or timed out; the message carries each rank's stderr tail."""


def _raise_exit(signum: int, _frame: FrameType | None) -> None:
    # Turns SIGTERM/SIGHUP into an exception so the context manager's teardown runs.
    raise SystemExit(128 + signum)


class EmulatedCluster:
    """Context manager owning the namespaces of one cluster; launch() runs commands on its ranks.

    Each rank is a fresh ``python`` in its namespace (``ip netns exec``), or, given ``warm``, a fork of
    that launcher's interpreter that joins its namespace first: the same sockets and links, without
    each rank importing torch and DeepSpeed again."""

    def __init__(
        self,
        spec: ClusterSpec,
        prefix: str = netns.DEFAULT_PREFIX,
        lock_timeout: float = 120.0,
        warm: WarmLauncher | None = None,
    ) -> None:
        netns.check_prefix(prefix)
        self.spec = spec
        self.prefix = prefix
        self.lock_timeout = lock_timeout
        self.warm = warm
        self.namespaces: list[str] = []
        self._lock_file: Any = None
        self._old_handlers: dict[int, Any] = {}
        self._workdir: Path | None = None

    def __enter__(self) -> EmulatedCluster:
        netns.check_prerequisites()
        self._lock()
        try:
            if threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGTERM, signal.SIGHUP):
                    self._old_handlers[sig] = signal.signal(sig, _raise_exit)
            # Leftovers of a killed run with this prefix; the lock guarantees none of them is live.
            netns.teardown(self.prefix)
            for stale in Path(tempfile.gettempdir()).glob(f"{self.prefix}-cluster-*"):
                shutil.rmtree(stale, ignore_errors=True)
            self._workdir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-cluster-"))
            self.namespaces = netns.build(self.spec, self.prefix)
        except BaseException:
            self._cleanup()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._cleanup()

    def _lock(self) -> None:
        # Two runs with one prefix would delete each other's namespaces: serialise them per host.
        self._lock_file = open(Path(tempfile.gettempdir()) / f"{self.prefix}-emulated-cluster.lock", "w")  # noqa: SIM115
        deadline = time.monotonic() + self.lock_timeout
        while True:
            try:
                fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self._lock_file.close()
                    raise RuntimeError(
                        f"another emulated cluster with prefix '{self.prefix}' is still running on this host "
                        f"after {self.lock_timeout:g} s; wait for it or pass a different prefix"
                    ) from None
                time.sleep(0.5)

    def _cleanup(self) -> None:
        try:
            netns.teardown(self.prefix)
        finally:
            self.namespaces = []
            if self._workdir is not None:
                shutil.rmtree(self._workdir, ignore_errors=True)
                self._workdir = None
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            self._old_handlers.clear()
            if self._lock_file is not None:
                self._lock_file.close()  # releases the flock
                self._lock_file = None

    def rank_env(self, rank: int) -> dict[str, str]:
        """Environment variables a rank gets on top of the caller's."""
        place = self.spec.place(rank)
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.spec.world_size),
            "LOCAL_RANK": str(place.local_rank),
            "LOCAL_WORLD_SIZE": str(self.spec.ranks_per_node),
            "MASTER_ADDR": self.spec.address(0),
            "MASTER_PORT": str(MASTER_PORT),
            # Without it gloo resolves the hostname to 127.0.0.1 and rendezvous hangs.
            "GLOO_SOCKET_IFNAME": netns.RANK_IFACE,
            "EMU_NODE": str(place.node),
            "EMU_PACKAGE": str(place.package),
            "EMU_SPEC": json.dumps(self.spec.to_dict()),
        }

    def launch(
        self,
        argv: Sequence[str],
        timeout: float,
        env: Mapping[str, str] | None = None,
        echo: bool = False,
    ) -> list[Any]:
        """Run `python *argv` on every rank; return each rank's write_result() value, by rank.

        Raises RankFailure (with every rank's stderr tail) when a rank exits non-zero, writes no
        result, or the whole run exceeds `timeout` seconds; the remaining ranks are killed first.
        With echo=True the ranks' stdout lines are printed as they arrive (from a warm launcher, their
        whole output once they have exited), prefixed with the rank.
        """
        if self._workdir is None:
            raise RuntimeError("launch() needs an entered cluster: use `with EmulatedCluster(spec) as c:`")
        run_dir = Path(tempfile.mkdtemp(dir=self._workdir))
        base = {**os.environ, **(env or {})}
        # One core per rank is all a small host has; torch would otherwise spawn a thread per core per rank.
        base.setdefault("OMP_NUM_THREADS", "1")
        # Rank scripts import the project by module path, wherever the caller's cwd is.
        base["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), base.get("PYTHONPATH")) if p)
        envs = [
            {**base, **self.rank_env(rank), RESULT_ENV: str(run_dir / f"rank{rank}.json")}
            for rank in range(len(self.namespaces))
        ]
        if self.warm is None:
            self._launch_cold(argv, envs, run_dir, timeout, echo)
        else:
            self._launch_warm(argv, envs, run_dir, timeout, echo)
        missing = [r for r in range(len(envs)) if not (run_dir / f"rank{r}.json").exists()]
        if missing:
            raise RankFailure(
                f"ranks {missing} exited 0 without write_result()\n" + _tails(run_dir, len(envs))
            )
        return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(len(envs))]

    def _launch_cold(
        self, argv: Sequence[str], envs: list[dict[str, str]], run_dir: Path, timeout: float, echo: bool
    ) -> None:
        procs, outs, errs = [], [], []
        try:
            for rank, (ns, rank_env) in enumerate(zip(self.namespaces, envs)):
                outs.append(open(run_dir / f"rank{rank}.out", "w+b"))  # noqa: SIM115
                errs.append(open(run_dir / f"rank{rank}.err", "w+b"))  # noqa: SIM115
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, *argv],
                    env=rank_env, stdout=outs[rank], stderr=errs[rank], stdin=subprocess.DEVNULL,
                    start_new_session=True,  # its own process group, so a kill reaches its children too
                    preexec_fn=die_with_parent,  # killed outright, the launcher takes its ranks along
                ))  # fmt: skip
            self._wait(procs, outs, run_dir, timeout, echo)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            for f in outs + errs:
                f.close()

    def _launch_warm(
        self, argv: Sequence[str], envs: list[dict[str, str]], run_dir: Path, timeout: float, echo: bool
    ) -> None:
        """As a cold launch, but forked from ``self.warm`` (stdout and stderr in one file per rank,
        echoed once the ranks have exited)."""
        assert self.warm is not None
        ranks = [
            Rank(run_dir / f"rank{r}.err", env, ns) for r, (ns, env) in enumerate(zip(self.namespaces, envs))
        ]
        try:
            codes = self.warm.run(argv, REPO_ROOT, ranks, timeout)
        except TimeoutError as exc:
            raise RankFailure(f"{exc}\n" + _tails(run_dir, len(ranks))) from None
        if echo:
            for rank, spec in enumerate(ranks):
                for line in spec.log.read_text(errors="replace").splitlines():
                    print(f"[rank {rank}] {line}", flush=True)
        failed = [r for r, code in enumerate(codes) if code != 0]
        if failed:
            raise RankFailure(
                f"ranks {failed} failed with exit codes {[codes[r] for r in failed]}\n"
                + _tails(run_dir, len(ranks))
            )

    @staticmethod
    def _wait(
        procs: list[subprocess.Popen], outs: list[Any], run_dir: Path, timeout: float, echo: bool
    ) -> None:
        deadline = time.monotonic() + timeout
        printed = [0] * len(procs)
        while True:
            if echo:
                for rank, out in enumerate(outs):
                    out.seek(printed[rank])
                    data = out.read()
                    # Print whole lines only; a partial one waits for its newline.
                    complete = data[: data.rfind(b"\n") + 1]
                    for line in complete.decode(errors="replace").splitlines():
                        print(f"[rank {rank}] {line}", flush=True)
                    printed[rank] += len(complete)
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                raise RankFailure(
                    f"ranks {failed} failed with exit codes {[codes[r] for r in failed]}\n"
                    + _tails(run_dir, len(procs))
                )
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                raise RankFailure(
                    f"timeout after {timeout:g} s, ranks {running} still running\n"
                    + _tails(run_dir, len(procs))
                )
            time.sleep(0.1)


def _tails(run_dir: Path, ranks: int) -> str:
    """The end of each rank's stderr (with a warm launch, its whole output)."""
    parts = []
    for rank in range(ranks):
        path = run_dir / f"rank{rank}.err"
        text = path.read_bytes()[-_TAIL_CHARS:].decode(errors="replace").rstrip() if path.exists() else ""
        parts.append(f"--- rank {rank} stderr (tail) ---\n{text or '(empty)'}")
    return "\n".join(parts)
