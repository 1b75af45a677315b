"""The bytes a collective sends per rank, and the link class they are charged to: the accounting
that :class:`mdsp_base.comm.CommCounter` counts with and :mod:`deepspeed_ext.zero.cost.volume`
predicts with (the accounting itself: :mod:`mdsp_base.comm`'s docstring).

It imports no torch, so that what only computes (the cost model, ``python -m deepspeed_ext.zero.plan``)
starts in a fraction of a second."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from mdsp_base.topology import LinkClass, Topology

LINK_CLASSES: tuple[LinkClass, ...] = tuple(LinkClass)


class CallKey(NamedTuple):
    """One collective's shape: what it computes, how, over which group, on how many bytes."""

    collective: str
    """all_gather, reduce_scatter, all_reduce, all_to_all or broadcast."""
    algorithm: str
    """ring (the library's collective) or recursive (point-to-point steps)."""
    link: str
    """Slowest link class the group spans."""
    members: int
    """Group size."""
    nbytes: int
    """Gathered output (all-gather), input (reduce-scatter, all-to-all) or the tensor."""


def span_class(topology: Topology, ranks: Sequence[int]) -> LinkClass:
    """The slowest link class a collective among ``ranks`` crosses."""
    first = ranks[0]
    if all(topology.package(r) == topology.package(first) for r in ranks):
        return LinkClass.PACKAGE
    return (
        LinkClass.NODE
        if all(topology.node(r) == topology.node(first) for r in ranks)
        else LinkClass.INTER_NODE
    )


def volume(kind: str, nbytes: int, group_size: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal collective over ``nbytes`` of buffer.

    ``nbytes`` is the gathered output (all-gather), the input (reduce-scatter, all-to-all), the
    tensor (all-reduce counts twice: reduce-scatter plus all-gather; broadcast once), or the tensor
    sent (p2p: one step of an algorithm made of point-to-point transfers)."""
    if group_size <= 1:
        return 0
    if kind == "p2p":  # a point-to-point send: what it carries
        return nbytes
    factor = 2 if kind == "all_reduce" else 1
    return factor * nbytes * (group_size - 1) // group_size
