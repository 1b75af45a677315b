"""The Megatron-DeepSpeed layer benchmark's report: a ratio only where the launches' ranges part."""

from __future__ import annotations

from benchmarks.studies.flash_overlap.mds_layer import launch_step_ms, report

ARGS = {"hidden": 768, "heads": 12, "ffn": 3072, "seq": 384, "batch": 1, "mbit": 400.0, "repeats": 3}
ARGS |= {"iters": 8, "warmup": 2}
TWIN = [100.0, 100.0, 100.0]


def _result(stock: list[float], on_p2p: list[float], ours: list[float]) -> dict:
    steps = {"stock": stock, "stock_on_p2p": on_p2p, "flash_overlap": ours, "compute_only": TWIN}
    return {
        "args": ARGS,
        "load_average": [1.0, 1.5],
        "step_ms": steps,
        "exposed_ms": {k: [s - c for s, c in zip(v, TWIN)] for k, v in steps.items() if k != "compute_only"},
    }


def test_separated_ranges_give_the_ratio_of_medians_and_overlapping_ones_nothing():
    table = report(_result([300, 310, 320], [250, 315, 330], [200, 205, 210]))
    assert "| stock | 310.0 (300.0-320.0) | 210.0 (200.0-220.0) |" in table
    assert "exposed time against stock's: 0.50x." in table  # 105 / 210
    assert "exposed time against stock_on_p2p's: 0.49x." in table  # 105 / 215: 150-230 and 100-110 part
    assert "step against stock's: 0.66x." in table  # 205 / 310
    table = report(_result([300, 310, 320], [200, 215, 230], [200, 205, 210]))
    assert "exposed time against stock_on_p2p's: not separated." in table


def test_a_launch_step_is_the_median_after_the_warmup_on_the_last_rank():
    per_rank = [
        {"iteration_ms": []},
        {"iteration_ms": [[1, 900.0], [2, 800.0], [3, 10.0], [4, 30.0], [5, 20.0]]},
    ]
    assert launch_step_ms(per_rank, warmup=2) == 20.0
