"""Two runs on the emulated cluster with compute on the MI250X stand-in, started in the background
as the session's tests start, and checked by their tests, which run last:

* the A/B command's quick run (``python -m benchmarks.zero.ab --device mi250x --quick --warm --nodes 2``);
* the compute-only step at 8 and 16 ranks (``python -m benchmarks.zero.compute_only --device mi250x
  --quick --warm --nodes 2 4``), the stand-in's scale invariance.

Their ranks mostly sleep on the virtual device or wait on the shaped links, time in which the tests
before them use the cores. The tests check what the runs wrote, not how fast. Each run's namespaces
have a prefix of their own (``emab``, ``emco``), so the link tests of the emulated cluster, which run
meanwhile, never touch them.

The ``ab_quick`` and ``compute_only_quick`` fixtures give the tests the finished runs; without root,
``ip`` and ``tc`` nothing starts (the tests skip).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from multirank.processes import die_with_parent

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {
    "test_probe_and_ab_quick_on_the_emulated_cluster": [
        *("-m", "benchmarks.zero.ab", "--device", "mi250x", "--quick", "--warm", "--nodes", "2")
    ],
    "test_the_compute_only_step_does_not_grow_with_the_ranks": [
        *(
            "-m",
            "benchmarks.zero.compute_only",
            "--device",
            "mi250x",
            "--quick",
            "--warm",
            "--nodes",
            "2",
            "4",
        )
    ],
}
TIMEOUT_S = 900.0  # a hang bound, not a speed target: each run takes about 2-3 minutes
HAVE_NETNS = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


class QuickRun:
    """The run in the background: its results in ``out``, its output in ``out / 'output.log'``."""

    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.out = Path(tempfile.mkdtemp(prefix="ab-quick-"))
        self.log = self.out / "output.log"
        with open(self.log, "w") as log:
            self._proc = subprocess.Popen(
                [sys.executable, *command, "--out", str(self.out)],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,  # a killed session takes the run with it
                start_new_session=True,  # and a stop reaches the ranks it started
            )
        self._started = time.monotonic()

    def wait(self) -> int:
        """Its exit status, once it ends; past TIMEOUT_S from its start it is stopped and this fails."""
        left = TIMEOUT_S - (time.monotonic() - self._started)
        try:
            return self._proc.wait(timeout=max(left, 0.0))
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(
                f"{' '.join(self.command)} still running after {TIMEOUT_S:.0f} s:\n{self.output()[-5000:]}"
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """Kill it and what it started, if it still runs; remove its directory."""
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        shutil.rmtree(self.out, ignore_errors=True)


RUNS = pytest.StashKey[dict[str, QuickRun]]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that only wait for the runs go last: by then the runs are over."""
    items.sort(key=lambda item: item.name in COMMANDS)  # stable: the order is kept otherwise


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """Start each run as the tests start, if its test is among them and can run here."""
    if session.config.option.collectonly or not HAVE_NETNS:
        return
    selected = {item.name for item in session.items}
    session.config.stash[RUNS] = {name: QuickRun(cmd) for name, cmd in COMMANDS.items() if name in selected}


def pytest_sessionfinish(session: pytest.Session) -> None:
    for run in session.config.stash.get(RUNS, {}).values():
        run.stop()


def _finished(request: pytest.FixtureRequest, test: str) -> QuickRun:
    """The background run of ``test``, finished (started now if the session did not start it)."""
    runs = request.config.stash.setdefault(RUNS, {})
    if test not in runs:
        runs[test] = QuickRun(COMMANDS[test])
    run = runs[test]
    code = run.wait()
    assert code == 0, f"{' '.join(run.command)} exited {code}:\n{run.output()[-5000:]}"
    return run


@pytest.fixture
def ab_quick(request: pytest.FixtureRequest) -> QuickRun:
    """The A/B command's quick run on the stand-in, finished."""
    return _finished(request, "test_probe_and_ab_quick_on_the_emulated_cluster")


@pytest.fixture
def compute_only_quick(request: pytest.FixtureRequest) -> QuickRun:
    """The compute-only steps at 8 and 16 ranks on the stand-in, finished."""
    return _finished(request, "test_the_compute_only_step_does_not_grow_with_the_ranks")
