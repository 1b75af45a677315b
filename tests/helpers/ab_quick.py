"""The A/B command's quick run (``python -m benchmarks.zero.ab --quick --warm --nodes 2``), started in
the background as the session's tests start, and checked by its test, which runs last.

Run alone, it keeps the two cores about a third busy: most of its ~40 s its ranks wait on the
emulated cluster's shaped links (a 50 Mbit/s NIC), time in which the tests before it now use the
cores. Its test checks what the run wrote, not how fast (it bounds the prediction error at 10x
either way for that reason). The run's namespaces have a prefix of their own (``emab``), so the
link tests of the emulated cluster, which run meanwhile, never touch them.

The ``ab_quick`` fixture gives the test the finished run; without root, ``ip`` and ``tc`` nothing
starts (the test skips).
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
TEST = "test_probe_and_ab_quick_on_the_emulated_cluster"
COMMAND = ["-m", "benchmarks.zero.ab", "--quick", "--warm", "--nodes", "2"]
TIMEOUT_S = 900.0  # a hang bound, not a speed target: the run takes about 40 s on 2 idle cores
HAVE_NETNS = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


class QuickRun:
    """The run in the background: its results in ``out``, its output in ``out / 'output.log'``."""

    def __init__(self) -> None:
        self.out = Path(tempfile.mkdtemp(prefix="ab-quick-"))
        self.log = self.out / "output.log"
        with open(self.log, "w") as log:
            self._proc = subprocess.Popen(
                [sys.executable, *COMMAND, "--out", str(self.out)],
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
                f"{' '.join(COMMAND)} still running after {TIMEOUT_S:.0f} s:\n{self.output()[-5000:]}"
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """Kill it and what it started, if it still runs; remove its directory."""
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        shutil.rmtree(self.out, ignore_errors=True)


RUN = pytest.StashKey[QuickRun]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The test that only waits for the run goes last: by then the run is over."""
    items.sort(key=lambda item: item.name == TEST)  # stable: the order is kept otherwise


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """Start the run as the tests start, if its test is among them and can run here."""
    if session.config.option.collectonly or not HAVE_NETNS:
        return
    if any(item.name == TEST for item in session.items):
        session.config.stash[RUN] = QuickRun()


def pytest_sessionfinish(session: pytest.Session) -> None:
    run = session.config.stash.get(RUN, None)
    if run is not None:
        run.stop()


@pytest.fixture
def ab_quick(request: pytest.FixtureRequest) -> QuickRun:
    """The background run, finished (started now if the session did not start it)."""
    run = request.config.stash.get(RUN, None)
    if run is None:
        run = request.config.stash[RUN] = QuickRun()
    code = run.wait()
    assert code == 0, f"{' '.join(COMMAND)} exited {code}:\n{run.output()[-5000:]}"
    return run
