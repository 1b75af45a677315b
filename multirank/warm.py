"""Ranks forked from one interpreter that has already imported torch and DeepSpeed.

On a small host a torchrun launch spends most of a short run importing torch, DeepSpeed and Megatron
once per rank and tearing them down at exit. :class:`WarmLauncher` starts ``python -m
multirank.warm_server`` once; it imports the modules it is given, then forks every rank of each
launch from itself. A rank sees torchrun's variables, runs its command as ``python`` would and ends
without the modules' teardown. It cannot show a cold start or a full exit (docs/architecture.md,
"How the tests start ranks"). Lifetimes are tied: the server dies with its parent, each rank with
the server (``PR_SET_PDEATHSIG``), and a launch's ranks die together when one fails or times out."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from .processes import REPO_ROOT, die_with_parent

ERROR_GRACE_S = 3.0  # after a rank fails, its peers' time to print their own error before the kill


def torchrun_env(rank: int, nodes: int, per_node: int, port: int) -> dict[str, str]:
    """The variables torchrun's local agent gives worker ``rank`` of ``nodes`` x ``per_node`` ranks
    (static rendezvous on 127.0.0.1), but for what only an agent has: rank 0 hosts the TCP store (no
    agent store), and there is no per-worker error file or list of signals the agent forwards."""
    world = nodes * per_node
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % per_node),
        "GROUP_RANK": str(rank // per_node),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(per_node),
        "WORLD_SIZE": str(world),
        "GROUP_WORLD_SIZE": str(nodes),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


@dataclass(frozen=True)
class Rank:
    """One rank of :meth:`WarmLauncher.run`."""

    log: Path
    """Where its stdout and stderr are appended (ranks may share one file)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Its variables, on top of the launcher's environment."""
    netns: str | None = None
    """A network namespace made by ``ip netns add`` that it joins first, as ``ip netns exec NAME``
    would run it (root only); None: the launcher's."""


class RankRequest(TypedDict):
    """One rank of a launch, as the server reads it (:class:`Rank`, serialised)."""

    env: dict[str, str]
    log: str
    netns: str | None


class Command(TypedDict):
    """What a rank runs: ``python *argv`` in ``cwd``."""

    argv: list[str]
    cwd: str


class LaunchRequest(Command):
    """A launch, as the server reads it: the command, its bound and its ranks."""

    timeout: float
    ranks: list[RankRequest]


class _Reply(TypedDict, total=False):
    """The server's answer: to its start (``discovered``), to a launch (``codes``, ``timed_out``),
    or ``error``."""

    discovered: list[str]
    codes: list[int]
    timed_out: bool
    error: str


def installed_modules(modules: Mapping[str, object]) -> list[str]:
    """Of ``modules`` (name -> module, in import order), those loaded from this interpreter's
    installation whose top-level package has no module loaded from anywhere else."""
    prefixes = tuple(os.path.join(os.path.realpath(p), "") for p in {sys.prefix, sys.base_prefix})
    files = {name: getattr(module, "__file__", None) for name, module in modules.items()}
    installed = [name for name, path in files.items() if path and os.path.realpath(path).startswith(prefixes)]
    kept = set(installed)
    local = {name.split(".")[0] for name, path in files.items() if path and name not in kept}
    return [name for name in installed if name.split(".")[0] not in local]


class WarmLauncher:
    """One warm server with the environment ``env``; each :meth:`launch` forks a run's ranks from it."""

    def __init__(
        self,
        env: Mapping[str, str],
        preload: Sequence[str] = (),
        discover: Sequence[Sequence[str]] = (),
        cwd: Path = REPO_ROOT,
        timeout_s: float = 300.0,
    ) -> None:
        """Preload the modules ``preload`` (what the ranks' command imports before it does anything),
        then what each command of ``discover`` imports from the installation: each runs once in
        ``cwd``, forked from the server once it has imported ``preload``, for a command that changes
        the process before its imports. A module of a package that also has modules elsewhere (the
        command's own tree shadowing an installed package of the same name) is left out, as is every
        module of the project; ``preload`` must hold no package that a command brings its own copy of.

        The server imports in the background: this returns at once, and the first launch (or
        :attr:`discovered`) waits for it, at most ``timeout_s`` (+30 s), and raises what it failed with."""
        self.env = {"OMP_NUM_THREADS": "1", **env}  # torchrun's default at more than one rank per node
        self._server = subprocess.Popen(
            [sys.executable, "-m", "multirank.warm_server"],
            cwd=REPO_ROOT,
            env=self.env,  # ``-m`` from REPO_ROOT finds this package; a rank's sys.path is its own
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent,
        )
        discover = [list(argv) for argv in discover]
        self._request({"preload": list(preload), "discover": discover, "cwd": str(cwd), "timeout": timeout_s})
        self._start_timeout = timeout_s + 30
        self._discovered: list[str] | None = None

    @property
    def discovered(self) -> list[str]:
        """What the ``discover`` commands imported beyond ``preload``, in import order (preloaded
        too): a later launcher with the same commands can preload it instead of running them."""
        return self._started()

    def _started(self) -> list[str]:
        """Wait for the server's start (it imports in the background until its first answer)."""
        if self._discovered is None:
            self._discovered = self._reply(self._start_timeout, "start")["discovered"]
        return self._discovered

    def launch(
        self, argv: Sequence[str], cwd: Path, log: Path, nodes: int, per_node: int, port: int, timeout: float
    ) -> list[int]:
        """Run ``python *argv`` as ``nodes`` x ``per_node`` ranks with torchrun's variables.

        Args:
            argv (Sequence[str]): the command after ``python``.
            cwd (Path): where the ranks run.
            log (Path): the file every rank's stdout and stderr are appended to, in time order.
            nodes (int): emulated nodes.
            per_node (int): ranks per node.
            port (int): the rendezvous port (``MASTER_PORT``).
            timeout (float): seconds the run may take.

        Returns:
            list[int]: every rank's exit code (-9: killed), in rank order.

        Raises:
            TimeoutError: ranks were still running after ``timeout``.
        """
        ranks = [Rank(log, torchrun_env(r, nodes, per_node, port)) for r in range(nodes * per_node)]
        return self.run(argv, cwd, ranks, timeout)

    def run(self, argv: Sequence[str], cwd: Path, ranks: Sequence[Rank], timeout: float) -> list[int]:
        """Run ``python *argv`` in ``cwd`` once per rank of ``ranks``. A rank that fails takes the
        others down after ``ERROR_GRACE_S``.

        Args:
            argv (Sequence[str]): the command after ``python``.
            cwd (Path): where the ranks run.
            ranks (Sequence[Rank]): each rank's variables, log and network namespace.
            timeout (float): seconds the run may take; past it all ranks are killed.

        Returns:
            list[int]: every rank's exit code (-9: killed), in rank order.

        Raises:
            TimeoutError: ranks were still running after ``timeout``.
        """
        self._started()
        request: LaunchRequest = {
            "argv": list(argv),
            "cwd": str(cwd),
            "timeout": timeout,
            "ranks": [{"env": dict(r.env), "log": str(r.log), "netns": r.netns} for r in ranks],
        }
        self._request(request)
        reply = self._reply(timeout + 2 * ERROR_GRACE_S + 30, "launch")
        if reply["timed_out"]:
            raise TimeoutError(f"{' '.join(argv)}: ranks still running after {timeout:g} s, killed")
        return reply["codes"]

    def _request(self, request: Mapping[str, object]) -> None:
        assert self._server.stdin is not None
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()

    def _reply(self, timeout: float, what: str) -> _Reply:
        assert self._server.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self._server.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                self.close()
                raise TimeoutError(f"warm launcher: no answer to {what} within {timeout:g} s")
        line = self._server.stdout.readline()
        if not line:
            code = self._server.wait(timeout=10)
            raise RuntimeError(f"warm launcher exited with {code} during {what}: see its stderr above")
        reply: _Reply = json.loads(line)
        if "error" in reply:
            self.close()
            raise RuntimeError(f"warm launcher: {reply['error']}")
        return reply

    def __enter__(self) -> WarmLauncher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the server (a launch in progress is killed with it)."""
        if self._server.poll() is None:
            self._server.kill()
        self._server.wait(timeout=10)
        for stream in (self._server.stdin, self._server.stdout):
            if stream is not None:
                stream.close()
