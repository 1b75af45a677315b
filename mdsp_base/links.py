"""The bytes a collective moves across each physical link, from its algorithm's geometry.

:mod:`mdsp_base.volume` charges a collective's whole volume to the slowest link class its group
spans, so a flat ring over nodes counts its edges inside a node as inter-node bytes. Here every
transfer of the algorithm (``ring``, ``recursive`` or ``p2p``) is placed on the links it crosses:
each NIC's egress and ingress, each package link, each intra-node link between packages, per
direction (placement: :class:`Topology`). The links and each algorithm's geometry, gloo's included:
docs/hierarchical_zero.md, "Link geometry". Imports no torch, as :mod:`mdsp_base.volume`."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from enum import StrEnum
from typing import NamedTuple

from mdsp_base.topology import Topology


class PhysicalLink(StrEnum):
    """A kind of physical link; each has one instance per id (:func:`link_count`)."""

    NIC_EGRESS = "nic_egress"
    NIC_INGRESS = "nic_ingress"
    PACKAGE = "package"
    """The link from one rank of a package to another, per ordered pair."""
    NODE = "node"
    """The link from one package of a node to another, per ordered pair."""


class Transfer(NamedTuple):
    """``nbytes`` sent by global rank ``src`` to global rank ``dst``."""

    src: int
    dst: int
    nbytes: int


def _ring(collective: str, nbytes: int, ranks: Sequence[int], me: int, root: int) -> list[Transfer]:
    p = len(ranks)
    if collective == "all_to_all":
        return [Transfer(ranks[me], ranks[(me + i) % p], nbytes // p) for i in range(1, p)]
    after = ranks[(me + 1) % p]
    if collective == "broadcast":
        return [] if (me + 1) % p == root else [Transfer(ranks[me], after, nbytes)]
    factor = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}[collective]
    return [Transfer(ranks[me], after, factor * nbytes * (p - 1) // p)]


def _recursive(
    collective: str, nbytes: int, ranks: Sequence[int], me: int, schedule: Sequence[tuple[int, int]]
) -> list[Transfer]:
    p = len(ranks)
    sign = {"all_gather": -1, "reduce_scatter": 1}[collective]
    return [Transfer(ranks[me], ranks[(me + sign * d) % p], c * nbytes // p) for d, c in schedule]


def sends(
    collective: str,
    algorithm: str,
    nbytes: int,
    ranks: Sequence[int],
    sender: int,
    *,
    schedule: Sequence[tuple[int, int]] = (),
    root: int = 0,
) -> list[Transfer]:
    """What global rank ``sender`` sends in one call among ``ranks`` (global ranks in group-rank
    order). ``schedule``: the (distance, blocks) steps of ``recursive``; ``root``: the broadcast's
    group rank. A group of one sends nothing."""
    if len(ranks) <= 1:
        return []
    me = list(ranks).index(sender)
    if algorithm == "ring":
        return _ring(collective, nbytes, ranks, me, root)
    if algorithm == "recursive":
        return _recursive(collective, nbytes, ranks, me, schedule)
    raise ValueError(f"unknown algorithm {algorithm!r}: ring or recursive (a p2p send is a Transfer)")


def transfers(
    collective: str,
    algorithm: str,
    nbytes: int,
    ranks: Sequence[int],
    *,
    schedule: Sequence[tuple[int, int]] = (),
    root: int = 0,
) -> list[Transfer]:
    """Every member's :func:`sends` in one call."""
    return [
        t for r in ranks for t in sends(collective, algorithm, nbytes, ranks, r, schedule=schedule, root=root)
    ]


def links_crossed(topology: Topology, src: int, dst: int) -> list[tuple[PhysicalLink, int]]:
    """The physical links (kind, id) a transfer from ``src`` to ``dst`` crosses."""
    if src == dst:
        return []
    per_package = topology.ranks_per_package
    if topology.package(src) == topology.package(dst):
        pair = (src % per_package) * per_package + dst % per_package
        return [(PhysicalLink.PACKAGE, topology.package(src) * per_package**2 + pair)]
    if topology.node(src) == topology.node(dst):
        per_node = _packages_per_node(topology)
        pair = (topology.package(src) % per_node) * per_node + topology.package(dst) % per_node
        return [(PhysicalLink.NODE, topology.node(src) * per_node**2 + pair)]
    return [
        (PhysicalLink.NIC_EGRESS, topology.package(src)),
        (PhysicalLink.NIC_INGRESS, topology.package(dst)),
    ]


def _packages_per_node(topology: Topology) -> int:
    return max(1, topology.ranks_per_node // topology.ranks_per_package)


def link_count(topology: Topology, kind: PhysicalLink) -> int:
    """How many links of ``kind`` the job has: the ids :func:`links_crossed` gives run below it."""
    packages = -(-topology.world_size // topology.ranks_per_package)
    if kind is PhysicalLink.PACKAGE:
        return packages * topology.ranks_per_package**2
    if kind is PhysicalLink.NODE:
        return topology.num_nodes * _packages_per_node(topology) ** 2
    return packages


def link_loads(topology: Topology, moves: Iterable[Transfer]) -> dict[PhysicalLink, dict[int, int]]:
    """Bytes per physical link (kind -> id -> bytes) that ``moves`` put on it."""
    out: dict[PhysicalLink, dict[int, int]] = {kind: defaultdict(int) for kind in PhysicalLink}
    for t in moves:
        for kind, link in links_crossed(topology, t.src, t.dst):
            out[kind][link] += t.nbytes
    return {kind: dict(loads) for kind, loads in out.items()}


def most_loaded(loads: dict[PhysicalLink, dict[int, int]]) -> dict[PhysicalLink, int]:
    """The most loaded link's bytes of each kind (0 where none carries any)."""
    return {kind: max(loads.get(kind, {}).values(), default=0) for kind in PhysicalLink}
