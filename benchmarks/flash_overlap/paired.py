"""Paired comparisons of the Flash-Overlap benchmarks: every method ran interleaved with the others
repeat by repeat, so repeat i of a variant and of its baseline (each the slowest rank's seconds) are a
pair. A comparison is the ratio variant / baseline with its 95 % interval (``mdsp_base.paired``: t on
the per-pair log ratios), pooled over launches; it counts only when the interval excludes 1.

Metrics: ``step`` (forward + backward) and ``exposed`` (the step minus the compute-only twin of the
same repeat: the communication the schedule left exposed). A log ratio needs positive times: where
a repeat's exposed time is not, the comparison is listed as not formed, with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mdsp_base.paired import MIN_PAIRS, PairedRatio, paired_ratio

METRICS = ("exposed", "step")


def pooled(launches: Sequence[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Every method's per-repeat seconds, the launches' repeats one after the other."""
    return {name: [t for launch in launches for t in launch[name]] for name in launches[0]}


def series(repeats: dict[str, list[float]], method: str, metric: str) -> list[float]:
    """``method``'s per-repeat ``metric``: its step, or its step minus the compute-only twin's."""
    if metric == "step":
        return repeats[method]
    return [step - twin for step, twin in zip(repeats[method], repeats["compute_only"])]


def compare(
    case: str, repeats: dict[str, list[float]], variant: str, baseline: str, metric: str
) -> dict[str, Any]:
    """One paired comparison: ``{"case", "variant", "baseline", "metric", "ratio", "ci95", "pairs"}``,
    or, where it cannot be formed, ``ratio`` None and ``why``."""
    ours, theirs = series(repeats, variant, metric), series(repeats, baseline, metric)
    entry: dict[str, Any] = {"case": case, "variant": variant, "baseline": baseline, "metric": metric}
    entry["pairs"] = len(ours)
    if len(ours) < MIN_PAIRS:
        return {**entry, "ratio": None, "ci95": None, "why": f"fewer than {MIN_PAIRS} pairs"}
    negative = sum(1 for value in (*ours, *theirs) if value <= 0)
    if negative:
        return {**entry, "ratio": None, "ci95": None, "why": f"{metric} <= 0 in {negative} of the repeats"}
    r = paired_ratio(ours, theirs)
    return {**entry, "ratio": r.ratio, "ci95": list(r.ci95)}


def compare_all(
    case: str, repeats: dict[str, list[float]], pairs: Sequence[tuple[str, str]]
) -> list[dict[str, Any]]:
    """Every (variant, baseline) of ``pairs`` that ran, in both metrics."""
    return [
        compare(case, repeats, variant, baseline, metric)
        for variant, baseline in pairs
        if variant in repeats and baseline in repeats
        for metric in METRICS
    ]


def verdict(entry: dict[str, Any]) -> str:
    """``0.91x [0.88, 0.94]``, that with ", not separated" when the interval holds 1, or why there
    is no ratio."""
    if entry["ratio"] is None:
        return f"no ratio: {entry['why']}"
    return PairedRatio(entry["ratio"], tuple(entry["ci95"]), entry["pairs"]).verdict()


def separated(entry: dict[str, Any]) -> bool:
    """Whether the comparison was formed and its interval excludes 1."""
    return entry["ratio"] is not None and (entry["ci95"][1] < 1 or entry["ci95"][0] > 1)


def table(entries: Sequence[dict[str, Any]], labels: dict[str, str]) -> list[str]:
    """Markdown rows of paired comparisons."""
    lines = [
        "| case | variant | baseline | metric | pairs | ratio [95 % interval] |",
        "|---|---|---|---|---:|---|",
    ]
    for e in entries:
        lines.append(
            f"| {e['case']} | {labels.get(e['variant'], e['variant'])} | "
            f"{labels.get(e['baseline'], e['baseline'])} | {e['metric']} | {e['pairs']} | {verdict(e)} |"
        )
    return lines
