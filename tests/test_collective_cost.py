"""The collective cost model: hand-derived arithmetic, and the calibrated constants against the
published figures they are fitted to or checked against. The published figures are typed in here
from their sources (docs/hierarchical_zero.md, "Calibration"), never taken from the code."""

from __future__ import annotations

import pytest

from benchmarks.zero import calibration
from deepspeed_ext.zero import collective_cost as cc
from deepspeed_ext.zero.collective_cost import (
    FRONTIER_RCCL,
    Algorithm,
    AlgorithmFit,
    CollectiveCosts,
    Operation,
    fastest,
    for_topology,
    seconds,
)
from plugin_base.topology import LinkClass

AG, RS, AR = Operation.ALL_GATHER, Operation.REDUCE_SCATTER, Operation.ALL_REDUCE
TOY = CollectiveCosts(
    "toy",
    {
        (LinkClass.NODE, Algorithm.RING): AlgorithmFit(step_us=10.0, bus_gbps=1.0),
        (LinkClass.INTER_NODE, Algorithm.RING): AlgorithmFit(
            step_us=1.0, bus_gbps=2.0, small_bus_gbps=0.5, small_limit_bytes=1e6
        ),
        (LinkClass.INTER_NODE, Algorithm.RECURSIVE): AlgorithmFit(step_us=100.0, bus_gbps=4.0),
    },
    nic_gbps=10.0,
)


def test_ring_and_recursive_by_hand():
    # 4 ranks in a node, 4 GB gathered: 3 steps x 10 us + 3 GB at 1 GB/s.
    assert seconds(TOY, AG, Algorithm.RING, 4, 4e9, LinkClass.NODE) == pytest.approx(3 + 30e-6)
    # All-reduce: twice the steps and twice the bus bytes.
    assert seconds(TOY, AR, Algorithm.RING, 4, 4e9, LinkClass.NODE) == pytest.approx(6 + 60e-6)
    # 16 nodes recursive: 4 steps x 100 us + 15/16 x 16 GB at 4 GB/s (one communicator per node).
    assert seconds(TOY, AG, Algorithm.RECURSIVE, 16, 16e9, LinkClass.INTER_NODE) == pytest.approx(
        3.75 + 400e-6
    )


def test_concurrent_communicators_share_the_nics():
    # 8 communicators at 4 GB/s each would want 32 GB/s; the node's NICs carry 10: each gets 1.25.
    t = seconds(TOY, AG, Algorithm.RECURSIVE, 2, 2e9, LinkClass.INTER_NODE, concurrent=8)
    assert t == pytest.approx(1e9 / 1.25e9 + 100e-6)
    # Below the small-message limit the ring runs at its small-message bandwidth.
    assert seconds(TOY, AG, Algorithm.RING, 2, 5e5, LinkClass.INTER_NODE) == pytest.approx(
        2.5e5 / 0.5e9 + 1e-6
    )


def test_fastest_takes_log_steps_for_small_messages_at_many_nodes():
    assert fastest(FRONTIER_RCCL, AG, 48, 1e5, LinkClass.INTER_NODE, 8) == Algorithm.RECURSIVE
    assert fastest(TOY, AG, 4, 1e4, LinkClass.NODE) == Algorithm.RING  # the only one fitted there
    assert for_topology(2) is FRONTIER_RCCL and for_topology(1) is not FRONTIER_RCCL


def test_a_missing_fit_is_refused_by_name():
    with pytest.raises(KeyError, match="no fitted cost for recursive on package"):
        seconds(TOY, AG, Algorithm.RECURSIVE, 2, 1.0, LinkClass.PACKAGE)


# (size KiB, published microseconds, tolerance): ROCm/rccl issue 1490, all_gather_perf, 4 nodes x 8 GCDs.
ISSUE_1490 = [
    (64, 107.5, 0.10),
    (128, 210.0, 0.10),
    (256, 211.1, 0.85),
    (512, 692.3, 0.10),
    (1024, 1456.6, 0.10),
]


@pytest.mark.parametrize(("kib", "published", "tolerance"), ISSUE_1490)
def test_rccl_all_gather_on_32_gcds(kib, published, tolerance):
    assert calibration.issue_1490_us(kib * 1024) == pytest.approx(published, rel=tolerance)


def test_pccl_speedups_over_rccl_at_2048_gcds():
    low, high = calibration.pccl_speedups(AG)
    assert low == pytest.approx(6.0, rel=0.05)  # PCCL v1 abstract: 6-33x for all-gather
    assert high == pytest.approx(33.0, rel=0.05)
    assert calibration.pccl_speedups(RS)[1] == pytest.approx(168.0, rel=0.05)  # v2 abstract


@pytest.mark.parametrize(
    ("operation", "nodes", "nbytes", "published", "tolerance"),
    [
        (AR, 1, 8 * 2**30, 470.0, 0.05),  # nccl-tests 8 x H100 SXM NVLink: 460-480 GB/s
        (AR, 2, 8 * 2**30, 425.0, 0.10),  # H100 SXM + NDR: 400-450 GB/s
        (AR, 32, 2 * 2**30, 340.0, 0.10),  # NVIDIA/nccl issue 1218, 256 H100
        (AG, 32, 2 * 2**30, 200.0, 0.70),  # the same issue's all-gather (RoCE, reported as low)
    ],
)
def test_nccl_bus_bandwidth_on_h100(operation, nodes, nbytes, published, tolerance):
    assert calibration.nccl_bus_gbps(operation, nodes, nbytes) == pytest.approx(published, rel=tolerance)


def test_configured_link_speeds_replace_the_fitted_ones_and_nothing_else():
    """hierarchical_zero.link_bandwidth_gbps: package / node per rank, inter_node the node's NICs."""
    frontier = cc.FRONTIER_RCCL
    assert cc.with_bandwidths(frontier, None) is frontier
    mine = cc.with_bandwidths(frontier, {LinkClass.NODE: 100.0, LinkClass.INTER_NODE: 50.0})
    assert mine.fits[(LinkClass.NODE, cc.Algorithm.RING)].bus_gbps == 100.0
    assert (
        mine.fits[(LinkClass.PACKAGE, cc.Algorithm.RING)]
        == frontier.fits[(LinkClass.PACKAGE, cc.Algorithm.RING)]
    )
    assert mine.nic_gbps == 50.0
    ring = (LinkClass.INTER_NODE, cc.Algorithm.RING)
    assert mine.fits[ring] == frontier.fits[ring]  # per-communicator RCCL figures are measured, kept
