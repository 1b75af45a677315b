"""How the suite's own programs end: as ``python`` ends, but without tearing its modules down.

At exit CPython joins the program's threads, runs its ``atexit`` handlers, flushes its output, and
then tears its modules down, collecting every object still alive on the way. With torch, DeepSpeed
and megatron-core imported, that teardown is most of the time a process takes to exit, all of it
after the program's work is done: a job's ranks hold their launcher (torchrun, srun) that long, and
ranks that share a host take that CPU from each other. Freezing the heap instead (``gc.freeze``)
saves the time but leaves triton's extension objects alive, which nanobind then reports as leaks on
every rank's stderr.

Skipping the teardown is safe only for a program that releases what it holds before it returns:
files closed, process groups destroyed, threads stopped, child processes ended (what ``atexit``
handlers do, such as logging's flush and multiprocessing's join, still runs). The suite's programs
do; a foreign script that may leave a file open, such as the upstream ``pretrain_gpt.py`` that
``python -m megatron_ext.launch`` runs, ends with a normal exit.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_without_teardown(code: int = 0) -> NoReturn:
    """End the process with ``code``: join its non-daemon threads, run its ``atexit`` handlers and
    flush stdout and stderr, as the interpreter's exit does, then leave without the module teardown.

    Call it as a program's last statement, after everything it opened is closed
    (``exit_without_teardown(main())``, where ``main`` returns the exit status)."""
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's join of non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
