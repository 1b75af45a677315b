"""What the main job prints besides its own lines: each notice once per job, from rank 0, and of
the third-party warnings only those a user can act on.

megatron-core, torch and DeepSpeed warn on every rank, mostly at import. :func:`quiet` collects
those warnings from the first import on; :meth:`StartupNotices.report` prints on rank 0, once
start-up is done, each actionable warning once and the count of the rest (``-W`` or
``PYTHONWARNINGS`` leaves Python's own warnings alone). Every change goes through the job's
installer: warnings filters, loggers' levels, a root handler printing INFO on rank 0 only, and
DeepSpeed's shared-memory op left unbuilt (:mod:`megatron_ext.integration.shm_comm_op`)."""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from typing import TextIO

from mdsp_base.installer import Installer
from megatron_ext.integration.shm_comm_op import without_shm_comm_op

OWNER = "megatron_ext.trainer.notices"
# Deprecations raised inside the libraries: only their maintainers can act on them.
LIBRARY_CATEGORIES = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
# Deprecations some libraries raise as UserWarning: about the job's own calls, not the user's flags.
DEPRECATION = re.compile(r"\bdeprecated\b", re.IGNORECASE)
# Optional GPU kernels and GPU tuning a run without CUDA cannot use, and DeepSpeed's note that it
# found no GPU.
WITHOUT_CUDA = re.compile(
    r"Transformer Engine|Apex is not installed|apex is not installed|Setting accelerator to CPU"
    r"|CUDA_DEVICE_MAX_CONNECTIONS"
)
# The loggers whose INFO lines the job prints: the suite's notices, and megatron-core's dataset
# lines that Megatron users know; other libraries' INFO (megatron-core's FSDP choice at import...)
# is left out.
INFO_FROM = ("megatron_ext", "deepspeed_ext", "mdsp_base", "megatron.core.datasets", "root")
# megatron-core logs its dataset config as one repr of every field; the flags already say them.
DATASET_CONFIG = re.compile(r" and config=\w+Config\(.*\)$", re.DOTALL)


def _rank() -> int:
    """This process's global rank from the launcher's variables (0 for a lone process)."""
    for name in ("RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


@dataclass
class StartupNotices:
    """Third-party warnings seen so far: those a user can act on (each text once), and the count
    of the others."""

    cuda: bool
    rank: int = field(default_factory=_rank)
    actionable: list[str] = field(default_factory=list)
    hidden: int = 0
    reported: bool = False

    def hides(self, text: str, category: type[Warning] | None) -> bool:
        """Whether a warning of ``category`` (None: a log record) is one the user cannot act on."""
        if category is not None and issubclass(category, LIBRARY_CATEGORIES) or DEPRECATION.search(text):
            return True
        return not self.cuda and WITHOUT_CUDA.search(text) is not None

    def add(self, text: str, category: type[Warning] | None) -> None:
        """Count a hidden warning, keep an actionable one (printed at once after :meth:`report`)."""
        if self.hides(text, category):
            self.hidden += 1
        elif text not in self.actionable:
            self.actionable.append(text)
            if self.reported and self.rank == 0:
                print(f"warning: {text}", file=sys.stderr, flush=True)

    def showwarning(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        """``warnings.showwarning``'s signature: collect instead of printing."""
        self.add(f"{message} ({category.__name__}, {os.path.basename(filename)}:{lineno})", category)

    def report(self) -> None:
        """Print, on rank 0, the actionable warnings and how many others were hidden; later
        actionable warnings print as they come."""
        if self.rank == 0:
            for text in self.actionable:
                print(f"warning: {text}", file=sys.stderr, flush=True)
            if self.hidden:
                print(
                    f"{self.hidden} third-party warnings hidden on rank 0 (deprecations inside the "
                    f"libraries{'' if self.cuda else ', GPU-only kernels and accelerators on a CPU run'}); "
                    "PYTHONWARNINGS=default shows every rank's",
                    flush=True,
                )
        self.reported = True


class _Collect(logging.Filter):
    """Takes third-party log warnings into the notices (counted or kept, not printed)."""

    def __init__(self, notices: StartupNotices) -> None:
        super().__init__()
        self.notices = notices

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING:
            self.notices.add(record.getMessage(), None)
            return False
        return True


class _RankZeroInfo(logging.Filter):
    """INFO and below from rank 0 only (the same notice from every rank is noise) and from the
    loggers in ``INFO_FROM``; megatron-core's dataset config repr cut from its "Building ... splits"
    line."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING and (self.rank != 0 or not record.name.startswith(INFO_FROM)):
            return False
        if isinstance(record.msg, str) and DATASET_CONFIG.search(record.msg):
            record.msg, record.args = DATASET_CONFIG.sub("", record.msg), None
        return True


def quiet(installer: Installer) -> StartupNotices:
    """Collect third-party warnings and keep the job's log to its own lines, from now until the
    installer closes (call it before megatron-core or DeepSpeed is imported, to collect their
    import-time warnings too)."""
    import torch

    notices = StartupNotices(cuda=torch.cuda.is_available())
    installer.enter(OWNER, "Python's warnings filters", warnings.catch_warnings())
    if not sys.warnoptions:
        warnings.simplefilter("default")  # each warning once per place, as Python shows them
        installer.setattr(
            OWNER, "warnings.showwarning collects them", warnings, "showwarning", notices.showwarning
        )
    loggers = [logging.getLogger(name) for name in ("DeepSpeed", "deepspeed", "torch.distributed")]
    if not sys.warnoptions:  # before DeepSpeed's import, which logs its accelerator choice
        _collect_log_warnings(installer, loggers, notices)
    without_shm_comm_op(installer)
    for log in loggers:  # after DeepSpeed's import, which sets its logger's level
        installer.setattr(
            OWNER, "DeepSpeed's and torch.distributed's loggers at WARNING", log, "level", logging.WARNING
        )
    root = logging.getLogger()
    if not root.handlers:  # a host program (or pytest) that logs already keeps its own handlers
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(_RankZeroInfo(notices.rank))
        root.addHandler(handler)
        installer.add(
            OWNER, "a root log handler (INFO from rank 0 only)", lambda: root.removeHandler(handler)
        )
    installer.setattr(OWNER, "the root logger at INFO", root, "level", logging.INFO)
    return notices


def _collect_log_warnings(
    installer: Installer, loggers: list[logging.Logger], notices: StartupNotices
) -> None:
    """``loggers``' warnings go to ``notices`` instead of the log."""
    collect = _Collect(notices)
    for log in loggers:
        log.addFilter(collect)

    def remove() -> None:
        for log in loggers:
            log.removeFilter(collect)

    installer.add(OWNER, "DeepSpeed's and torch.distributed's log warnings collected", remove)
