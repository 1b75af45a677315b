"""Paired comparison of two variants timed alternately: the ratio of their times and its 95 %
interval, from the per-pair log ratios (a t interval, so a few noisy pairs widen it honestly).

A ratio counts as a difference only when its interval excludes 1 (:attr:`PairedRatio.separated`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Two-sided 95 % quantiles of Student's t for 1..30 degrees of freedom (any statistics table).
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
MIN_PAIRS = 10
"""Fewest pairs a benchmark reports a ratio from."""


def t95(dof: int) -> float:
    """Two-sided 95 % quantile of Student's t with ``dof`` degrees of freedom."""
    if dof < 1:
        raise ValueError(f"need at least 1 degree of freedom (2 pairs), got {dof}")
    if dof <= len(_T95):
        return _T95[dof - 1]
    z = 1.959964  # beyond the table, the Cornish-Fisher expansion is within 1e-3
    return z + (z**3 + z) / (4 * dof)


@dataclass(frozen=True)
class PairedRatio:
    """A variant's time over a baseline's, from pairs timed side by side."""

    ratio: float
    """Geometric mean of the per-pair ratios (below 1: the variant is faster)."""
    ci95: tuple[float, float]
    """95 % interval of the ratio."""
    pairs: int
    """Pairs it comes from."""

    @property
    def separated(self) -> bool:
        """Whether the interval excludes 1."""
        return self.ci95[1] < 1 or self.ci95[0] > 1

    def record(self, variant: str, baseline: str, metric: str) -> dict[str, Any]:
        """The comparison as results JSON records it: names, metric, ratio, interval and pairs."""
        return {
            "variant": variant,
            "baseline": baseline,
            "metric": metric,
            "ratio": self.ratio,
            "ci95": list(self.ci95),
            "pairs": self.pairs,
        }

    def verdict(self) -> str:
        """``0.91x [0.88, 0.94]`` or, when the interval holds 1, that with "not separated"."""
        text = f"{self.ratio:.3f}x [{self.ci95[0]:.3f}, {self.ci95[1]:.3f}]"
        return text if self.separated else f"{text}, not separated"


def paired_ratio(variant: Sequence[float], baseline: Sequence[float]) -> PairedRatio:
    """The ratio ``variant / baseline`` of pairs measured side by side (element i of each list
    from the same round); both lists hold positive times of equal length >= 2."""
    if len(variant) != len(baseline) or len(variant) < 2:
        raise ValueError(
            f"need equally many paired samples, at least 2: got {len(variant)} and {len(baseline)}"
        )
    if min(*variant, *baseline) <= 0:
        raise ValueError("paired times must be positive")
    logs = [math.log(v / b) for v, b in zip(variant, baseline)]
    mean = statistics.fmean(logs)
    half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return PairedRatio(math.exp(mean), (math.exp(mean - half), math.exp(mean + half)), len(logs))
