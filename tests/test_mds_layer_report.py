"""The Megatron-DeepSpeed layer benchmark's report: a ratio only where the launches' ranges part."""

from __future__ import annotations

from benchmarks.flash_overlap.mds_layer import launch_step_ms, report

ARGS = {"hidden": 768, "heads": 12, "ffn": 3072, "seq": 384, "batch": 1, "mbit": 400.0, "repeats": 3}
ARGS |= {"iters": 8, "warmup": 2}


def _result(stock: list[float], ours: list[float], twin: list[float]) -> dict:
    return {
        "args": ARGS,
        "load_average": [1.0, 1.5],
        "step_ms": {"stock": stock, "flash_overlap": ours, "compute_only": twin},
        "exposed_ms": {
            "stock": [s - c for s, c in zip(stock, twin)],
            "flash_overlap": [s - c for s, c in zip(ours, twin)],
        },
    }


def test_separated_ranges_give_the_ratio_of_medians():
    table = report(_result([300, 310, 320], [200, 205, 210], [100, 100, 100]))
    assert "| stock | 310.0 (300.0-320.0) | 210.0 (200.0-220.0) |" in table
    assert "0.50x stock's" in table  # 105 / 210


def test_overlapping_ranges_claim_nothing():
    table = report(_result([300, 310, 320], [250, 315, 330], [100, 100, 100]))
    assert "not separated" in table and "x stock's" not in table


def test_a_launch_step_is_the_median_after_the_warmup_on_the_last_rank():
    per_rank = [
        {"iteration_ms": []},
        {"iteration_ms": [[1, 900.0], [2, 800.0], [3, 10.0], [4, 30.0], [5, 20.0]]},
    ]
    assert launch_step_ms(per_rank, warmup=2) == 20.0
