"""The counter's bytes per physical link, summed over 8 ranks (4 nodes x 2 ranks sharing one NIC).

Expected figures are derived by hand from the ring and the engine's point-to-point steps; a flat
ring's edge-class count (all inter-node) is there for contrast."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mdsp_base import comm
from mdsp_base.links import PhysicalLink
from mdsp_base.topology import Topology

SHARED_NIC = Topology(world_size=8, ranks_per_node=2, ranks_per_package=2)
FLOATS = 1 << 18  # 1 MiB of float32


def _count() -> dict:
    from deepspeed_ext.zero.engine import p2p_hops

    rank = dist.get_rank()
    groups = {}
    for members in ([0, 2, 4, 6], [1, 3, 5, 7], [0, 1], [2, 3], [4, 5], [6, 7]):
        made = dist.new_group(members)  # every rank makes every group, in the same order
        if rank in members:
            groups[len(members)] = made
    out = {}
    for name in ("flat", "package", "cross_node", "recursive", "p2p"):
        counter = comm.CommCounter(SHARED_NIC)
        with comm.counting(counter):
            for _ in range(2):  # two "steps"
                if name == "flat":
                    comm.all_gather_into_tensor(torch.empty(FLOATS), torch.ones(FLOATS // 8))
                elif name == "package":
                    comm.all_gather_into_tensor(torch.empty(FLOATS), torch.ones(FLOATS // 2), group=groups[2])
                elif name == "cross_node":
                    comm.all_gather_into_tensor(torch.empty(FLOATS), torch.ones(FLOATS // 4), group=groups[4])
                elif name == "recursive":
                    p2p_hops.all_gather(torch.empty(FLOATS), torch.ones(FLOATS // 4), groups[4])
                elif rank == 0:  # p2p: ranks 0 and 1 each send 1 MiB to rank 6 (node 3)
                    comm.send_recv([(torch.ones(FLOATS), 3)], [], groups[4], "other")  # group rank 3
                elif rank == 1:
                    comm.send_recv([(torch.ones(FLOATS), 6)], [], dist.group.WORLD, "other")
                elif rank == 6:
                    comm.send_recv([], [(torch.empty(FLOATS), 0)], groups[4], "other")
                    comm.send_recv([], [(torch.empty(FLOATS), 1)], dist.group.WORLD, "other")
        out[name] = {
            "per_step": comm.nic_bytes_per_step(counter, steps=2),
            "mine": counter.physical_links(),
            "classes": counter.per_link(),
        }
    return out


def test_bytes_per_nic_and_package_link_summed_over_ranks(run_ranks):
    results = run_ranks(8, _count)
    mib = 1 << 20
    per_step = results[0]
    for r in results:
        assert {name: r[name]["per_step"] for name in r} == {name: per_step[name]["per_step"] for name in r}
    # Flat ring over 8 ranks, 1 MiB gathered: each edge carries 7/8 MiB; one edge leaves each NIC,
    # one crosses each package link. The edge-class count books all of every rank's 7/8 MiB as
    # inter-node: 7 MiB of sends per step, 3.5x what leaves any NIC summed over both of its ranks.
    assert per_step["flat"]["per_step"] == {"nic_mib_per_step": 7 / 8, "package_link_mib_per_step": 7 / 8}
    assert results[1]["flat"]["classes"]["inter_node"] == 2 * 7 * mib // 8
    # Rank 1 sends to rank 2 (node 1): it books NIC 0's egress and NIC 1's ingress; rank 0 books
    # its package link (id 1: package 0, rank 0 -> rank 1).
    assert results[1]["flat"]["mine"][PhysicalLink.NIC_EGRESS] == {0: 2 * 7 * mib // 8}
    assert results[1]["flat"]["mine"][PhysicalLink.NIC_INGRESS] == {1: 2 * 7 * mib // 8}
    assert results[0]["flat"]["mine"][PhysicalLink.PACKAGE] == {1: 2 * 7 * mib // 8}
    # Package groups: nothing through a NIC; each rank sends half of 1 MiB to its peer.
    assert per_step["package"]["per_step"] == {"nic_mib_per_step": 0.0, "package_link_mib_per_step": 0.5}
    # Cross-node groups of 4, 1 MiB gathered: 3/4 MiB per rank, both ranks of a package through its NIC.
    assert per_step["cross_node"]["per_step"] == {"nic_mib_per_step": 1.5, "package_link_mib_per_step": 0.0}
    # The same gather by distance doubling: 1/4 then 2/4 MiB per rank, the same 1.5 MiB per NIC.
    assert per_step["recursive"]["per_step"] == {"nic_mib_per_step": 1.5, "package_link_mib_per_step": 0.0}
    # Two 1 MiB sends per step out of NIC 0.
    assert per_step["p2p"]["per_step"] == {"nic_mib_per_step": 2.0, "package_link_mib_per_step": 0.0}
