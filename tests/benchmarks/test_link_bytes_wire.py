"""The physical-link geometry of a ring all-gather against the bytes the emulated cluster's wire
carries (root, ip and tc: each rank's tc classes count what it sends per link class)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from benchmarks.cluster import ClusterSpec, EmulatedCluster, netns
from mdsp_base.links import PhysicalLink, link_loads, transfers
from mdsp_base.topology import Topology
from multirank.warm import WarmLauncher

PREFIX = "emlb"  # a prefix of its own, so that another cluster test running at the same time is left alone
HAVE_NETNS = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
GATHERED = 4_000_000  # bytes: 500 kB per rank

# The bytes each rank sends per link class in one call of {op}, after a first call warmed it up.
COUNT = """
import torch, torch.distributed as dist
from benchmarks.cluster import write_result
from benchmarks.cluster.netns import sent_bytes
dist.init_process_group("gloo")
out, mine = torch.empty({gathered}), torch.ones({block})
{op}  # connections up and warm
dist.barrier()
before = sent_bytes()
{op}
dist.barrier()  # every rank has received all: the bytes have left every sender
after = sent_bytes()
write_result({{k: after[k] - before[k] for k in after}})
"""


@pytest.fixture(scope="module")
def warm() -> Iterator[WarmLauncher]:
    with WarmLauncher(dict(os.environ), preload=["torch.distributed"]) as launcher:
        yield launcher


@pytest.mark.netns
@pytest.mark.skipif(not HAVE_NETNS, reason="needs root and the ip and tc commands (iproute2)")
def test_ring_geometry_matches_the_wire_and_gloo_reduce_scatter_sends_twice(warm: WarmLauncher) -> None:
    # 2 nodes x 2 packages x 2 ranks, one NIC per package: the ring 0->1->...->7->0 has package edges
    # (0->1, 2->3, 4->5, 6->7), intra-node edges between packages (1->2, 5->6) and node boundaries
    # (3->4, 7->0). gloo's all-gather is this ring in group-rank order.
    spec = ClusterSpec(2, 2, 2, 400.0, 400.0, 200.0, name="links")
    topology = Topology(world_size=8, ranks_per_node=4, ranks_per_package=2)
    with EmulatedCluster(spec, prefix=PREFIX, warm=warm) as cluster:
        sent = cluster.launch(
            [
                "-c",
                COUNT.format(
                    gathered=GATHERED // 4, block=GATHERED // 32, op="dist.all_gather_into_tensor(out, mine)"
                ),
            ],
            timeout=120,
        )
        reduced = cluster.launch(
            [
                "-c",
                COUNT.format(
                    gathered=GATHERED // 4, block=GATHERED // 32, op="dist.reduce_scatter_tensor(mine, out)"
                ),
            ],
            timeout=120,
        )
    moves = transfers("all_gather", "ring", GATHERED, range(8))
    edge = GATHERED * 7 // 8
    predicted = [dict.fromkeys(("package", "node", "inter_node"), 0) for _ in range(8)]
    for t in moves:
        predicted[t.src][topology.link_class(t.src, t.dst)] += t.nbytes
    # On the wire: the payload plus gloo's and TCP/IP's headers (< 3 % at MTU 9000), and on the
    # classes a rank only receives on, the acknowledgements and the barriers (< 64 kB).
    for rank, (wire, bytes_) in enumerate(zip(sent, predicted, strict=True)):
        for link, n in bytes_.items():
            assert n <= wire[link] <= 1.03 * n + 64_000, (rank, link, wire, bytes_)
    # Per NIC: the inter-node bytes of a package's two ranks together, against the geometry's egress.
    egress = link_loads(topology, moves)[PhysicalLink.NIC_EGRESS]
    assert egress == {1: edge, 3: edge}
    for nic in range(4):
        wire = sent[2 * nic]["inter_node"] + sent[2 * nic + 1]["inter_node"]
        assert egress.get(nic, 0) <= wire <= 1.03 * egress.get(nic, 0) + 128_000, (nic, wire)
    # gloo's reduce-scatter all-reduces its whole input (a ring towards member -1: 1->0 is a package
    # edge, 0->7 crosses nodes) and keeps its block: twice the ring reduce-scatter's bytes on the wire.
    for rank, link in ((0, "inter_node"), (1, "package"), (2, "node"), (4, "inter_node")):
        assert 2 * edge <= reduced[rank][link] <= 1.03 * 2 * edge, (rank, reduced[rank])
    assert netns.list_namespaces(PREFIX) == [] and netns.list_host_links(PREFIX) == []
