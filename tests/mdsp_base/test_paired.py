"""Paired ratios: the geometric mean of per-pair ratios with a t interval on their logs, worked
out by hand; a ratio is a difference only when its interval excludes 1."""

from __future__ import annotations

import math

import pytest

from mdsp_base.paired import paired_ratio, t95


def test_the_t_quantiles_are_the_tables_and_approach_the_normal():
    assert t95(1) == 12.706 and t95(9) == 2.262 and t95(30) == 2.042
    assert t95(60) == pytest.approx(2.000, abs=2e-3) and t95(1000) == pytest.approx(1.962, abs=1e-3)
    with pytest.raises(ValueError, match="2 pairs"):
        t95(0)


def test_ratio_and_interval_from_the_log_ratios_of_each_pair():
    # per-pair ratios 0.8, 0.9, 1.0: logs mean m, standard deviation s, half-width t(2) s / sqrt(3)
    r = paired_ratio([0.8, 1.8, 3.0], [1.0, 2.0, 3.0])
    logs = [math.log(0.8), math.log(0.9), 0.0]
    m = sum(logs) / 3
    s = math.sqrt(sum((x - m) ** 2 for x in logs) / 2)
    half = 4.303 * s / math.sqrt(3)
    assert r.ratio == pytest.approx(math.exp(m))
    assert r.ci95 == pytest.approx((math.exp(m - half), math.exp(m + half)))
    assert r.pairs == 3 and not r.separated and r.verdict().endswith("not separated")


def test_a_steady_gain_is_separated_and_its_record_names_both_sides():
    r = paired_ratio([0.50, 0.51, 0.49, 0.50], [1.0, 1.0, 1.0, 1.0])
    assert r.separated and r.ci95[1] < 1
    assert r.record("ours", "zero3", "step") == {
        "variant": "ours",
        "baseline": "zero3",
        "metric": "step",
        "ratio": r.ratio,
        "ci95": list(r.ci95),
        "pairs": 4,
    }


@pytest.mark.parametrize("variant, baseline", [([1.0], [1.0]), ([1.0, 2.0], [1.0]), ([1.0, 0.0], [1.0, 1.0])])
def test_unpaired_or_non_positive_samples_are_refused(variant, baseline):
    with pytest.raises(ValueError):
        paired_ratio(variant, baseline)
