"""The collective cost model against hand-derived arithmetic, and Frontier's constants against the
hardware figures they are documented from (typed in here from OLCF's Frontier user guide, never
taken from the code). How the model compares with published measurements is reported, not tested:
``python -m benchmarks.studies.zero.project`` (held out: nothing is fitted to them)."""

from __future__ import annotations

import pytest

from deepspeed_ext.zero.cost import collectives as cc
from deepspeed_ext.zero.cost.collectives import (
    FRONTIER_RCCL,
    Algorithm,
    AlgorithmFit,
    CollectiveCosts,
    Operation,
    fastest,
    for_topology,
    seconds,
)
from mdsp_base.topology import LinkClass

AG, RS, AR = Operation.ALL_GATHER, Operation.REDUCE_SCATTER, Operation.ALL_REDUCE
TOY = CollectiveCosts(
    "toy",
    {
        (LinkClass.NODE, Algorithm.RING): AlgorithmFit(step_us=10.0, bus_gbps=1.0),
        (LinkClass.INTER_NODE, Algorithm.RING): AlgorithmFit(step_us=1.0, bus_gbps=2.0),
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


def test_fastest_takes_log_steps_for_small_messages_at_many_nodes():
    assert fastest(FRONTIER_RCCL, AG, 48, 1e5, LinkClass.INTER_NODE, 8) == Algorithm.RECURSIVE
    assert fastest(TOY, AG, 4, 1e4, LinkClass.NODE) == Algorithm.RING  # the only one fitted there
    assert for_topology(2) is FRONTIER_RCCL and for_topology(1) is not FRONTIER_RCCL


def test_a_missing_fit_is_refused_by_name():
    with pytest.raises(KeyError, match="no fitted cost for recursive on package"):
        seconds(TOY, AG, Algorithm.RECURSIVE, 2, 1.0, LinkClass.PACKAGE)


def test_frontier_is_its_documented_hardware_with_the_uncertain_inputs_swept():
    # A ring all-gather of 1 GiB over 48 nodes, 8 rank-aligned rings per node at once: 47 steps of
    # 10 us; 47/48 GiB per rank, each ring at one NIC's 25 GB/s x 0.9, but the node's 4 NICs
    # (90 GB/s) shared by 8 rings: 11.25 GB/s each.
    t = seconds(FRONTIER_RCCL, AG, Algorithm.RING, 48, 2**30, LinkClass.INTER_NODE, concurrent=8)
    assert t == pytest.approx(47 * 10e-6 + 2**30 * 47 / 48 / 11.25e9)
    # Point-to-point pairs: half an MI250X's NIC each, log2(48) -> 6 steps.
    t = seconds(FRONTIER_RCCL, AG, Algorithm.RECURSIVE, 48, 2**30, LinkClass.INTER_NODE)
    assert t == pytest.approx(6 * 10e-6 + 2**30 * 47 / 48 / 11.25e9)
    # In a node: the package's 200 GB/s and the node's 50 GB/s per rank, 2 and 4 us steps.
    assert seconds(FRONTIER_RCCL, AG, Algorithm.RING, 2, 1e9, LinkClass.PACKAGE) == pytest.approx(
        2e-6 + 0.5e9 / 200e9
    )
    assert seconds(FRONTIER_RCCL, RS, Algorithm.RING, 8, 1e9, LinkClass.NODE) == pytest.approx(
        28e-6 + 7 / 8 * 1e9 / 50e9
    )
    # The swept inputs: the projection's low ends give the same arithmetic with 1 us and 5.84 GB/s.
    low = cc.frontier_costs(ring_step_us=1.0, ring_gbps=cc.FRONTIER_RING_GBPS_LOW)
    t = seconds(low, AG, Algorithm.RING, 4, 4e9, LinkClass.INTER_NODE)
    assert t == pytest.approx(3e-6 + 3e9 / 5.84e9)


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
