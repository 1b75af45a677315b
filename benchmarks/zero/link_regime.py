"""A step's regime as dimensionless numbers, per link class: its collectives' messages over the
link's latency x bandwidth product (bandwidth-bound when many times it), the same per algorithm step,
and communication over compute; here for an A/B run's counted collectives under its probe profile.
Frontier's side is the regime study's (benchmarks/studies/zero/regime.py)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from deepspeed_ext.zero.cost.collectives import Algorithm, CollectiveCosts, Operation, algorithm_steps
from deepspeed_ext.zero.cost.profile import Profile
from mdsp_base.topology import LinkClass


@dataclass(frozen=True)
class Message:
    """Launches per step of one collective shape."""

    operation: Operation
    algorithm: Algorithm
    link: LinkClass
    members: int
    nbytes: float
    """Gathered output (all-gather), input (reduce-scatter, all-to-all) or tensor (all-reduce)."""
    count: float


@dataclass(frozen=True)
class LinkRegime:
    """One link class's dimensionless numbers over a step's collectives (count-weighted medians)."""

    messages: float
    """Launches per step on this link."""
    message_over_product: float
    """Message bytes / (step latency x bus bandwidth)."""
    step_over_product: float
    """Bytes one algorithm step moves / (step latency x bus bandwidth)."""
    median_bytes: float
    """The median message."""


def weighted_median(pairs: Iterable[tuple[float, float]]) -> float:
    """Median of values weighted by counts: ``pairs`` of (value, count)."""
    ordered = sorted(pairs)
    total, seen = sum(c for _, c in ordered), 0.0
    for value, count in ordered:
        seen += count
        if seen >= total / 2:
            return value
    raise ValueError("no messages: a link class with no launches has no regime")


def _latency_us(costs: CollectiveCosts, m: Message, profile: Profile | None) -> float:
    """One algorithm step's latency for ``m``: its own fit's, else, where the probe did not resolve
    an intercept (clipped to 0), the same link's all-gather, then its ring (latency belongs to the
    link more than to the operation); else, with a ``profile``, its smallest message's measured time
    per algorithm step on that link (an upper bound: it includes that message's transfer)."""
    for operation, algorithm in (
        (m.operation, m.algorithm),
        (Operation.ALL_GATHER, m.algorithm),
        (m.operation, Algorithm.RING),
        (Operation.ALL_GATHER, Algorithm.RING),
    ):
        try:
            step_us = costs.fit(operation, algorithm, m.link).step_us
        except KeyError:
            continue
        if step_us > 0:
            return step_us
    smallest = [
        t.median / max(1, algorithm_steps(t.algorithm, t.members)) * 1e6
        for t in (profile.timings if profile is not None else [])
        if t.link == m.link and t.nbytes == min(u.nbytes for u in profile.timings if u.link == m.link)
    ]
    if smallest:
        return min(smallest)
    raise ValueError(
        f"no latency fitted or measured on {m.link}: the profile cannot place {m.operation} {m.algorithm}"
    )


def link_regimes(
    messages: Iterable[Message], costs: CollectiveCosts, profile: Profile | None = None
) -> dict[str, LinkRegime]:
    """Per link class, the dimensionless numbers of ``messages`` under ``costs``' fits (and, for a
    latency no fit resolves, ``profile``'s smallest measured messages)."""
    by_link: dict[LinkClass, list[Message]] = {}
    for m in messages:
        if m.members > 1 and m.nbytes > 64:  # a scalar all-reduce (loss, norm) carries no weight
            by_link.setdefault(m.link, []).append(m)
    out = {}
    for link, group in sorted(by_link.items()):
        ratios, per_step = [], []
        for m in group:
            fit = costs.fit(m.operation, m.algorithm, m.link)
            product = _latency_us(costs, m, profile) * 1e-6 * fit.bus_gbps * 1e9
            steps = algorithm_steps(m.algorithm, m.members)
            ratios.append((m.nbytes / product, m.count))
            per_step.append((m.nbytes / max(steps, 1) / product if m.algorithm == Algorithm.RECURSIVE
                             else m.nbytes / m.members / product, m.count))  # fmt: skip
        out[str(link)] = LinkRegime(
            messages=sum(m.count for m in group),
            message_over_product=weighted_median(ratios),
            step_over_product=weighted_median(per_step),
            median_bytes=weighted_median((m.nbytes, m.count) for m in group),
        )
    return out


def measured_messages(calls: Iterable[Mapping]) -> list[Message]:
    """An A/B row's ``calls_per_step`` as messages."""
    return [
        Message(Operation(c["collective"]), Algorithm(c["algorithm"]), LinkClass(c["link"]), c["members"],
                float(c["nbytes"]), float(c["count"]))
        for c in calls
    ]  # fmt: skip


def emulated(rows: Iterable[Mapping], profile: Profile, fallback: CollectiveCosts) -> dict[str, dict]:
    """The emulated cluster's numbers from an A/B run's rows (each with ``calls_per_step`` and
    ``predicted``) under the probe ``profile``'s fits (``fallback`` where it measured nothing)."""
    costs = profile.costs(fallback)
    out = {}
    for row in rows:
        if not row.get("ran") or "predicted" not in row:
            continue
        predicted = row["predicted"]
        out[row["variant"]] = {
            "links": {
                k: vars(v)
                for k, v in link_regimes(measured_messages(row["calls_per_step"]), costs, profile).items()
            },
            "comm_over_compute": predicted["comm_s"] / predicted["compute_s"],
            "measured_comm_over_compute": (statistics.median(row["step_s"]) - predicted["compute_s"])
            / predicted["compute_s"],
        }
    return out
