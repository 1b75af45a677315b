"""The choice of GEMMs per collective: the schedules' timing against the closed form of
docs/flash_overlap.md (per-slice compute c, per-slice transfer p: c + (N-1) max(c, p)), and the
choice moving with the GEMM's fixed tail and the link."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.device import H100
from benchmarks.flash_overlap.slices import (
    best_compute_slices,
    gathered_gemms_end_s,
    scattered_gemms_end_s,
)


@pytest.mark.parametrize("c, p", [(1.0, 0.5), (1.0, 2.0), (0.3, 0.3)])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_one_gemm_per_slice_takes_c_plus_n_minus_1_times_the_longer_of_c_and_p(n, c, p):
    per_slice = lambda slices: slices * c  # noqa: E731  # no tail: work alone
    assert gathered_gemms_end_s(per_slice, n, 0, p) == pytest.approx(c + (n - 1) * max(c, p))
    assert scattered_gemms_end_s(per_slice, n, 0, p) == pytest.approx(c + (n - 1) * max(c, p))


@pytest.mark.parametrize("gemms", [2, 3, 5])
def test_merged_gemms_do_the_same_work_when_transfers_are_free(gemms):
    per_slice = lambda slices: slices * 1.0  # noqa: E731
    for schedule in (gathered_gemms_end_s, scattered_gemms_end_s):
        assert schedule(per_slice, 8, gemms, 0.0) == pytest.approx(8.0)


def test_the_choice_follows_the_gemm_tail_and_the_link():
    layer = dict(tokens=2048, hidden=2048, ffn=8192, n=8)
    no_tail = dataclasses.replace(H100, gemm_tail_us=0.0)
    # no fixed cost per GEMM: slicing is free, the finest overlap wins
    assert best_compute_slices(no_tail, **layer, link_bytes_per_s=450e9)[0] == 0
    # the fitted tail at 2048 tokens on a fast link: fewer, larger GEMMs end first
    gemms, times = best_compute_slices(H100, **layer, link_bytes_per_s=450e9)
    assert 2 <= gemms < 8 and times[gemms] < times[0]
    # a slow link hides every GEMM behind the transfers: merging only lengthens the last one
    assert best_compute_slices(H100, **layer, link_bytes_per_s=5e9)[0] == 0
