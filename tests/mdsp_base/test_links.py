"""Bytes per physical link from an algorithm's geometry, against hand-derived cases.

The layout of most cases: 8 ranks as 4 nodes x 2 ranks that share one package, hence one NIC
(Frontier's two GCDs of an MI250X, one node each here): NIC k serves ranks 2k and 2k+1."""

from __future__ import annotations

import pytest

from mdsp_base.links import PhysicalLink, Transfer, link_count, link_loads, most_loaded, sends, transfers
from mdsp_base.topology import Topology

SHARED_NIC = Topology(world_size=8, ranks_per_node=2, ranks_per_package=2)
EGRESS, INGRESS, PACKAGE, NODE = (
    PhysicalLink.NIC_EGRESS,
    PhysicalLink.NIC_INGRESS,
    PhysicalLink.PACKAGE,
    PhysicalLink.NODE,
)
MIB = 1 << 20


def test_a_flat_ring_all_gather_crosses_each_node_boundary_once_per_direction() -> None:
    # Ring 0->1->...->7->0. Each edge carries 7/8 of the 8 MiB gathered: 7 MiB. Edges 0->1, 2->3,
    # 4->5, 6->7 stay in a package; 1->2, 3->4, 5->6, 7->0 cross a node boundary, one out of each
    # NIC and one into each. The edge-class count books all 8 x 7 MiB as inter-node; the NICs carry
    # 7 MiB each way, and each package link 7 MiB in one direction.
    loads = link_loads(SHARED_NIC, transfers("all_gather", "ring", 8 * MIB, range(8)))
    assert loads[EGRESS] == {0: 7 * MIB, 1: 7 * MIB, 2: 7 * MIB, 3: 7 * MIB}
    assert loads[INGRESS] == {0: 7 * MIB, 1: 7 * MIB, 2: 7 * MIB, 3: 7 * MIB}
    # package k's link from its first rank to its second: id 4k + 0*2 + 1
    assert loads[PACKAGE] == {1: 7 * MIB, 5: 7 * MIB, 9: 7 * MIB, 13: 7 * MIB}
    assert loads[NODE] == {}
    assert most_loaded(loads) == {EGRESS: 7 * MIB, INGRESS: 7 * MIB, PACKAGE: 7 * MIB, NODE: 0}


def test_reduce_scatter_equals_all_gather_and_all_reduce_doubles_it() -> None:
    gather = link_loads(SHARED_NIC, transfers("all_gather", "ring", 8 * MIB, range(8)))
    assert link_loads(SHARED_NIC, transfers("reduce_scatter", "ring", 8 * MIB, range(8))) == gather
    reduce = link_loads(SHARED_NIC, transfers("all_reduce", "ring", 8 * MIB, range(8)))
    assert reduce[EGRESS] == {0: 14 * MIB, 1: 14 * MIB, 2: 14 * MIB, 3: 14 * MIB}


def test_a_package_level_collective_sends_nothing_through_a_nic() -> None:
    # Four package groups {0,1}, {2,3}, ... each all-gather 8 MiB: each rank sends 4 MiB to its peer.
    moves = [t for k in range(4) for t in transfers("all_gather", "ring", 8 * MIB, [2 * k, 2 * k + 1])]
    loads = link_loads(SHARED_NIC, moves)
    assert loads[EGRESS] == {} and loads[INGRESS] == {}
    assert loads[PACKAGE] == {4 * k + pair: 4 * MIB for k in range(4) for pair in (1, 2)}


def test_node_aligned_groups_of_one_rank_per_node_share_the_nic() -> None:
    # Cross-node groups {0,2,4,6} and {1,3,5,7}, each gathering 4 MiB: every edge crosses a node,
    # 3/4 x 4 = 3 MiB each. Both ranks of a package send through its one NIC: 6 MiB per NIC.
    moves = transfers("all_gather", "ring", 4 * MIB, [0, 2, 4, 6]) + transfers(
        "all_gather", "ring", 4 * MIB, [1, 3, 5, 7]
    )
    loads = link_loads(SHARED_NIC, moves)
    assert loads[EGRESS] == {k: 6 * MIB for k in range(4)} == loads[INGRESS]
    assert loads[PACKAGE] == {}
    # Against the flat ring over the same 8 MiB in all: 6 MiB per NIC, not 7.
    flat = link_loads(SHARED_NIC, transfers("all_gather", "ring", 8 * MIB, range(8)))
    assert most_loaded(flat)[EGRESS] == 7 * MIB


def test_one_nic_per_gpu_and_intra_node_links_between_packages() -> None:
    # NVIDIA-like: 2 nodes x 4 GPUs, one package (and NIC) each. A flat ring of 8 over 8 MiB: the
    # edges 3->4 and 7->0 leave NICs 3 and 7; the others stay on intra-node links, 7 MiB each.
    gpus = Topology(world_size=8, ranks_per_node=4, ranks_per_package=1)
    loads = link_loads(gpus, transfers("all_gather", "ring", 8 * MIB, range(8)))
    assert loads[EGRESS] == {3: 7 * MIB, 7: 7 * MIB}
    assert loads[INGRESS] == {4: 7 * MIB, 0: 7 * MIB}
    assert loads[PACKAGE] == {}
    # node n's link from package a to b (positions in the node): id 16n + 4a + b
    assert loads[NODE] == {1: 7 * MIB, 6: 7 * MIB, 11: 7 * MIB, 17: 7 * MIB, 22: 7 * MIB, 27: 7 * MIB}
    assert (link_count(gpus, EGRESS), link_count(gpus, PACKAGE), link_count(gpus, NODE)) == (8, 8, 32)


def test_recursive_doubling_and_halving() -> None:
    # 4 members {0,2,4,6} (one per node), 4 MiB gathered, blocks of 1 MiB; steps (d=1, 1 block),
    # (d=2, 2 blocks). All-gather: member r sends 1 MiB to r-1, then 2 MiB to r-2. Each member sends
    # 3 MiB, as in a ring, but rank 0's NIC carries 1 MiB to NIC 3 and 2 MiB to NIC 2.
    schedule = [(1, 1), (2, 2)]
    ranks = [0, 2, 4, 6]
    assert sends("all_gather", "recursive", 4 * MIB, ranks, 0, schedule=schedule) == [
        Transfer(0, 6, MIB),
        Transfer(0, 4, 2 * MIB),
    ]
    # Reduce-scatter (halving) sends to r+d: rank 2 (member 1) sends 1 MiB to member 2, 2 MiB to 3.
    assert sends("reduce_scatter", "recursive", 4 * MIB, ranks, 2, schedule=schedule) == [
        Transfer(2, 4, MIB),
        Transfer(2, 6, 2 * MIB),
    ]
    loads = link_loads(SHARED_NIC, transfers("all_gather", "recursive", 4 * MIB, ranks, schedule=schedule))
    assert loads[EGRESS] == {k: 3 * MIB for k in range(4)} == loads[INGRESS]
    # 6 members (Bruck: steps (1,1), (2,2), (4,2)): 5 blocks each, the last step only 2 of 4.
    six = Topology(world_size=6, ranks_per_node=1, ranks_per_package=1)
    moves = transfers("all_gather", "recursive", 6 * MIB, range(6), schedule=[(1, 1), (2, 2), (4, 2)])
    assert link_loads(six, moves)[EGRESS] == {k: 5 * MIB for k in range(6)}


def test_broadcast_chain_all_to_all_and_a_point_to_point_send() -> None:
    # Broadcast of 2 MiB from group rank 2 over ranks 0..7: a chain 2->3->...->7->0->1, 2 MiB per
    # edge; rank 1 (the last) sends nothing.
    chain = transfers("broadcast", "ring", 2 * MIB, range(8), root=2)
    assert sorted((t.src, t.dst) for t in chain) == [(0, 1), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 0)]
    loads = link_loads(SHARED_NIC, chain)
    assert loads[EGRESS] == {1: 2 * MIB, 2: 2 * MIB, 3: 2 * MIB}  # 3->4, 5->6, 7->0; NIC 0's 1->2 unused
    # All-to-all over 8 ranks of 8 MiB: 1 MiB to each of the 7 others; 6 of them on other nodes,
    # from both ranks of a package: 12 MiB out of each NIC.
    assert (
        most_loaded(link_loads(SHARED_NIC, transfers("all_to_all", "ring", 8 * MIB, range(8))))[EGRESS]
        == 12 * MIB
    )
    # A send crosses the links between its two ranks only.
    assert link_loads(SHARED_NIC, [Transfer(1, 6, MIB)])[EGRESS] == {0: MIB}
    assert link_loads(SHARED_NIC, [Transfer(1, 0, MIB)])[PACKAGE] == {2: MIB}
    assert sends("all_gather", "ring", MIB, [3], 3) == []
    with pytest.raises(ValueError, match="unknown algorithm"):
        sends("all_gather", "tree", MIB, [0, 1], 0)
