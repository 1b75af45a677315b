"""Targets of the same-transport benchmark judged across launches: each launch (a fresh set of
processes) gives one figure per method, its median over the launch's repeats; a side is the
min / median / max of those figures over the launches, and a ratio is claimed only where the two
sides' ranges do not overlap ("not separated" otherwise)."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.flash_overlap.overlap_report import LABELS, MIN_RATIO

TP_TARGETS = (("megatron_core_p2p", 0.5), ("te_split_p2p", 0.7))
"""Flash-Overlap's exposed communication <= this fraction of each baseline's (same transport)."""
UP_TARGETS = (("distributed_attention_p2p", 0.85), ("distributed_attention_sp_stream_p2p", 0.9))
"""UP step <= this fraction of each baseline's (same transport)."""
UP_OURS = ("ulysses_flash_overlap", "ulysses_group_major")


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def separated(a: dict[str, float], b: dict[str, float]) -> bool:
    return a["max"] < b["min"] or b["max"] < a["min"]


def _row(
    case: str, target: str, limit: float, ours: list[float], theirs: list[float], ratio: list[float]
) -> dict:
    o, t = spread(ours), spread(theirs)
    apart = separated(o, t)
    value = o["median"] / t["median"] if t["median"] > 0 else None
    hit = apart and value is not None and o["median"] < t["median"] and value <= limit
    applies = statistics.median(ratio) >= MIN_RATIO
    result = (
        ("hit" if hit else "missed" if apart else "not separated") if applies else "n/a (T_comm < 0.3 T_comp)"
    )
    return {
        "case": case, "target": target, "ours_s": o, "baseline_s": t, "launches": len(ours),
        "comm_over_comp": spread(ratio), "separated": apart, "value": value if apart else None,
        "result": result,
    }  # fmt: skip


def targets_across(tp_runs: list[list[list[dict]]], up_runs: list[list[list[dict]]]) -> list[dict[str, Any]]:
    """``tp_runs[size][launch]`` / ``up_runs[size][launch]``: the summaries of one launch."""
    rows = []
    for runs in tp_runs:
        for i, first in enumerate(runs[0]):
            cases = [launch[i] for launch in runs]
            ours = [c["methods"]["flash_overlap"]["exposed_per_repeat_s"]["median"] for c in cases]
            ratio = [c["comm_over_comp"]["p2p"] for c in cases]
            for base, limit in TP_TARGETS:
                theirs = [c["methods"][base]["exposed_per_repeat_s"]["median"] for c in cases]
                case = f"TP={first['tp']} {first['block']} {first['regime']}"
                target = f"exposed <= {limit}x {LABELS[base]}"
                rows.append(_row(case, target, limit, ours, theirs, ratio))
    for runs in up_runs:
        for i, first in enumerate(runs[0]):
            cases = [launch[i] for launch in runs]
            ratio = [c["comm_over_comp"]["p2p"] for c in cases]
            for method in UP_OURS:
                ours = [c["methods"][method]["step_s"]["median"] for c in cases]
                for base, limit in UP_TARGETS:
                    theirs = [c["methods"][base]["step_s"]["median"] for c in cases]
                    case = f"UP SP={first['sp']} {first['regime']}: {LABELS[method]}"
                    rows.append(_row(case, f"step <= {limit}x {LABELS[base]}", limit, ours, theirs, ratio))
    return rows


def _ms(s: dict[str, float]) -> str:
    return f"{s['median'] * 1e3:.1f} ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f})"


def targets_markdown(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| case | T_comm/T_comp (P2P) | target | launches | ours ms | baseline ms | ratio | result |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        c = r["comm_over_comp"]
        value = "not separated" if r["value"] is None else f"{r['value']:.2f}"
        lines.append(
            f"| {r['case']} | {c['median']:.2f} ({c['min']:.2f}-{c['max']:.2f}) | {r['target']} | {r['launches']} "
            f"| {_ms(r['ours_s'])} | {_ms(r['baseline_s'])} | {value} | {r['result']} |"
        )
    return lines
