"""CPU time and memory of a process tree, read from ``/proc`` (Linux), for the node benchmark.

* :func:`tree_cpu_s`: utime + stime of a process and every live descendant (all threads of each:
  ``/proc/<pid>/stat`` sums them), plus cutime + cstime of each, which hold the descendants it
  already reaped. The sum grows with the tree's CPU time as long as every process is reaped by its
  own parent (the producer reaps its workers, a DataLoader joins its workers). Two readings bound a
  window, both over the processes listed at its start (the listing's own scan of ``/proc`` then
  falls outside it); exact to a clock tick per process as long as no process joins the tree inside
  the window, which the callers check and report.
* :func:`tree_memory`: VmRSS (``/proc/<pid>/status``) and Pss (``/proc/<pid>/smaps_rollup``) of the
  same processes, summed. RSS counts a page once per process mapping it (forked workers, the
  shared-memory ring); PSS splits each page between the processes sharing it, so its sum is the
  tree's share of physical memory.
* :func:`reset_peak_rss` / :func:`status_kib`: ``/proc/self/clear_refs`` ("5") sets VmHWM to the
  current VmRSS; VmHWM then holds the highest RSS reached since.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterable

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    """Fields of ``/proc/<pid>/stat`` from field 3 (state) on; the name may hold spaces."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return text[text.rindex(")") + 2 :].split()


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it, parents before children."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                children.setdefault(int(_stat(int(name))[1]), []).append(int(name))
            except (OSError, IndexError, ValueError):  # exited while we looked
                continue
    tree = [root]
    for pid in tree:  # grows while it is walked: breadth first
        tree.extend(children.get(pid, ()))
    return tree


def tree_cpu_s(pids: Iterable[int]) -> float:
    """CPU seconds so far of the processes ``pids`` (a tree from :func:`descendants`, listed once
    before the window so that its own scan of ``/proc`` falls outside it); see the module's note."""
    ticks = 0
    for pid in pids:
        try:
            ticks += sum(int(x) for x in _stat(pid)[11:15])  # utime, stime, cutime, cstime
        except OSError:  # reaped since: its time is in its parent's cutime/cstime now
            continue
    return ticks / CLOCK_TICKS


def _field_kib(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0  # gone, or a zombie (no memory left)


def tree_memory(root: int) -> dict[str, int]:
    """Summed VmRSS and Pss (KiB) of ``root``'s tree, and how many processes it holds."""
    pids = descendants(root)
    return {
        "rss_kib": sum(_field_kib(f"/proc/{p}/status", "VmRSS") for p in pids),
        "pss_kib": sum(_field_kib(f"/proc/{p}/smaps_rollup", "Pss") for p in pids),
        "processes": len(pids),
    }


def status_kib(key: str) -> int:
    """A ``/proc/self/status`` figure in KiB (VmRSS, VmHWM)."""
    return _field_kib("/proc/self/status", key)


def reset_peak_rss() -> None:
    """Set this process's VmHWM to its current VmRSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def own_cpu_s() -> float:
    """utime + stime of this process (every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def children_cpu_s() -> float:
    """utime + stime of this process's reaped descendants (each reaped by its own parent)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_rusage_s() -> float:
    return own_cpu_s() + children_cpu_s()
