"""What a traced step (:mod:`.step_trace`) sums to, and its Chrome/Perfetto trace file.

Per rank, from its spans (seconds):

- ``step_s``, ``forward_s``, ``backward_s``, ``optimizer_s``: the step and its phases on the host;
- ``gather_wait_s``: time in ZeRO-3's parameter fetches (what the step waited for its parameters,
  launches included), and ``gather_wait_by_level``: each instant of it charged to ``device`` when
  a thread of the rank slept for a virtual device (the fetching thread itself, or the hop thread
  its gather waits behind), else to the slowest link a gather was on the wire on then, else to
  ``none`` (bookkeeping, queueing, copies);
- ``gather_busy_by_level`` / ``reduce_busy_by_level``: per link class, how long at least one
  gather / reduce-scatter was on the wire: in flight (an asynchronous one from its launch until its
  wait ended) less the stretches its thread slept for a virtual device to produce its input;
- ``device_wait_s``: how long the rank's threads slept for a virtual device (sync points);
- ``reduce_hook_s``: the gradient buckets' reduce-and-partition calls, as the host ran them;
- ``hop_queue_s``: hop operations waiting behind earlier ones on the engine's hop thread or lanes;
- ``copy_s``: the hops' packing and reordering copies;
- ``hooks_host_s``: the host's own time in DeepSpeed's fetch, release and reduce hooks, that is
  those spans less the collectives and waits the same thread blocked in within them;
- ``device_busy_s``: time at least one stream of a virtual device was busy, and ``device_ops``: the
  ops charged to it (0 on real devices; every op costs at least a kernel's floor).
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mdsp_base.spans import Span
from mdsp_base.volume import LINK_CLASSES

_BLOCKING = {"wait", "gather", "reduce", "other", "device wait"}
"""Categories in which a hook's thread is not doing the hook's own work."""
_HOOKS = {"fetch", "release", "reduce hook"}
NO_TRANSFER = "none"
DEVICE = "device"
_INF = float("inf")


def _merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _covered(merged: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] that ``merged`` (disjoint, sorted) covers."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in merged)


def _level(link: str) -> int:
    """Slowness of a link class (unknown links slowest of all)."""
    return LINK_CLASSES.index(link) if link in LINK_CLASSES else len(LINK_CLASSES)


def _pieces(span: Span, holes: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """``span``'s interval less ``holes`` (disjoint, sorted)."""
    out, at = [], span.start
    for a, b in holes:
        if b <= at or a >= span.end:
            continue
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < span.end:
        out.append((at, span.end))
    return out


def _in_flight(
    collectives: Sequence[Span], device_waits: dict[str, list[tuple[float, float]]]
) -> list[tuple[str, float, float]]:
    """(link, start, end) of each collective's time on the wire: its span less the stretches its thread
    slept for a virtual device to produce the input (a collective waits for it as for a GPU's stream)."""
    return [
        (str(c.args.get("link")), a, b)
        for c in collectives
        for a, b in _pieces(c, device_waits.get(c.thread, []))
    ]


def _wait_by_level(
    waits: Sequence[Span],
    gathers: Sequence[tuple[str, float, float]],
    device_waits: Sequence[tuple[float, float]],
) -> dict[str, float]:
    """Each instant of ``waits`` charged to the device when a thread slept for it (``device_waits``),
    else to the slowest link a gather was on the wire on, else to none."""
    out: dict[str, float] = {}
    for wait in waits:
        inside = [g for g in gathers if g[2] > wait.start and g[1] < wait.end]
        near = [d for d in device_waits if d[1] > wait.start and d[0] < wait.end]
        ends = (max(wait.start, min(wait.end, t)) for g in inside for t in g[1:])
        cuts = sorted(
            {wait.start, wait.end, *ends, *(max(wait.start, min(wait.end, t)) for d in near for t in d)}
        )
        for a, b in zip(cuts, cuts[1:]):
            middle = (a + b) / 2
            live = [g[0] for g in inside if g[1] <= middle < g[2]]
            if any(d[0] <= middle < d[1] for d in near):
                name = DEVICE
            else:
                name = max(live, key=_level) if live else NO_TRANSFER
            out[name] = out.get(name, 0.0) + b - a
    return out


def _busy_by_level(in_flight: Sequence[tuple[str, float, float]]) -> dict[str, float]:
    links = sorted({link for link, _, _ in in_flight})
    return {
        link: _covered(_merged((a, b) for name, a, b in in_flight if name == link), -_INF, _INF)
        for link in links
    }


def summarize(rank_spans: Sequence[Span]) -> dict[str, Any]:
    """One rank's step, summed (see the module docstring); its spans must hold one ``step``."""
    steps = [s for s in rank_spans if s.category == "step"]
    if len(steps) != 1:
        raise ValueError(f"a traced step holds one 'step' span, these spans hold {len(steps)}")
    step = steps[0]
    main = [s for s in rank_spans if s.thread == step.thread]

    def total(category: str, among: Sequence[Span] = rank_spans) -> float:
        return sum(s.seconds for s in among if s.category == category)

    def phase(name: str) -> float:
        return sum(s.seconds for s in main if s.category == "phase" and s.name == name)

    slept: dict[str, list[tuple[float, float]]] = {}
    for s in rank_spans:
        if s.category == "device wait":
            slept.setdefault(s.thread, []).append((s.start, s.end))
    slept = {thread: _merged(intervals) for thread, intervals in slept.items()}
    gathers = _in_flight([s for s in rank_spans if s.category == "gather"], slept)
    fetches = [s for s in main if s.category == "fetch"]
    blocking = _merged((s.start, s.end) for s in main if s.category in _BLOCKING)
    hooks = [s for s in main if s.category in _HOOKS]
    return {
        "step_s": step.seconds,
        "forward_s": phase("forward"),
        "backward_s": phase("backward"),
        "optimizer_s": phase("optimizer step"),
        "gather_wait_s": sum(s.seconds for s in fetches),
        "gather_wait_by_level": _wait_by_level(
            fetches, gathers, _merged(i for s in slept.values() for i in s)
        ),
        "gather_busy_by_level": _busy_by_level(gathers),
        "reduce_busy_by_level": _busy_by_level(
            _in_flight([s for s in rank_spans if s.category == "reduce"], slept)
        ),
        "device_wait_s": sum(b - a for intervals in slept.values() for a, b in intervals),
        "reduce_hook_s": total("reduce hook", main),
        "hop_queue_s": total("queue"),
        "copy_s": total("copy"),
        "hooks_host_s": sum(h.seconds - _covered(blocking, h.start, h.end) for h in hooks),
        "device_ops": sum(1 for s in rank_spans if s.category == "device"),
        "device_busy_s": _covered(
            _merged((s.start, s.end) for s in rank_spans if s.category == "device"), -_INF, _INF
        ),
    }


def mean_summary(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The mean rank's summary: each figure, and each level's, averaged over the ranks."""
    out: dict[str, Any] = {}
    for key, value in per_rank[0].items():
        if isinstance(value, dict):
            names = sorted({name for row in per_rank for name in row[key]})
            out[key] = {n: statistics.fmean(row[key].get(n, 0.0) for row in per_rank) for n in names}
        else:
            out[key] = statistics.fmean(row[key] for row in per_rank)
    return out


def chrome_trace(per_rank: Sequence[Sequence[Span]]) -> dict[str, Any]:
    """A Chrome/Perfetto trace: one process per rank, one track per thread (or device stream), each
    rank's times from its own step start (ranks on different hosts share no clock)."""
    events: list[dict[str, Any]] = []
    for rank, rank_spans in enumerate(per_rank):
        origin = min((s.start for s in rank_spans if s.category == "step"), default=0.0)
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        threads: dict[str, int] = {}
        for s in rank_spans:
            if s.thread not in threads:
                threads[s.thread] = len(threads)
                events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": threads[s.thread], "args": {"name": s.thread}})  # fmt: skip
            events.append({
                "ph": "X", "name": s.name, "cat": s.category, "pid": rank, "tid": threads[s.thread],
                "ts": (s.start - origin) * 1e6, "dur": s.seconds * 1e6, "args": s.args,
            })  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def trace_path(directory: Path, variant: str) -> Path:
    """Where a variant's trace goes: its name in letters, digits and ``_``, gzipped JSON (which
    Perfetto and ``chrome://tracing`` open as they are)."""
    return directory / f"{re.sub(r'[^A-Za-z0-9]+', '_', variant).strip('_')}.trace.json.gz"


def write_trace(per_rank: Sequence[Sequence[Span]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as out:
        json.dump(chrome_trace(per_rank), out)


def read_trace(path: Path) -> list[list[Span]]:
    """A trace file back as each rank's spans (times from that rank's step start)."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    per_rank: dict[int, list[Span]] = {}
    for e in events:
        if e["ph"] == "X":
            start = e["ts"] / 1e6
            span = Span(
                e["name"], e["cat"], threads[(e["pid"], e["tid"])], start, start + e["dur"] / 1e6, e["args"]
            )
            per_rank.setdefault(e["pid"], []).append(span)
    return [per_rank[rank] for rank in sorted(per_rank)]


def _levels(figures: dict[str, float]) -> str:
    order = [DEVICE, *(str(link) for link in reversed(LINK_CLASSES)), NO_TRANSFER]
    names = [n for n in order if n in figures] + sorted(set(figures) - set(order))
    return ", ".join(f"{n} {figures[n] * 1e3:.1f}" for n in names) or "-"


def table(summaries: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per variant (the mean rank's traced step, in ms)."""
    head = (
        "| variant | step | device busy | slept for the device | gather wait | gather wait by level | gathers on the wire "
        "| reduce hook | reduce-scatters on the wire | hop queue | copies | hooks' host time |"
    )
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, s in summaries.items():
        rows.append(
            f"| {name} | {s['step_s'] * 1e3:.1f} | {s['device_busy_s'] * 1e3:.1f} | {s['device_wait_s'] * 1e3:.1f} "
            f"| {s['gather_wait_s'] * 1e3:.1f} | {_levels(s['gather_wait_by_level'])} | {_levels(s['gather_busy_by_level'])} "
            f"| {s['reduce_hook_s'] * 1e3:.1f} | {_levels(s['reduce_busy_by_level'])} | {s['hop_queue_s'] * 1e3:.1f} "
            f"| {s['copy_s'] * 1e3:.1f} | {s['hooks_host_s'] * 1e3:.1f} |"
        )
    return "\n".join(rows)
