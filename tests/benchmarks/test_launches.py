"""Kernel launches of the Ulysses block, counted by the benchmark's counter, against the GEMMs the
algorithm issues by hand: per destination group, forward one QKV GEMM (three on Megatron-DeepSpeed's
[q | k | v] weight, plus their concatenation) and one output GEMM; backward one dgrad and one wgrad
per QKV GEMM, one dgrad per group and one wgrad for the output projection."""

from __future__ import annotations

import pytest

from benchmarks.studies.flash_overlap.launches_rank import ulysses_launches


def _count(method: str) -> dict:
    return ulysses_launches(method, seq=32, hidden=64, heads=8, kv_heads=4, head_dim=8)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("method", "qkv_gemms"), [("ulysses_group_major", 1), ("ulysses_qkv_layout", 3)])
def test_ulysses_issues_the_gemms_of_its_weight_layout(run_ranks, world, method, qkv_gemms):
    for counts in run_ranks(world, _count, method, timeout=120):
        assert counts["forward"]["gemm"] == world * (qkv_gemms + 1), counts
        assert counts["backward"]["gemm"] == world * (2 * qkv_gemms + 1) + 1, counts
        assert counts["forward"]["attention"] == 1, counts
