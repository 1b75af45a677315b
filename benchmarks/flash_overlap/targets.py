"""Paired comparisons and targets of the same-transport benchmark (``benchmarks.flash_overlap.overlap``).

Each case (a TP block at a TP degree, or UP at an SP degree) pools its pairs over the launches: repeat
i of a launch gives one pair per (variant, baseline), every method having run interleaved with the
others repeat by repeat. A target is met only where the paired ratio's 95 % interval excludes 1 and
the ratio is within the target ("not separated" otherwise).
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.flash_overlap.overlap_report import LABELS, MIN_RATIO
from benchmarks.flash_overlap.paired import compare_all, pooled, separated, verdict

TP_TARGETS = (("megatron_core_p2p", 0.5), ("te_split_p2p", 0.7))
"""Flash-Overlap's exposed communication <= this fraction of each baseline's (same transport)."""
TP_STEP_TARGETS = (("domino_p2p", 1.0),)
"""Flash-Overlap's step < each baseline's (same transport): faster, the interval excluding 1."""
TP_BASELINES = ("megatron_core_p2p", "te_split_p2p", "domino_p2p", "megatron_core")
STEP_ONLY = ("domino_p2p",)
"""Baselines compared by step alone: their compute differs from the compute-only twin's (Domino holds
the whole sequence on every rank), so an exposed time would not be theirs."""
UP_TARGETS = (("distributed_attention_p2p", 0.65), ("distributed_attention_sp_stream_p2p", 0.65))
"""UP step <= this fraction of each baseline's (same transport)."""
UP_OURS = ("ulysses_flash_overlap", "ulysses_group_major")
UP_BASELINES = (
    "distributed_attention_p2p",
    "distributed_attention_sp_stream_p2p",
    "distributed_attention_gloo",
)


def _cases(tp_runs: list[list[list[dict]]], up_runs: list[list[list[dict]]]):
    """(case name, the case's summary in each launch, its (variant, baseline) pairs) of every case."""
    for runs in tp_runs:
        for i, first in enumerate(runs[0]):
            pairs = [("flash_overlap", base) for base in TP_BASELINES]
            pairs += [
                ("flash_overlap_merged", base)
                for base in ("flash_overlap", "megatron_core_p2p", "domino_p2p")
            ]
            yield f"tp{first['tp']}-{first['block']}", [launch[i] for launch in runs], pairs
    for runs in up_runs:
        for i, first in enumerate(runs[0]):
            pairs = [(ours, base) for ours in UP_OURS for base in UP_BASELINES]
            yield f"sp{first['sp']}-ulysses", [launch[i] for launch in runs], pairs


def paired_across(tp_runs: list[list[list[dict]]], up_runs: list[list[list[dict]]]) -> list[dict[str, Any]]:
    """``tp_runs[size][launch]`` / ``up_runs[size][launch]``: the summaries of one launch. Every
    comparison of ours with each baseline, in both metrics, pooled over the launches."""
    entries = []
    for case, summaries, pairs in _cases(tp_runs, up_runs):
        entries += compare_all(case, pooled([s["repeats_s"] for s in summaries]), pairs)
    return [e for e in entries if not (e["baseline"] in STEP_ONLY and e["metric"] == "exposed")]


def targets(
    entries: list[dict[str, Any]], tp_runs: list[list[list[dict]]], up_runs: list[list[list[dict]]]
) -> list[dict[str, Any]]:
    """Each target of each case, judged on its paired comparison."""
    found = {(e["case"], e["variant"], e["baseline"], e["metric"]): e for e in entries}
    rows = []
    for case, summaries, _ in _cases(tp_runs, up_runs):
        ratio = statistics.median(s["comm_over_comp"]["p2p"] for s in summaries)
        if case.startswith("tp"):
            checks = [("flash_overlap", base, limit, "exposed") for base, limit in TP_TARGETS]
            checks += [("flash_overlap", base, limit, "step") for base, limit in TP_STEP_TARGETS]
            checks = [c for c in checks if (case, c[0], c[1], c[3]) in found]
        else:
            checks = [(ours, base, limit, "step") for ours in UP_OURS for base, limit in UP_TARGETS]
        for variant, base, limit, metric in checks:
            e = found[(case, variant, base, metric)]
            if ratio < MIN_RATIO:
                result = f"n/a (T_comm < {MIN_RATIO} T_comp)"
            elif not separated(e):
                result = "not separated" if e["ratio"] is not None else verdict(e)
            else:
                result = "met" if e["ratio"] <= limit else "missed"
            rows.append({
                "case": case, "variant": variant, "target": f"{metric} <= {limit}x {LABELS[base]}",
                "comm_over_comp": ratio, "paired": e, "result": result,
            })  # fmt: skip
    return rows


def targets_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The targets as a table."""
    lines = [
        "| case | T_comm/T_comp (P2P) | ours | target | pairs | ratio [95 % interval] | result |",
        "|---|---:|---|---|---:|---|---|",
    ]
    for r in rows:
        e = r["paired"]
        lines.append(
            f"| {r['case']} | {r['comm_over_comp']:.2f} | {LABELS[r['variant']]} | {r['target']} | {e['pairs']} "
            f"| {verdict(e)} | {r['result']} |"
        )
    return lines
