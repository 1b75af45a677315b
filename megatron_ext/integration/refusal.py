"""How a start-up refusal reaches the user, as the main job gives it: one ``error:`` line and exit
status 2, no traceback.

Every rank refuses, but only the first rank of each node prints the line: the flags and the
configuration are every rank's, while a node's environment (its ``/dev/shm``, its network) may
differ from another node's, so each node says what it found.
"""

from __future__ import annotations

import os
import sys
import time

EXIT_REFUSED = 2
"""The exit status of a refused job (argparse's for bad flags)."""
QUIET_RANK_WAIT_S = 5.0
"""How long a rank that does not print waits before it exits: torchrun ends every other rank as
soon as one exits, and the node's first rank may be a moment behind, still to print the line."""


def first_rank_of_node() -> bool:
    """Whether this process is its node's first rank (torchrun's ``LOCAL_RANK``, srun's
    ``SLURM_LOCALID``; a lone process is)."""
    return os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0"


def refuse(error: Exception) -> int:
    """Print ``error`` as the node's one ``error:`` line (its other ranks wait
    :data:`QUIET_RANK_WAIT_S` instead); returns the exit status."""
    if first_rank_of_node():
        print(f"error: {error}", file=sys.stderr, flush=True)
    else:
        time.sleep(QUIET_RANK_WAIT_S)
    return EXIT_REFUSED
