"""What one ZeRO-3 step sends: every collective of ZeRO-3, ZeRO++ and the hierarchical variant as a
:class:`Hop`, and its bytes per link class (computed from the parameter sizes, never measured).

:func:`bytes_per_link` counts as :class:`~mdsp_base.comm.CommCounter` does (a prediction to
compare with a count); :func:`ring_wire_bytes` is what a ring puts on each link class (to compare
with interface counters). Time is :mod:`.collectives`'. The step it assumes:
docs/hierarchical_zero_modules.md."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from deepspeed_ext.zero.cost.shape import DPShape
from mdsp_base.topology import Level, LinkClass
from mdsp_base.volume import LINK_CLASSES, volume

PACKAGE, NODE, INTER_NODE = LinkClass.PACKAGE, LinkClass.NODE, LinkClass.INTER_NODE
# ZeRO++ (arXiv 2306.10209): qwZ sends INT8 weights plus block scales (~half of fp16), qgZ INT4 gradients.
QWZ_BYTES_FACTOR = 0.5
QGZ_BYTES_FACTOR = 0.25


@dataclass(frozen=True)
class ShardSpec:
    """What this rank's model shard sends: its parameters and the element sizes on the wire."""

    param_numels: tuple[int, ...]
    """Elements of each parameter this rank holds before partitioning (a TP shard under TP)."""
    weight_bytes: int = 2
    """Bytes per gathered weight element (2 for bf16/fp16, 4 for fp32)."""
    grad_bytes: int = 2
    """Bytes per reduce-scattered gradient element (the communication dtype)."""
    gathers_per_pass: int = 1
    """Collective launches per forward (and per backward) pass: about the number of layers."""
    reduce_launches: int = 1
    """Reduce-scatter launches per micro-batch (gradient buckets)."""

    def padded(self, dp: int) -> int:
        """Elements after ZeRO-3 pads every parameter to a multiple of the DP size."""
        return sum(math.ceil(n / dp) * dp for n in self.param_numels)


@dataclass(frozen=True)
class Placement:
    """Where each collective of a ZeRO-3 step runs."""

    name: str
    """Label in reports."""
    secondary: Level | str = Level.GLOBAL
    """Secondary weight copy: a Level (global: none), or "hpz" (consecutive-rank groups)."""
    hpz_size: int = 1
    """Members of an hpZ group when secondary is hpz."""
    hpz_link: LinkClass = NODE
    """Link class an hpZ group spans."""
    hierarchical_gather: bool = False
    """Primary and node-level gathers in hops (cross-node, cross-package, package)."""
    hierarchical_reduce: bool = False
    """Gradient reduce-scatter in hops (package, cross-package, cross-node)."""
    boundary_sync: bool = False
    """Cross-node gradient hop once per optimizer step; within the node every micro-batch."""
    weight_factor: float = 1.0
    """Bytes on the wire per gathered byte of the primary gather: all of a flat one (qwZ: 0.5),
    the inter-node hop of ours (int8 hops: 0.5)."""
    grad_factor: float = 1.0
    """Bytes on the wire per reduced byte on inter-node gradient reductions (qgZ: 0.25)."""


ZERO3 = Placement("zero3")


def hpz(size: int, link: LinkClass = NODE) -> Placement:
    return Placement(f"zero++ hpZ({size})", secondary="hpz", hpz_size=size, hpz_link=link)


def hierarchical(
    secondary: Level,
    grad_reduce: str = "hierarchical",
    boundary_sync: bool = False,
    weight_factor: float = 1.0,
    grad_factor: float = 1.0,
) -> Placement:
    """Our variant; the factors model quantized inter-node hops (int8 weights 0.5, int4 gradients 0.25)."""
    tags = (
        [secondary]
        + (["boundary sync"] if boundary_sync else [])
        + ([f"w x{weight_factor:g} g x{grad_factor:g}"] if (weight_factor, grad_factor) != (1.0, 1.0) else [])
    )
    return Placement(
        f"hierarchical({', '.join(tags)})",
        secondary=secondary,
        hierarchical_gather=True,
        hierarchical_reduce=grad_reduce == "hierarchical",
        boundary_sync=boundary_sync,
        weight_factor=weight_factor,
        grad_factor=grad_factor,
    )


Layout = tuple[int, int, int]
"""A group as nodes x packages per node x members per package."""


@dataclass(frozen=True)
class Hop:
    """One collective launch pattern of a step."""

    phase: str
    """forward, backward or step."""
    kind: str
    """gather or reduce."""
    link: LinkClass
    """Slowest link class of the group."""
    members: int
    """Group size."""
    nbytes: int
    """Bytes this rank sends per occurrence (comm.py's accounting)."""
    launches: int
    """Collective launches per occurrence (for the latency term)."""
    times: int
    """Occurrences per step."""
    layout: Layout
    """The group as nodes x packages per node x members per package (the ring's edges)."""


def _link(layout: Layout) -> LinkClass:
    n, q, _ = layout
    return INTER_NODE if n > 1 else (NODE if q > 1 else PACKAGE)


def _gather_hops(
    shape: DPShape, level: Level, nbytes: int, hierarchical_hops: bool
) -> list[tuple[Layout, int]]:
    """(group layout, bytes sent) of gathering ``nbytes`` of full weights over ``level``'s group."""
    n, q, k = shape.nodes, shape.packages_per_node, shape.per_package
    stages: list[Layout] = {
        Level.PACKAGE: [(1, 1, k)],
        Level.NODE: [(1, q, 1), (1, 1, k)],
        Level.GLOBAL: [(n, 1, 1), (1, q, 1), (1, 1, k)],
    }[level]
    members = math.prod(math.prod(s) for s in stages)
    if not hierarchical_hops:
        flat = {Level.PACKAGE: (1, 1, k), Level.NODE: (1, q, k), Level.GLOBAL: (n, q, k)}[level]
        return [(flat, volume("all_gather", nbytes, members))]
    hops, held = [], nbytes // members
    for layout in stages:  # outermost first: each hop gathers what the next one spreads
        m = math.prod(layout)
        held *= m
        hops.append((layout, volume("all_gather", held, m)))
    return hops


def _reduce_hops(shape: DPShape, nbytes: int, hierarchical_hops: bool) -> list[tuple[Layout, int]]:
    n, q, k = shape.nodes, shape.packages_per_node, shape.per_package
    if not hierarchical_hops:
        return [((n, q, k), volume("reduce_scatter", nbytes, shape.size))]
    hops, held = [], nbytes
    for layout in ((1, 1, k), (1, q, 1), (n, 1, 1)):  # each hop on the previous result
        m = math.prod(layout)
        hops.append((layout, volume("reduce_scatter", held, m)))
        held //= m
    return hops


def step_hops(model: ShardSpec, shape: DPShape, variant: Placement, micro_batches: int = 1) -> list[Hop]:
    """Every collective of one steady-state optimizer step.

    Args:
        model: this rank's parameters.
        shape: the data-parallel group as nodes x packages x members.
        variant: where each collective runs (ZeRO-3, hpZ, ZeRO++, hierarchical).
        micro_batches: forward and backward passes per optimizer step.

    Returns:
        The collectives, as :class:`Hop` s in step order.
    """
    dp = shape.size
    w = model.padded(dp) * model.weight_bytes
    g = model.padded(dp) * model.grad_bytes

    def quantized(layout: Layout, nbytes: int, factor: float, whole: bool = False) -> int:
        return int(nbytes * factor) if whole or _link(layout) == INTER_NODE else nbytes

    # qwZ quantizes a flat primary gather wherever it runs; our hops only where they cross nodes.
    primary = [
        (lay, quantized(lay, b, variant.weight_factor, whole=not variant.hierarchical_gather))
        for lay, b in _gather_hops(shape, Level.GLOBAL, w, variant.hierarchical_gather)
    ]
    if variant.secondary == Level.GLOBAL:
        secondary = primary
    elif variant.secondary == "hpz":
        k = min(variant.hpz_size, shape.per_package)
        lay = (1, 1, variant.hpz_size) if variant.hpz_link == PACKAGE else (1, variant.hpz_size // k, k)
        secondary = [(lay, volume("all_gather", w, variant.hpz_size))]
    else:
        secondary = _gather_hops(shape, cast(Level, variant.secondary), w, variant.hierarchical_gather)
    hops: list[Hop] = []
    for lay, b in primary:
        hops.append(Hop("forward", "gather", _link(lay), math.prod(lay), b, model.gathers_per_pass, 1, lay))
    for lay, b in secondary:
        if micro_batches > 1:
            hops.append(
                Hop(
                    "forward",
                    "gather",
                    _link(lay),
                    math.prod(lay),
                    b,
                    model.gathers_per_pass,
                    micro_batches - 1,
                    lay,
                )
            )
        hops.append(
            Hop(
                "backward",
                "gather",
                _link(lay),
                math.prod(lay),
                b,
                model.gathers_per_pass,
                micro_batches,
                lay,
            )
        )
    for lay, b in _reduce_hops(shape, g, variant.hierarchical_reduce):
        once = variant.boundary_sync and variant.hierarchical_reduce and lay[0] > 1
        hops.append(
            Hop(
                "backward",
                "reduce",
                _link(lay),
                math.prod(lay),
                quantized(lay, b, variant.grad_factor),
                model.reduce_launches,
                1 if once else micro_batches,
                lay,
            )
        )
    return [h for h in hops if h.members > 1]


def bytes_per_link(
    hops: Sequence[Hop], phase: str | None = None, kind: str | None = None
) -> dict[LinkClass, int]:
    """Computed bytes per link class in :mod:`mdsp_base.comm`'s accounting (comparable to
    ``CommCounter.per_link``).

    Args:
        hops: the collectives (:func:`step_hops`).
        phase: only those of this phase (forward, backward); None: all.
        kind: only those of this kind (gather, reduce); None: all.

    Returns:
        Bytes per rank by link class.
    """
    out = dict.fromkeys(LINK_CLASSES, 0)
    for h in hops:
        if (phase is None or h.phase == phase) and (kind is None or h.kind == kind):
            out[h.link] += h.nbytes * h.times
    return out


def ring_edges(layout: Layout) -> dict[LinkClass, int]:
    """Edges of each link class in a ring over a node- and package-contiguous group."""
    n, q, k = layout
    edges = {PACKAGE: n * q * (k - 1), NODE: n * (q - 1), INTER_NODE: n if n > 1 else 0}
    if n == 1:  # the ring closes inside the node
        edges[NODE if q > 1 else PACKAGE] += 1
    return edges


def ring_wire_bytes(hops: Sequence[Hop], reduce_scatter_wire: float = 1.0) -> dict[LinkClass, float]:
    """Computed bytes per link class a rank puts on the wire, averaged over the group, when every
    collective is a ring: each of its ``members`` edges carries what one rank sends.

    Args:
        hops: the collectives (:func:`step_hops`).
        reduce_scatter_wire: wire bytes of a reduce-scatter per byte of its optimal volume (gloo's
            runs an all-reduce: 2).

    Returns:
        Bytes per rank by link class.
    """
    out = dict.fromkeys(LINK_CLASSES, 0.0)
    for h in hops:
        wire = h.nbytes * (reduce_scatter_wire if h.kind == "reduce" else 1.0)
        for link, count in ring_edges(h.layout).items():
            out[link] += wire * h.times * count / h.members
    return out
