"""Cost model arithmetic: the ZeRO++ paper's cross-node volumes, hop volumes, the planner's choice."""

from __future__ import annotations

import pytest

from deepspeed_ext.zero.config import HierarchicalZeroConfig
from deepspeed_ext.zero.cost import volume as cm
from deepspeed_ext.zero.cost.memory import HopBuffers, hop_buffers
from deepspeed_ext.zero.cost.secondary_level import as_charged, choose_secondary_level, describe
from deepspeed_ext.zero.cost.shape import DPShape
from deepspeed_ext.zero.engine.contract import largest_collectives
from mdsp_base.section import ConfigError
from mdsp_base.topology import LinkClass, Topology

FRONTIER_384 = DPShape(nodes=48, packages_per_node=4, per_package=2)
FRONTIER_TOPOLOGY = Topology(world_size=384, ranks_per_node=8, ranks_per_package=2)
PSI = 384 * 1_000_000  # parameters, a multiple of the DP size: no padding
MODEL = cm.ShardSpec(param_numels=(PSI,), weight_bytes=2, grad_bytes=2)
M = 2 * PSI  # bytes of the 16-bit model


def zeropp_paper(size: int, link: LinkClass = LinkClass.NODE) -> cm.Placement:
    """ZeRO++ with hpZ, qwZ and qgZ as the paper describes them (their kernels need a GPU)."""
    return cm.Placement(
        f"zero++ hpZ({size})+qwZ+qgZ",
        secondary="hpz",
        hpz_size=size,
        hpz_link=link,
        weight_factor=cm.QWZ_BYTES_FACTOR,
        grad_factor=cm.QGZ_BYTES_FACTOR,
    )


def inter_node(variant: cm.Placement, micro: int = 1) -> int:
    return cm.bytes_per_link(cm.step_hops(MODEL, FRONTIER_384, variant, micro))["inter_node"]


def test_zeropp_paper_cross_node_volumes():
    frac = (384 - 1) / 384
    assert inter_node(cm.ZERO3) == pytest.approx(3 * M * frac)  # ZeRO++: 3M for ZeRO-3
    assert inter_node(cm.hpz(8, "node")) == pytest.approx(2 * M * frac)  # hpZ removes the backward gather
    assert inter_node(zeropp_paper(8, "node")) == pytest.approx(0.75 * M * frac)  # 0.5M qwZ + 0.25M qgZ


def test_hierarchical_hops_send_one_eighth_across_nodes():
    hops = cm.step_hops(MODEL, FRONTIER_384, cm.hierarchical("package"))
    across = (48 - 1) / 48 * M / 8
    assert cm.bytes_per_link(hops, "forward", "gather") == {
        "package": M // 2,
        "node": 3 * M // 8,
        "inter_node": pytest.approx(across),
    }
    assert cm.bytes_per_link(hops, "backward", "gather") == {"package": M // 2, "node": 0, "inter_node": 0}
    assert cm.bytes_per_link(hops, "backward", "reduce") == {
        "package": M // 2,
        "node": 3 * M // 8,
        "inter_node": pytest.approx(across),
    }
    node = cm.step_hops(MODEL, FRONTIER_384, cm.hierarchical("node"))
    assert cm.bytes_per_link(node, "backward", "gather") == {
        "package": M // 2,
        "node": 3 * M // 8,
        "inter_node": 0,
    }


def test_micro_batches_reuse_the_secondary_copy():
    hops = cm.step_hops(MODEL, FRONTIER_384, cm.hierarchical("package"), micro_batches=4)
    forward = cm.bytes_per_link(hops, "forward", "gather")
    # One primary gather in hops (47/48 M/8 across nodes, 3/4 M/2 = 3M/8 across packages, M/2 in the
    # package), then three micro-batches gather from the package copy only (M/2 each).
    assert forward == {
        "package": M // 2 + 3 * (M // 2),
        "node": 3 * M // 8,
        "inter_node": pytest.approx(47 / 48 * M / 8),
    }
    # Every micro-batch reduces its gradients through all three hops unless synced at the boundary.
    assert cm.bytes_per_link(hops, "backward", "reduce")["inter_node"] == pytest.approx(4 * 47 / 48 * M / 8)
    once = cm.step_hops(MODEL, FRONTIER_384, cm.hierarchical("package", boundary_sync=True), micro_batches=4)
    assert cm.bytes_per_link(once, "backward", "reduce") == {
        "package": 4 * M // 2,
        "node": 4 * 3 * M // 8,
        "inter_node": pytest.approx(47 / 48 * M / 8),
    }


def test_quantized_factors_apply_to_inter_node_hops_only():
    ours = cm.hierarchical("package", weight_factor=0.5, grad_factor=0.25)
    hops = cm.step_hops(MODEL, FRONTIER_384, ours)
    across = 47 / 48 * M / 8  # the cross-node hop's 16-bit volume
    assert cm.bytes_per_link(hops, "forward", "gather") == {
        "package": M // 2,
        "node": 3 * M // 8,
        "inter_node": pytest.approx(0.5 * across),
    }
    assert cm.bytes_per_link(hops, "backward", "reduce")["inter_node"] == pytest.approx(0.25 * across)
    # qwZ quantizes ZeRO++'s flat primary gather wherever it runs: on one node, 7/8 of M at half the bytes.
    one_node = cm.step_hops(MODEL, DPShape(nodes=1, packages_per_node=4, per_package=2), zeropp_paper(8))
    assert cm.bytes_per_link(one_node, "forward", "gather")["node"] == pytest.approx(0.5 * 7 / 8 * M)


def test_each_parameter_is_padded_to_a_multiple_of_the_partition_count_as_zero3_does():
    model = cm.ShardSpec(param_numels=(13, 8, 1), weight_bytes=4, grad_bytes=4)
    assert model.padded(8) == 16 + 8 + 8


def test_ring_wire_bytes_cross_each_node_boundary_once():
    # A flat all-gather ring over 2 nodes x 2 packages x 2 (node- and package-contiguous): of its 8
    # edges 4 stay in a package (0-1, 2-3, 4-5, 6-7), 2 cross packages (1-2, 5-6), 2 cross nodes (3-4, 7-0).
    assert cm.ring_edges((2, 2, 2)) == {"package": 4, "node": 2, "inter_node": 2}
    assert cm.ring_edges((1, 4, 2)) == {"package": 4, "node": 4, "inter_node": 0}  # closes across packages
    assert cm.ring_edges((1, 1, 2)) == {"package": 2, "node": 0, "inter_node": 0}
    hop = cm.Hop("forward", "gather", "inter_node", 8, 800, 1, 3, (2, 2, 2))
    # Each edge carries what one rank sends (800 B, 3 times); per rank on average 800 x 3 x edges / 8.
    assert cm.ring_wire_bytes([hop]) == {"package": 1200.0, "node": 600.0, "inter_node": 600.0}


def test_flat_ring_and_cross_node_hop_put_the_same_bytes_through_a_nic():
    v_flat = 383 / 384 * M  # a flat all-gather: each rank sends 383/384 of the gathered M
    v_hop = 47 / 48 * M / 8  # the cross-node hop: 47/48 of the M/8 the package and node hops spread
    ring = cm.ring_wire_bytes([cm.Hop("forward", "gather", "inter_node", 384, int(v_flat), 1, 1, (48, 4, 2))])
    hop = cm.ring_wire_bytes([cm.Hop("forward", "gather", "inter_node", 48, int(v_hop), 1, 1, (48, 1, 1))])
    # Per node (8 ranks): the flat ring's one boundary edge per ring carries v_flat; the 8 hop groups v_hop each.
    assert 8 * ring["inter_node"] == pytest.approx(v_flat, rel=1e-9)
    assert 8 * hop["inter_node"] == pytest.approx(8 * v_hop, rel=1e-9)
    # Within 2 %: the hop saves no NIC bytes.
    assert ring["inter_node"] == pytest.approx(hop["inter_node"], rel=0.02)


def test_gloos_reduce_scatter_puts_an_all_reduces_bytes_on_the_wire():
    gb = 1e9
    reduce = cm.Hop("backward", "reduce", "node", 4, 10 * gb, 1, 1, (1, 2, 2))
    assert cm.ring_wire_bytes([reduce]) == {"package": 5 * gb, "node": 5 * gb, "inter_node": 0.0}
    doubled = cm.ring_wire_bytes([reduce], reduce_scatter_wire=2.0)
    assert doubled == {"package": 10 * gb, "node": 10 * gb, "inter_node": 0.0}


def test_planner_picks_fastest_level_within_budget():
    links = FRONTIER_TOPOLOGY
    big = HierarchicalZeroConfig(enabled=True, secondary_memory_budget_gb=1e3)
    assert choose_secondary_level(big, FRONTIER_384, MODEL, links).level == "package"
    middle = HierarchicalZeroConfig(enabled=True, secondary_memory_budget_gb=M / 8 / 1e9)
    choice = choose_secondary_level(middle, FRONTIER_384, MODEL, links)
    assert choice.level == "node" and choice.extra_bytes == {"package": M // 2, "node": M // 8, "global": 0}
    tiny = HierarchicalZeroConfig(enabled=True, secondary_memory_budget_gb=1e-3)
    assert choose_secondary_level(tiny, FRONTIER_384, MODEL, links).level == "global"
    one_node = DPShape(nodes=1, packages_per_node=4, per_package=2)
    forced = HierarchicalZeroConfig(enabled=True, secondary_level="node")
    assert choose_secondary_level(forced, one_node, MODEL, links).level == "global"
    alone = DPShape(nodes=1, packages_per_node=1, per_package=1)  # one rank: nothing to place
    assert choose_secondary_level(big, alone, MODEL, links).level == "global"
    package_is_group = DPShape(nodes=1, packages_per_node=1, per_package=2)
    assert (
        choose_secondary_level(
            HierarchicalZeroConfig(enabled=True, secondary_level="package"), package_is_group, MODEL, links
        ).level
        == "global"
    )
    assert "secondary level package" in describe(
        choose_secondary_level(big, FRONTIER_384, MODEL, links), FRONTIER_384
    )


def test_planner_counts_gradients_held_for_the_cross_node_hop_in_the_budget():
    """Boundary sync holds the node-level gradient block (1/8 of the padded model at 8 DP members per
    node) in fp32, int4 gradients a residual of the same size: 2 x 4 bytes x elements / 8 per rank,
    on top of the secondary copy; a budget that fits the node copy alone then fits nothing."""
    elements = M // MODEL.weight_bytes  # M: the padded 16-bit model in bytes
    held = 2 * 4 * elements // 8
    both = HierarchicalZeroConfig(
        enabled=True,
        secondary_memory_budget_gb=M / 8 / 1e9,
        grad_sync="accumulation_boundary",
        quantized_gradients="int4",
    )
    choice = choose_secondary_level(both, FRONTIER_384, MODEL, FRONTIER_TOPOLOGY)
    assert choice.extra_bytes == {"package": M // 2 + held, "node": M // 8 + held, "global": held}
    assert choice.level == "global"


def test_boundary_sync_at_one_micro_batch_per_step_is_charged_nothing():
    """At gradient accumulation 1 every micro-batch is a boundary: nothing is held, and the level the
    planner picks is the one every-micro-batch sync gets."""
    tight = dict(enabled=True, secondary_memory_budget_gb=M / 8 / 1e9 + 1e-3)
    boundary = HierarchicalZeroConfig(**tight, grad_sync="accumulation_boundary")
    plain = HierarchicalZeroConfig(**tight)
    assert as_charged(boundary, 2) is boundary
    charged = choose_secondary_level(as_charged(boundary, 1), FRONTIER_384, MODEL, FRONTIER_TOPOLOGY)
    assert charged == choose_secondary_level(plain, FRONTIER_384, MODEL, FRONTIER_TOPOLOGY)
    assert charged.extra_bytes["global"] == 0 and charged.level == "node"
    assert choose_secondary_level(boundary, FRONTIER_384, MODEL, FRONTIER_TOPOLOGY).level == "global"


def test_planner_counts_transient_hop_buffers_in_every_level():
    """An all-gather of G 16-bit elements in hops holds the innermost hop's input and output at
    once: G x 2 bytes x (1 + 1/2) at 2 GCDs per package. Unquantized ring reduce-scatter hops run
    in place in DeepSpeed's bucket: nothing; the recursive one (auto may choose it) receives its
    largest step, 16 of the 48 nodes' blocks of ceil(G / 384) elements, into one buffer. Both count
    against the budget at every level."""
    g = 1_000_000
    ring = HierarchicalZeroConfig(enabled=True, inter_node_algorithm="ring")
    buffers = hop_buffers(ring, FRONTIER_384, MODEL, g, g)
    assert buffers == HopBuffers(gather=3_000_000, reduce=0)
    auto = hop_buffers(HierarchicalZeroConfig(enabled=True), FRONTIER_384, MODEL, g, g)
    assert auto == HopBuffers(gather=3_000_000, reduce=16 * -(-g // 384) * 2)
    one_node = DPShape(nodes=1, packages_per_node=1, per_package=8)  # one hop: the flat collective
    assert hop_buffers(HierarchicalZeroConfig(enabled=True), one_node, MODEL, g, g) == HopBuffers(0, 0)
    big = HierarchicalZeroConfig(enabled=True, secondary_memory_budget_gb=1e3)
    choice = choose_secondary_level(big, FRONTIER_384, MODEL, FRONTIER_TOPOLOGY, buffers=buffers)
    assert choice.extra_bytes == {
        "package": M // 2 + 3_000_000,
        "node": M // 8 + 3_000_000,
        "global": 3_000_000,
    }


def test_largest_collectives_are_a_bucket_plus_one_parameter_at_most_the_model():
    model = cm.ShardSpec(param_numels=(50, 30, 70))
    zero = {"stage3_prefetch_bucket_size": 60, "reduce_bucket_size": 1000}
    assert largest_collectives({"zero_optimization": zero}, model) == (60 + 70, 150)
    assert largest_collectives({}, model) == (150, 150)  # DeepSpeed's default buckets exceed the model


@pytest.mark.parametrize("size", ["auto", -1, 2.5, True, None])
def test_a_bucket_size_that_is_not_a_whole_number_of_elements_is_refused_by_name(size):
    model = cm.ShardSpec(param_numels=(50, 30, 70))
    with pytest.raises(ConfigError, match=r"zero_optimization\.reduce_bucket_size=.* is not a bucket size"):
        largest_collectives({"zero_optimization": {"reduce_bucket_size": size}}, model)


def test_pipelined_gathers_reserve_the_cross_node_output_too():
    """Pieces waiting for the next lane hold their cross-node hop's output: G / (members per node)
    more than the serial hops' peak (G + G / package size), 16-bit elements."""
    shape, gather = DPShape(nodes=4, packages_per_node=2, per_package=2), 4_000_000
    serial = hop_buffers(HierarchicalZeroConfig(enabled=True), shape, MODEL, gather, 0).gather
    piped = hop_buffers(
        HierarchicalZeroConfig(enabled=True, pipeline_chunks=4), shape, MODEL, gather, 0
    ).gather
    assert serial == 2 * (gather + gather // 2)
    assert piped - serial == 2 * gather // 4
