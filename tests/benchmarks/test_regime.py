"""The regime a step runs in: its collectives' messages over the links' latency x bandwidth, worked
out by hand, and the collectives a plan launches, counted by hand from the model's modules."""

from __future__ import annotations

import pytest

from benchmarks.studies.zero.regime import frontier_messages
from benchmarks.zero.link_regime import Message, link_regimes, weighted_median
from deepspeed_ext.zero.cost.collectives import Algorithm as A
from deepspeed_ext.zero.cost.collectives import AlgorithmFit, CollectiveCosts
from deepspeed_ext.zero.cost.collectives import Operation as Op
from deepspeed_ext.zero.cost.projection import Candidate, Scheme
from deepspeed_ext.zero.cost.workload import Buckets, Model, System
from mdsp_base.topology import LinkClass as L

COSTS = CollectiveCosts(
    "hand",
    fits={
        (L.PACKAGE, A.RING): AlgorithmFit(step_us=2.0, bus_gbps=200.0),  # product 400 KB
        (L.NODE, A.RING): AlgorithmFit(step_us=4.0, bus_gbps=50.0),  # 200 KB
        (L.INTER_NODE, A.RING): AlgorithmFit(step_us=10.0, bus_gbps=25.0),  # 250 KB
        (L.INTER_NODE, A.RECURSIVE): AlgorithmFit(step_us=10.0, bus_gbps=12.5),  # 125 KB
    },
    nic_gbps=100.0,
)


def test_a_message_over_latency_times_bandwidth_and_per_algorithm_step():
    numbers = link_regimes(
        [
            Message(Op.ALL_GATHER, A.RING, L.INTER_NODE, 8, 100e6, 3),  # 400 products, 50 per ring step
            Message(Op.REDUCE_SCATTER, A.RING, L.INTER_NODE, 8, 25e6, 1),
            Message(Op.ALL_GATHER, A.RECURSIVE, L.INTER_NODE, 8, 1e6, 1),  # 3 steps: 8 and 8/3
            Message(Op.ALL_REDUCE, A.RING, L.INTER_NODE, 8, 8, 5),  # a scalar: no weight
            Message(Op.ALL_GATHER, A.RING, L.PACKAGE, 2, 4e6, 2),  # 10 products, 5 per step
        ],
        COSTS,
    )
    assert sorted(numbers) == ["inter_node", "package"]
    inter = numbers["inter_node"]
    assert inter.messages == 5  # 3 + 1 + 1, the scalar left out
    assert inter.message_over_product == pytest.approx(400.0)  # the median of 8, 100, 400, 400, 400
    assert inter.step_over_product == pytest.approx(50.0)  # of 8/3, 12.5, 50, 50, 50
    assert inter.median_bytes == 100e6
    assert numbers["package"].message_over_product == pytest.approx(10.0)
    assert numbers["package"].step_over_product == pytest.approx(5.0)


def test_weighted_median_weighs_by_launches():
    assert weighted_median([(1.0, 1), (5.0, 3)]) == 5.0
    assert weighted_median([(1.0, 3), (5.0, 1)]) == 1.0
    with pytest.raises(ValueError, match="no messages"):
        weighted_median([])


def test_the_collectives_of_a_step_counted_by_hand():
    """One layer of hidden 1024 at TP=1 on 2 nodes of 8 GCDs (4 packages of 2): modules of 3, 1, 4
    and 4 M elements and two embeddings of 1 M, every one above the persistence threshold; buckets
    of 50 M: one gather per module and pass, one reduce-scatter of the whole model."""
    system = System(COSTS)
    model = Model(layers=1, hidden=1024, heads=8, seq=128, vocab=1024)
    m = 1024 * 1024
    modules = [3 * m, m, 4 * m, 4 * m, m, m]
    grads = 2 * model.params  # bf16 bytes, one reduce bucket
    zero3 = frontier_messages(system, model, 2, Candidate(Scheme.ZERO3, buckets=Buckets()))
    assert zero3 == [Message(Op.ALL_GATHER, A.RING, L.INTER_NODE, 16, 2.0 * e, 2) for e in modules] + [
        Message(Op.REDUCE_SCATTER, A.RING, L.INTER_NODE, 16, grads, 1)
    ]
    hpz = frontier_messages(system, model, 2, Candidate(Scheme.HPZ, buckets=Buckets()))
    # forward across the whole group, backward from the node's copy (8 ranks, across packages)
    assert [(x.link, x.members, x.count) for x in hpz[:2]] == [(L.INTER_NODE, 16, 1), (L.NODE, 8, 1)]
    # at TP > 1 DeepSpeed's hpZ group is the node's 8 consecutive ranks, TP peers included
    hpz_tp2 = frontier_messages(system, model, 2, Candidate(Scheme.HPZ, tp=2, buckets=Buckets()))
    assert [(x.link, x.members) for x in hpz_tp2[:2]] == [(L.INTER_NODE, 8), (L.NODE, 8)]
    ours = frontier_messages(system, model, 2, Candidate(Scheme.OURS, inter_node="ring", buckets=Buckets()))
    first = [(x.link, x.members, x.nbytes, x.count) for x in ours[:5]]
    # forward: across the 2 nodes a node's 1/8, across 4 packages a package's 1/2, in the package
    # all; backward: the node's copy, no inter-node hop
    b = 2.0 * 3 * m
    assert first == [
        (L.INTER_NODE, 2, b / 8, 1), (L.NODE, 4, b / 2, 1), (L.PACKAGE, 2, b, 1),
        (L.NODE, 4, b / 2, 1), (L.PACKAGE, 2, b, 1),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="only exact"):
        frontier_messages(system, model, 2, Candidate(Scheme.OURS, quantized_weights=True))


def test_a_latency_the_probe_did_not_resolve_is_the_links_all_gather_latency():
    from dataclasses import replace

    unresolved = AlgorithmFit(step_us=0.0, bus_gbps=12.5)  # a fit whose intercept was clipped to 0
    costs = replace(COSTS, by_operation={(Op.REDUCE_SCATTER, L.INTER_NODE, A.RECURSIVE): unresolved})
    numbers = link_regimes([Message(Op.REDUCE_SCATTER, A.RECURSIVE, L.INTER_NODE, 4, 1.25e6, 1)], costs)
    # the recursive all-gather's 10 us with the reduce-scatter's own 12.5 GB/s: a 125 KB product
    assert numbers["inter_node"].message_over_product == pytest.approx(10.0)
    none = replace(COSTS, fits={(L.PACKAGE, A.RING): AlgorithmFit(step_us=0.0, bus_gbps=1.0)})
    with pytest.raises(ValueError, match="no latency fitted or measured on package"):
        link_regimes([Message(Op.ALL_GATHER, A.RING, L.PACKAGE, 2, 1e6, 1)], none)
