"""CPU time and memory of a process tree, read from ``/proc`` (Linux), for the node benchmark.

Method in full: benchmarks/results/methods.md, `benchmarks.data_loader.node_proc`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return int(text[text.rindex(")") + 2 :].split()[1])  # the name may hold spaces and ')'


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it, parents before children."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                children.setdefault(_ppid(int(name)), []).append(int(name))
            except (OSError, IndexError, ValueError):  # exited while we looked
                continue
    tree = [root]
    for pid in tree:  # grows while it is walked: breadth first
        tree.extend(children.get(pid, ()))
    return tree


def cpu_ns(pids: Iterable[int]) -> dict[tuple[int, int], int]:
    """Nanoseconds on CPU so far of every live thread of ``pids``, keyed by (pid, tid)."""
    out: dict[tuple[int, int], int] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # the process is gone
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    out[(pid, int(tid))] = int(f.read().split()[0])
            except (OSError, IndexError, ValueError):  # the thread ended while we looked
                continue
    return out


def window_cpu(start: dict[tuple[int, int], int], end: dict[tuple[int, int], int]) -> dict[str, int]:
    """CPU ns between two :func:`cpu_ns` readings (see the module's note), and the threads that
    ended inside the window (their time after ``start`` is missing) or began in it."""
    spent = sum(ns - start.get(key, 0) for key, ns in end.items())
    return {
        "cpu_ns": spent,
        "lost_threads": sum(1 for key in start if key not in end),
        "new_threads": sum(1 for key in end if key not in start),
    }


def _rollup_kib(pid: int) -> dict[str, int]:
    out = {"Rss": 0, "Pss": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in out:
                    out[key] = int(line.split()[1])
    except OSError:  # gone, or a zombie (no memory left)
        pass
    return out


def tree_memory(pids: Iterable[int]) -> dict[str, int]:
    """Summed Rss and Pss (KiB, ``smaps_rollup``) of ``pids``, and how many processes they are."""
    pids = list(pids)
    rollups = [_rollup_kib(p) for p in pids]
    return {
        "rss_kib": sum(r["Rss"] for r in rollups),
        "pss_kib": sum(r["Pss"] for r in rollups),
        "processes": len(pids),
    }


def status_kib(key: str) -> int:
    """A ``/proc/self/status`` figure in KiB (VmRSS, VmHWM)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak_rss() -> None:
    """Set this process's VmHWM to its current VmRSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
