"""The warm launcher's server (``python -m multirank.warm_server``): it imports the modules its first
request names and those its commands import, then forks each further request's ranks
(:mod:`multirank.warm`, which starts it, says what a rank sees).

Requests and replies are JSON lines on its stdin and on a private copy of its stdout; the preloaded
modules' own prints go to stderr.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import selectors
import signal
import sys
import time
from typing import IO

from mdsp_base.shutdown import exit_without_teardown

from .processes import die_with_parent
from .warm import ERROR_GRACE_S, Command, LaunchRequest, RankRequest, installed_modules

CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000  # <sched.h>
MS_REC, MS_SLAVE, MNT_DETACH = 0x4000, 1 << 19, 2  # <sys/mount.h>
NETNS_DIR = "/var/run/netns"  # where ``ip netns add`` keeps a namespace's handle


class _Rank:
    """In a forked child: what to run, and how, once the server's frames are unwound."""

    def __init__(self, request: Command, rank: RankRequest) -> None:
        self.argv, self.cwd = request["argv"], request["cwd"]
        self.log, self.env, self.netns = rank["log"], rank["env"], rank["netns"]

    def run(self) -> int:
        """Become the rank (session, output, environment, directory) and run the command; returns
        the status ``python`` would exit with. The rank then ends without the teardown of its modules
        (:func:`mdsp_base.shutdown.exit_without_teardown`): that is most of a cold exit's time, and
        with the preloaded modules frozen (``gc.freeze``) it would report their objects as leaked.
        The upstream runs that the tests launch by torchrun and srun exercise the full exit."""
        os.setsid()  # its own process group: a kill reaches what it starts (upstream runs make)
        die_with_parent()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as at a cold start
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        out = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.environ.update(self.env)
        os.chdir(self.cwd)
        try:
            if self.netns is not None:
                _join_network_namespace(self.netns)
            self.execute()
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:
            sys.excepthook(*sys.exc_info())  # as the interpreter reports an uncaught exception
            code = 1
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


def _join_network_namespace(name: str) -> None:
    """Do for this (single-threaded) process what ``ip netns exec NAME`` does before it runs its
    command (Python 3.11 has no os.setns): join the network namespace ``ip netns add NAME`` made,
    then, in a mount namespace of its own, mount a /sys that shows that namespace's devices."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"{what} for network namespace {name}: {os.strerror(error)} (needs root)")

    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    try:
        check(libc.setns(fd, CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(CLONE_NEWNS), "unshare")
    check(libc.mount(b"", b"/", b"none", MS_SLAVE | MS_REC, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", MNT_DETACH), "umount /sys")
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


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


def _preload(names: list[str]) -> str | None:
    """Import ``names``; None, or why ranks cannot be forked from this process any more."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # one that needs the command's own set-up is imported by the rank
            continue
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1:  # a fork copies one thread: another's locks would stay held in every rank
            return f"importing {name} started a thread ({threads} in all): ranks cannot be forked safely"
    return None


def _discover(commands: list[list[str]], cwd: str, timeout: float) -> list[str]:
    """What each command imports from the installation (:func:`installed_modules`), in import order:
    each runs once, side by side, in a child forked from this process (so it imports only what the
    preload lacks), its output discarded and its outcome ignored (``--help`` is enough for most)."""
    children = []
    for argv in commands:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            die_with_parent()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.chdir(cwd)
            try:
                _Rank({"argv": argv, "cwd": cwd}, {"log": os.devnull, "env": {}, "netns": None}).execute()
            except BaseException:  # the command's own outcome does not matter, its imports do
                pass
            with os.fdopen(write, "w") as sink:
                sink.write(json.dumps(installed_modules(dict(sys.modules))))
            os._exit(0)  # the command may have left threads or groups that a normal exit would wait on
        os.close(write)
        children.append((pid, os.fdopen(read, "rb"), argv))
    deadline = time.monotonic() + timeout
    modules: dict[str, None] = {}
    try:
        for _pid, out, argv in children:
            with selectors.DefaultSelector() as sel:
                sel.register(out, selectors.EVENT_READ)
                data = b""
                while sel.select(max(0.0, deadline - time.monotonic())):
                    chunk = os.read(out.fileno(), 1 << 20)
                    if not chunk:
                        break
                    data += chunk
                else:
                    raise TimeoutError(
                        f"listing the imports of {' '.join(argv)}: no answer within {timeout:g} s"
                    )
            try:
                modules.update(dict.fromkeys(json.loads(data)))
            except json.JSONDecodeError:
                raise RuntimeError(f"listing the imports of {' '.join(argv)} failed") from None
    finally:
        for pid, out, _ in children:
            out.close()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
    return [name for name in modules if name not in sys.modules]


def _serve(requests: IO[str], replies: IO[str]) -> _Rank | None:
    """The server's loop: import the first request's modules and what its commands import, then fork
    each launch's ranks. Returns in a forked rank (the rank to run), or None at the requests' end."""
    line = requests.readline()
    if not line:
        return None
    start = json.loads(line)
    discovered: list[str] = []
    try:
        error = _preload(start["preload"])
        if error is None:
            discovered = _discover(start["discover"], start["cwd"], start["timeout"])
            error = _preload(discovered)
    except (TimeoutError, RuntimeError) as exc:
        error = str(exc)
    if error is not None:
        replies.write(json.dumps({"error": error}) + "\n")
        replies.flush()
        return None
    # Out of the collector's reach: a rank's collections would otherwise walk every preloaded object
    # (torch, DeepSpeed and Megatron: 3,500 modules), and touch (so copy) its page.
    gc.freeze()
    for stream in (sys.stdout, sys.stderr):  # what the imports printed, once: a rank inherits buffers
        stream.flush()
    replies.write(json.dumps({"modules": len(sys.modules), "discovered": discovered}) + "\n")
    replies.flush()
    for line in requests:
        request: LaunchRequest = json.loads(line)
        pids = []
        for rank in request["ranks"]:
            pid = os.fork()
            if pid == 0:
                requests.close()
                replies.close()
                return _Rank(request, rank)
            pids.append(pid)
        codes, timed_out = _wait(pids, request["timeout"])
        replies.write(json.dumps({"codes": codes, "timed_out": timed_out}) + "\n")
        replies.flush()
    return None


def main() -> None:
    # Replies go on a private copy of stdout; a preloaded module's prints go to stderr instead.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    rank = _serve(sys.stdin, replies)
    if rank is not None:
        exit_without_teardown(rank.run())


if __name__ == "__main__":
    main()
