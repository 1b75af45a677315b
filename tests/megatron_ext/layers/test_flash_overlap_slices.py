"""Merged compute slices (``flash_overlap.compute_slices``): the same transfers, fewer and larger
GEMMs. At k GEMMs a rank computes its own slice, then the other ranks' slices in k - 1 runs of
consecutive steps (one more GEMM where a run's rows wrap past the sequence's end), and the results
are the dense computation's."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.layers.config import FlashOverlapConfig
from megatron_ext.layers.p2p.overlap import step_runs

TP, ROWS, COLS = 4, 3, 5


def test_steps_are_cut_into_runs_with_the_longer_runs_last():
    assert step_runs(8, 0) == [range(s, s + 1) for s in range(1, 8)]
    assert step_runs(8, 8) == step_runs(8, 0)
    assert step_runs(8, 4) == [range(1, 3), range(3, 5), range(5, 8)]
    assert step_runs(8, 2) == [range(1, 8)]
    assert step_runs(4, 3) == [range(1, 2), range(2, 4)]


def test_one_gemm_is_refused_by_name():
    with pytest.raises(ValueError, match="leaves nothing to overlap"):
        FlashOverlapConfig(enabled=True, compute_slices=1)
    from megatron_ext.layers.p2p.link import OverlapGroup

    with pytest.raises(ValueError, match="compute_slices=1 of layer 'fc1'"):
        OverlapGroup(None, name="fc1", compute_slices=1)


def _gather_and_scatter(mode: str, compute_slices: int) -> dict:
    """Rank r holds rows r of X; returns the gathered X, Y = X W^T's rows, the reduce-scattered sum
    of every rank's partial products of its slice, and the GEMMs each schedule ran."""
    import torch.distributed as dist

    from megatron_ext.layers.p2p.link import OverlapGroup
    from megatron_ext.layers.p2p.overlap import all_gather_compute, compute_reduce_scatter, span

    r = dist.get_rank()
    gemms: list[str] = []
    og = OverlapGroup(
        dist.group.WORLD,
        mode,
        name="test",
        compute_slices=compute_slices,
        trace=lambda kind, label, *_: gemms.append(label.split(" ", 1)[1]) if kind == "compute" else None,
    )
    g = torch.Generator().manual_seed(7)
    x_full = torch.randn(TP * ROWS, COLS, generator=g, dtype=torch.float64)
    w = torch.randn(COLS, COLS, generator=g, dtype=torch.float64)
    gathered = torch.empty_like(x_full)
    y = torch.empty_like(x_full)
    all_gather_compute(
        x_full[r * ROWS : (r + 1) * ROWS],
        lambda js, xj: torch.mm(xj, w.t(), out=span(y, js, TP)),
        og,
        gathered,
    )
    gather_gemms, gemms[:] = list(gemms), []
    # each rank's partial: its own weights (scaled by its rank) applied to every row of Y
    summed = compute_reduce_scatter(lambda js: span(y, js, TP) @ (w * (r + 1)), og)
    return {
        "gathered": gathered,
        "y": y,
        "summed": summed,
        "gather_gemms": gather_gemms,
        "scatter_gemms": gemms,
    }


@pytest.mark.parametrize("mode", ["direct", "ring"])
@pytest.mark.parametrize("compute_slices", [0, 2, 3])
def test_merged_slices_give_the_dense_results_in_fewer_gemms(run_ranks, mode, compute_slices):
    per_rank = run_ranks(TP, _gather_and_scatter, mode, compute_slices)
    g = torch.Generator().manual_seed(7)
    x_full = torch.randn(TP * ROWS, COLS, generator=g, dtype=torch.float64)
    w = torch.randn(COLS, COLS, generator=g, dtype=torch.float64)
    y = x_full @ w.t()
    total = y @ (w * sum(range(1, TP + 1)))
    for r, got in enumerate(per_rank):
        assert torch.equal(got["gathered"], x_full)
        torch.testing.assert_close(got["y"], y, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["summed"], total[r * ROWS : (r + 1) * ROWS], rtol=1e-12, atol=1e-12)
        for schedule in ("gather_gemms", "scatter_gemms"):
            want = TP if compute_slices == 0 else compute_slices
            # a run whose rows wrap past the sequence's end is two GEMMs
            assert want <= len(got[schedule]) <= want + 1, (r, schedule, got[schedule])
        assert got["gather_gemms"][0] == f"slice {r}"  # the own slice first, no wait
        assert got["scatter_gemms"][-1] == f"slice {r}"  # the own slice last
