"""``exit_without_teardown``: a program ends as ``python`` ends (its status, its threads joined, its
atexit handlers run, its output flushed), without the teardown of its modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = """
import atexit, sys, threading, time
from pathlib import Path
from mdsp_base.shutdown import exit_without_teardown

out = Path(sys.argv[1])

class Torn:
    def __del__(self):
        (out / "torn down").touch()

def late_worker():
    time.sleep(0.3)
    (out / "thread joined").touch()

kept = Torn()  # freed only by the teardown of this module
threading.Thread(target=late_worker).start()
atexit.register(lambda: (out / "atexit ran").touch())
sys.stdout.write("buffered, no newline")  # a pipe's stdout is block-buffered: lost unless flushed
sys.stderr.write("to stderr")
exit_without_teardown(3)
"""


def test_exit_keeps_status_threads_atexit_and_output_and_skips_the_teardown(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 3, done.stderr
    assert (done.stdout, done.stderr) == ("buffered, no newline", "to stderr")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit ran", "thread joined"]


def test_a_normal_exit_of_the_same_program_tears_its_modules_down(tmp_path: Path) -> None:
    """The control: with ``sys.exit`` the module global is freed at exit."""
    program = PROGRAM.replace("exit_without_teardown(3)", "sys.exit(3)")
    done = subprocess.run(
        [sys.executable, "-c", program, str(tmp_path)], cwd=ROOT, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit ran", "thread joined", "torn down"]
