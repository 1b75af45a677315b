"""How the suite's own programs end: as ``python`` ends, but without tearing its modules down.

With torch, DeepSpeed and megatron-core imported, the modules' teardown at exit is most of the time a
process takes to end, all of it after the work is done: a job's ranks hold their launcher that long
and take CPU from each other on a shared host. Skipping it is safe only for a program that releases
what it holds before it returns (files closed, process groups destroyed, threads stopped, children
ended); ``atexit`` handlers still run. The suite's programs do; a foreign script, such as the
upstream ``pretrain_gpt.py`` that ``python -m megatron_ext.launch`` runs, ends with a normal exit
(docs/architecture.md, "Process-wide changes")."""

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
