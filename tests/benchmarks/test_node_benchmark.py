"""The node benchmark's own pieces (``benchmarks.data_loader.node*``), without launching ranks: the
/proc readings, the launch order, the figures of a launch, the baseline subtraction, when a ratio is
stated, the targets, the report and the summary panel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks.data_loader import node_report, node_storage
from benchmarks.data_loader.node import order
from benchmarks.data_loader.node_proc import cpu_ns, descendants, tree_memory, window_cpu
from benchmarks.summary_plot import plot_summary


def _spin(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _wait_until_gone(pid: int, tid: int) -> None:
    """Wait, bounded, until the kernel drops a joined thread from ``/proc/<pid>/task``: Python's
    ``join`` returns when the thread's code ended, a moment before the OS thread exits."""
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/task/{tid}").exists():
        assert time.monotonic() < deadline, f"thread {tid} still in /proc 10 s after its join"
        time.sleep(0.001)


def test_cpu_ns_counts_threads_in_nanoseconds() -> None:
    me = os.getpid()
    main = (me, threading.get_native_id())
    start = cpu_ns([me])
    assert main in start
    _spin(0.05)
    born: list[int] = []
    worker = threading.Thread(target=lambda: (born.append(threading.get_native_id()), _spin(0.05)))
    worker.start()
    worker.join()  # born and ended inside the window: neither reading sees it
    _wait_until_gone(me, born[0])
    end = cpu_ns([me])
    assert end[main] - start[main] >= 0.05e9  # this thread's 50 ms, in nanoseconds
    assert (me, born[0]) not in start and (me, born[0]) not in end
    spent = window_cpu(start, end)
    # The window counts every thread of the process seen at both ends (other threads of the test
    # process may run too, so no upper bound): this one's 50 ms at least, none lost, none new.
    assert spent["cpu_ns"] >= end[main] - start[main]
    assert spent["lost_threads"] == 0 and spent["new_threads"] == 0
    alive, spun = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (_spin(0.05), spun.set(), alive.wait()))
    worker.start()
    try:
        # its 50 ms of CPU may take far longer on a busy host: wait for them, bounded
        assert spun.wait(timeout=120), "the worker thread got no 50 ms of CPU in 120 s"
        spent = window_cpu(start, cpu_ns([me]))
        assert spent["new_threads"] == 1  # born in the window: all its time counts
        assert spent["cpu_ns"] > 0.09e9
    finally:
        alive.set()
        worker.join()
    assert window_cpu({(1, 1): 5, (1, 2): 7}, {(1, 1): 9})["lost_threads"] == 1


def test_tree_reads_a_child_and_its_memory() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        tree = descendants(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree
        memory = tree_memory(tree)
        assert memory["processes"] == len(tree)
        assert memory["rss_kib"] >= memory["pss_kib"] > 0
    finally:
        child.kill()
        child.wait()


def test_every_repetition_runs_each_case_once_in_a_moving_order() -> None:
    tps = [1, 2, 4, 8]
    runs = [order(tps, rep) for rep in range(5)]
    every = sorted([(tp, s) for tp in tps for s in node_report.SCHEMES] + [(1, "none")])
    assert all(sorted(r) == every for r in runs)
    firsts = [next(s for tp, s in r if s != "none") for r in runs]
    assert firsts[:2] == ["megatron", "shm"]  # the path that goes first alternates
    assert len({r.index((1, "none")) for r in runs}) == 5  # the baseline moves


def _rank(rank: int, tp_rank: int, wait_ms: float, cpu_ms: float, processes: int = 1) -> dict:
    steps = 10
    return {
        "rank": rank,
        "tp_rank": tp_rank,
        "result": {
            "wait_s": [wait_ms / 1e3] * steps,
            "step_s": [0.1 + wait_ms / 1e3] * steps,
            "window_s": steps * (0.1 + wait_ms / 1e3),
            "cpu_ns": int(cpu_ms * 1e6),
            "lost_threads": 0,
            "new_threads": 0,
            "processes": processes,
            "processes_born": 0,
            "processes_gone": 0,
            "before": {"rss_kib": 1024, "pss_kib": 512, "processes": 1},
            "during": {"rss_kib": 2048, "pss_kib": 1024, "processes": processes},
        },
    }


def _launch(index: int, tp: int, scheme: str, wait_ms: float, cpu_ms: float, processes: int = 1) -> dict:
    ranks = [_rank(r, r % tp, wait_ms, cpu_ms, processes if r % tp == 0 else 1) for r in range(8)]
    return {
        "index": index,
        "repeat": 0,
        "tp": tp,
        "scheme": scheme,
        "load_before": [1.0, 1.0, 1.0],
        "load_after": [2.0, 1.0, 1.0],
        "launch_s": 20.0,
        **node_report.launch_figures(ranks, {"bytes": 2**20, "ios": 10}, 8),
    }


def test_launch_figures_sum_the_node_and_subtract_the_baseline() -> None:
    megatron = _launch(0, 2, "megatron", wait_ms=20.0, cpu_ms=30.0, processes=3)
    f = megatron["figures"]
    assert f["processes"] == 4 * 3 + 4
    assert f["processes_off_tp0"] == 0  # TP rank 1 of each group holds no worker
    assert f["wait_ms"] == pytest.approx(20.0) and f["step_ms"] == pytest.approx(120.0)
    assert f["cpu_us_per_step"] == pytest.approx(8 * 30_000 / 10)
    assert f["rss_added_mib"] == pytest.approx(8.0) and f["device_read_mib"] == 1.0
    base = _launch(1, 1, "none", wait_ms=0.0, cpu_ms=10.0)  # 8 x 10 ms over 1 s windows
    rate = node_report.subtract_baseline([megatron, base])
    assert rate == pytest.approx(80_000)
    # 24 ms per step on the node, less 80 ms/s over a 1.2 s window of 10 steps
    assert f["data_cpu_us_per_step"] == pytest.approx(24_000 - 80_000 * 1.2 / 10)


def _table(ours: list[tuple[float, float]], theirs: list[tuple[float, float]]) -> list[dict]:
    launches = [_launch(i, 1, "shm", w, c) for i, (w, c) in enumerate(ours)]
    launches += [_launch(10 + i, 1, "megatron", w, c) for i, (w, c) in enumerate(theirs)]
    launches.append(_launch(20, 1, "none", 0.0, 1.0))
    node_report.subtract_baseline(launches)
    return node_report.rows(launches, [1])


def test_a_ratio_is_stated_only_for_separated_ranges() -> None:
    assert node_report.separated([1.0, 2.0], [3.0, 4.0])
    assert not node_report.separated([1.0, 3.5], [3.0, 4.0])
    assert not node_report.separated([1.0], [3.0])  # one launch a side: no range
    assert node_report.ratio_cell(node_report.compare([1.0, 3.5], [3.0, 4.0])) == "not separated"
    assert node_report.ratio_cell(node_report.compare([1.0, 2.0], [3.0, 5.0])) == "0.38x"


def test_targets_need_separated_ranges_and_half_of_megatron() -> None:
    table = _table([(1.0, 10.0), (1.2, 11.0)], [(20.0, 40.0), (25.0, 45.0)])
    met = node_report.targets(table, cold=True, throttled=True)
    assert [t["met"] for t in met] == [True, True]
    table = _table([(1.0, 30.0), (1.2, 46.0)], [(20.0, 40.0), (25.0, 45.0)])  # CPU ranges overlap
    wait, cpu = node_report.targets(table, cold=True, throttled=True)
    assert wait["met"] and not cpu["met"] and not cpu["separated"]
    table = _table([(15.0, 10.0), (16.0, 11.0)], [(20.0, 40.0), (25.0, 45.0)])  # separated, 0.7x
    wait, _ = node_report.targets(table, cold=True, throttled=True)
    assert wait["separated"] and not wait["met"]


def _results(table: list[dict], throttled: bool = True) -> dict:
    settings = dict(
        ranks=8, mbs=4, seq_length=4096, step_ms=100.0, steps=10, warmup=5, repeats=2, num_workers=2,
        node_workers=1, slots=4, cold=True, command="python -m benchmarks.data_loader.node",
        cpus=2, corpus_bytes=2**27, wall_s=100.0,
    )  # fmt: skip
    layouts = {
        "storage": "throttled: test" if throttled else node_storage.plain("/tmp/x", "test").label,
        "baseline_cpu_us_per_s": 80_000.0,
        "rows": table,
        "comparisons": node_report.comparisons(table),
        "targets": node_report.targets(table, True, throttled),
    }
    return {"settings": settings, "layouts": layouts, "errors": {}}


def test_report_says_not_separated_and_lists_every_launch() -> None:
    table = _table([(1.0, 30.0), (1.2, 46.0)], [(20.0, 40.0), (25.0, 45.0)])
    text = node_report.markdown(_results(table))
    assert "not separated" in text and "**missed**" in text and "**met**" in text
    assert text.count("| 1 x 8 |") == 3  # both paths and the baseline
    assert "| 4 | 1 | ranks only (sleep, no loader) | 1.00 1.00 1.00 | 2.00 1.00 1.00 |" in text
    unthrottled = node_report.markdown(_results(table, throttled=False))
    assert "unthrottled (test)" in unthrottled and "**not evaluated**" in unthrottled


def test_summary_panel_reads_the_results(tmp_path: Path) -> None:
    table = _table([(1.0, 10.0), (1.2, 11.0)], [(20.0, 40.0), (25.0, 45.0)])
    (tmp_path / "data_loader").mkdir()
    (tmp_path / "data_loader" / "node.json").write_text(json.dumps(_results(table)))
    assert plot_summary(tmp_path, "loopback") == tmp_path / "summary.png"
