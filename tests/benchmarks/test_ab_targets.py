"""Hierarchical ZeRO's targets as the results page judges them, on runs laid out by hand."""

from __future__ import annotations

import json

import pytest

from benchmarks.zero import ab_targets


def _row(name: str, steps: list[float], predicted: float, nic: float) -> dict:
    return {
        "variant": name,
        "ran": True,
        "step_s": steps,
        "predicted_step_s": predicted,
        "nic_mib_per_step": nic,
    }


def _pair(variant: str, baseline: str, ratio: float, lo: float, hi: float) -> dict:
    return {"variant": variant, "baseline": baseline, "metric": "step", "ratio": ratio, "ci95": [lo, hi]}


def _run(ours_step: float, compute: float) -> dict:
    """4 nodes: hpZ(4) the faster hpZ (10 s), ours at ``ours_step``."""
    return {
        "spec": {"nodes": 4, "packages_per_node": 2, "ranks_per_package": 2},
        "contention": 0.1,
        "compute_only_step_s": compute,
        "variants": [
            _row("zero3", [12.0, 12.2], 11.0, 10.0),
            _row("hpZ(2)", [11.0, 11.0], 10.5, 7.5),
            _row("hpZ(4)", [10.0, 10.0], 9.5, 7.5),
            _row(ab_targets.ZEROPP, [13.0, 13.0], 8.0, 2.5),  # the model 38 % short
            _row("ours", [ours_step, ours_step], ours_step * 1.05, 3.0),
            {"variant": "ours, quantized hops", "ran": False, "reason": "not asked for"},
        ],
        "paired": [
            _pair("ours", "hpZ(2)", 0.8, 0.75, 0.85),
            _pair("ours", "hpZ(4)", 0.9, 0.85, 1.02),
            _pair("ours", ab_targets.ZEROPP, 0.7, 0.65, 0.75),
        ],
    }


def test_ours_is_judged_against_the_faster_hpz_and_full_zeropp_by_the_paired_interval():
    judged = ab_targets.judge(_run(ours_step=9.0, compute=7.0))
    assert judged["hpz_best"] == "hpZ(4)"  # the lower median, whatever its pair says
    assert ab_targets._ratio(judged["ours_over_hpz"]) == "0.900 [0.850, 1.020] not separated"
    assert ab_targets._ratio(judged["ours_over_zeropp"]) == "0.700 [0.650, 0.750] met"
    assert ab_targets._ratio(judged["quantized_over_zeropp"]) == "not run"
    assert ab_targets._ratio(_pair("ours", "x", 1.1, 1.05, 1.15)) == "1.100 [1.050, 1.150] missed"
    assert judged["ranks"] == 16 and judged["nic_mib_per_step"]["ours"] == 3.0


def test_the_ceiling_applies_only_where_hpz_exposes_a_fifth_of_its_step():
    exposed = ab_targets.judge(_run(ours_step=7.5, compute=7.0))  # hpZ: (10 - 7) / 10 = 30 % exposed
    assert exposed["hpz_exposed_share"] == pytest.approx(0.3) and exposed["ceiling_applies"]
    assert exposed["ours_over_compute"] == pytest.approx(7.5 / 7.0)  # 1.071: within 1.10
    hidden = ab_targets.judge(_run(ours_step=9.5, compute=8.5))  # hpZ: 15 % exposed
    assert not hidden["ceiling_applies"]


def test_the_worst_model_error_is_the_largest_either_way():
    judged = ab_targets.judge(_run(ours_step=9.0, compute=7.0))
    name, error = judged["worst_model_error"]
    assert name == ab_targets.ZEROPP and error == pytest.approx(8.0 / 13.0 - 1)


def test_the_page_lists_every_run_by_nodes_and_contention(tmp_path):
    paths = []
    for i, (nodes, contention) in enumerate([(8, 0.0), (4, 0.1)]):
        run = _run(ours_step=9.0, compute=7.0)
        run["spec"]["nodes"], run["contention"] = nodes, contention
        paths.append(tmp_path / f"ab_frontier_mi250x_{i}.json")
        paths[-1].write_text(json.dumps(run))
    out = tmp_path / "targets.md"
    ab_targets.main([*map(str, paths), "--out", str(out)])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| frontier | ") and "%" in line]
    assert [r.split(" | ")[1] for r in rows] == [
        "4 (16)",
        "8 (32)",
    ]  # the regime (absent: frontier), then nodes
    assert "zero++ (hpZ + qwZ + qgZ) -38.5% missed" in rows[0]


@pytest.mark.parametrize("busy_at_10_percent, verdict", [(11.0, True), (10.4, False), (None, None)])
def test_a_contention_run_that_slowed_every_op_by_the_factor_is_told_apart(busy_at_10_percent, verdict):
    """Contention slows only what runs beside a collective; a run whose every traced device second
    is (1 + c) times the 0 % run's slowed the device as a whole."""
    judged = []
    for contention, busy in ((0.0, 10.0), (0.1, busy_at_10_percent)):
        run = _run(ours_step=9.0, compute=7.0) | {"contention": contention}
        if busy is not None:
            run["trace"] = {"ours": {"device_busy_s": busy}, "zero3": {"device_busy_s": busy * 0.9}}
        judged.append(ab_targets.judge(run))
    judged[0]["trace"]["zero3"] = {"device_busy_s": 9.0}
    assert ab_targets.uniformly_slowed(judged[1], judged) is verdict
    assert ab_targets.uniformly_slowed(judged[0], judged) is False  # 0 %: nothing to tell
