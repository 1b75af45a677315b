"""Ranks forked from one interpreter that has already imported torch and DeepSpeed.

A launch through torchrun starts a fresh interpreter per rank, and on a small host the ranks' imports
and exits dominate a short run: 4 ranks importing torch, DeepSpeed and Megatron side by side, and
tearing those modules down again at exit. :class:`WarmLauncher` starts ``python -m multirank.warm``
once; it imports the modules it is given, then forks every rank of each launch from itself. A rank
sees what a torchrun worker sees (the variables of torchrun's local agent, in the launcher's own
environment), runs its command as ``python`` would (``-m MODULE``, ``-c CODE`` or a script, as
``__main__``) and ends as ``python`` ends, but for the modules' teardown (:meth:`_Rank.run`).

What a warm rank cannot show is a cold start and a full exit: the preloaded modules were imported
before anything the command does, so a command that changes the process before it imports them (and
whose imports would see that) needs a cold launch. The tests that use this compare one launch of each
kind with torchrun's or srun's.

Lifetimes are tied: the server dies with its parent, each rank with the server (``PR_SET_PDEATHSIG``),
and a launch's ranks are killed together when one fails or the launch outlives its timeout.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from .processes import REPO_ROOT

ERROR_GRACE_S = 3.0  # after a rank fails, its peers' time to print their own error before the kill
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


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


def installed_imports(argv: Sequence[str], cwd: Path, env: Mapping[str, str], timeout: float) -> list[str]:
    """The modules ``python *argv`` imports (run once in ``cwd``, its output discarded, its exit status
    ignored: ``--help`` is enough for most commands) from this interpreter's installation, in import
    order. A module of a package that also has modules elsewhere (the command's own tree shadowing an
    installed package of the same name) is left out, as is every module of the project."""
    done = subprocess.run(
        [sys.executable, "-m", "multirank.warm", "--imports", *argv],
        cwd=cwd,
        env={**env, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO_ROOT), env.get("PYTHONPATH"))))},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        timeout=timeout,
        check=False,
    )
    try:
        modules: list[str] = json.loads(done.stdout.splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise RuntimeError(f"listing the imports of {' '.join(argv)} failed ({done.returncode})") from None
    return modules


def installed_modules(modules: Mapping[str, Any]) -> list[str]:
    """Of ``modules`` (name -> module, in import order), those loaded from this interpreter's
    installation whose top-level package has no module loaded from anywhere else."""
    prefixes = tuple(os.path.join(os.path.realpath(p), "") for p in {sys.prefix, sys.base_prefix})
    files = {name: getattr(module, "__file__", None) for name, module in modules.items()}
    installed = [name for name, path in files.items() if path and os.path.realpath(path).startswith(prefixes)]
    local = {name.split(".")[0] for name, path in files.items() if path and name not in set(installed)}
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
        then what each command of ``discover`` imports from the installation (:func:`installed_imports`,
        each run once in ``cwd``): for a command that changes the process before its imports."""
        self.env = {"OMP_NUM_THREADS": "1", **env}  # torchrun's default at more than one rank per node
        modules = dict.fromkeys(preload)
        for argv in discover:
            modules.update(dict.fromkeys(installed_imports(argv, cwd, self.env, timeout_s)))
        self._server = subprocess.Popen(
            [sys.executable, "-m", "multirank.warm", *modules],
            cwd=REPO_ROOT,
            env=self.env,  # ``-m`` from REPO_ROOT finds this package; a rank's sys.path is its own
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=_die_with_parent,
        )
        ready = self._reply(timeout_s, "start")
        self.preloaded: int = ready["modules"]
        self.preload_s: float = ready["seconds"]

    def launch(
        self, argv: Sequence[str], cwd: Path, log: Path, nodes: int, per_node: int, port: int, timeout: float
    ) -> list[int]:
        """Run ``python *argv`` as ``nodes`` x ``per_node`` ranks in ``cwd``, their stdout and stderr
        appended to ``log`` in time order; every rank's exit code (-9: killed) in rank order."""
        request = {"argv": list(argv), "cwd": str(cwd), "log": str(log), "timeout": timeout}
        request["ranks"] = [torchrun_env(r, nodes, per_node, port) for r in range(nodes * per_node)]
        assert self._server.stdin is not None
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        reply = self._reply(timeout + 2 * ERROR_GRACE_S + 30, "launch")
        if reply["timed_out"]:
            raise TimeoutError(f"{' '.join(argv)}: ranks still running after {timeout:g} s, killed")
        return reply["codes"]

    def _reply(self, timeout: float, what: str) -> dict[str, Any]:
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
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            self.close()
            raise RuntimeError(f"warm launcher: {reply['error']}")
        return reply

    def close(self) -> None:
        """Stop the server (a launch in progress is killed with it)."""
        if self._server.poll() is None:
            self._server.kill()
        self._server.wait(timeout=10)
        for stream in (self._server.stdin, self._server.stdout):
            if stream is not None:
                stream.close()


class _Rank:
    """In a forked child: what to run, and how, once the server's frames are unwound."""

    def __init__(self, request: dict[str, Any], env: dict[str, str]) -> None:
        self.argv, self.cwd, self.log, self.env = request["argv"], request["cwd"], request["log"], env

    def run(self) -> int:
        """Become the rank (session, output, environment, directory), run the command, and end as
        ``python`` ends (its exit code, thread joins, atexit, output flushed) up to the teardown of
        its modules, which it skips: that is most of a cold exit's time, and with the preloaded
        modules frozen (``gc.freeze``) it would report their objects as leaked. The torchrun and
        srun launches that the tests compare with exercise the full exit."""
        os.setsid()  # its own process group: a kill reaches what it starts (upstream runs make)
        _die_with_parent()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        out = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.environ.update(self.env)
        os.chdir(self.cwd)
        try:
            self.execute()
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:
            sys.excepthook(*sys.exc_info())  # as the interpreter reports an uncaught exception
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's join of non-daemon threads
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        return code

    def execute(self) -> None:
        """Run the command as ``python`` would run it in this directory."""
        import runpy

        if self.argv[0] == "-m":  # as ``python -m``: the working directory first on sys.path
            sys.path[0] = os.getcwd()
            sys.argv = [self.argv[1], *self.argv[2:]]
            runpy.run_module(self.argv[1], run_name="__main__", alter_sys=True)
        elif self.argv[0] == "-c":  # as ``python -c``: '' (the working directory) first
            sys.path[0] = ""
            sys.argv = ["-c", *self.argv[2:]]
            exec(compile(self.argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:  # as ``python script``: the script's directory first
            sys.path[0] = os.path.dirname(os.path.abspath(self.argv[0]))
            sys.argv = list(self.argv)
            runpy.run_path(self.argv[0], run_name="__main__")


def _exit_code(exc: SystemExit) -> int:
    """The status ``python`` exits with for ``exc``: None 0, an int itself, anything else printed, 1."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def _wait(pids: list[int], timeout: float) -> tuple[list[int], bool]:
    """Every rank's exit code; a failure or the deadline kills the rest (their process groups)."""
    codes: dict[int, int] = {}
    deadline, kill_at = time.monotonic() + timeout, None
    while len(codes) < len(pids):
        for rank, pid in enumerate(pids):
            if rank not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
                    if codes[rank] != 0 and kill_at is None:
                        kill_at = time.monotonic() + ERROR_GRACE_S
        now = time.monotonic()
        if now > deadline or (kill_at is not None and now > kill_at):
            for rank, pid in enumerate(pids):
                if rank not in codes:
                    os.killpg(pid, signal.SIGKILL)
                    codes[rank] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            return [codes[r] for r in range(len(pids))], kill_at is None
        time.sleep(0.02)
    return [codes[r] for r in range(len(pids))], False


def _serve(preload: Sequence[str], requests: IO[str], replies: IO[str]) -> _Rank | None:
    """The server's loop; returns in a forked rank (the rank to run), or None at the requests' end."""
    start = time.monotonic()
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # one that needs the command's own set-up is imported by the rank
            continue
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1:  # a fork copies one thread: another's locks would stay held in every rank
            error = f"importing {name} started a thread ({threads} in all): ranks cannot be forked safely"
            replies.write(json.dumps({"error": error}) + "\n")
            replies.flush()
            return None
    # Out of the collector's reach: a rank's collections would otherwise walk every preloaded object
    # (torch, DeepSpeed and Megatron: 3,500 modules), and touch (so copy) its page.
    gc.freeze()
    replies.write(json.dumps({"modules": len(sys.modules), "seconds": time.monotonic() - start}) + "\n")
    replies.flush()
    for line in requests:
        request = json.loads(line)
        pids = []
        for env in request["ranks"]:
            pid = os.fork()
            if pid == 0:
                requests.close()
                replies.close()
                return _Rank(request, env)
            pids.append(pid)
        codes, timed_out = _wait(pids, request["timeout"])
        replies.write(json.dumps({"codes": codes, "timed_out": timed_out}) + "\n")
        replies.flush()
    return None


def _list_imports(argv: list[str]) -> None:
    """``--imports ARGV``: run ARGV as a rank would, then print :func:`installed_modules` of what it imported."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    try:
        _Rank({"argv": argv, "cwd": os.getcwd(), "log": os.devnull}, {}).execute()
    except BaseException:  # the command's own outcome does not matter, its imports do
        pass
    replies.write(json.dumps(installed_modules(dict(sys.modules))) + "\n")
    replies.flush()
    os._exit(0)  # the command may have left threads or groups that a normal exit would wait on


def main() -> None:
    if sys.argv[1:2] == ["--imports"]:
        _list_imports(sys.argv[2:])
    # Replies go on a private copy of stdout; a preloaded module's prints go to stderr instead.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    rank = _serve(sys.argv[1:], sys.stdin, replies)
    if rank is not None:
        os._exit(rank.run())


if __name__ == "__main__":
    main()
