"""Per-step communication bytes and time of ZeRO-3, ZeRO++ and the hierarchical variant.

Bytes follow :mod:`deepspeed_ext.comm`'s accounting exactly (per rank, bandwidth-optimal volume,
charged to the slowest link class a group spans), so a prediction can be compared with a count.
Time is an alpha-beta model per hop: ``bytes / bandwidth(link) + (members - 1) * latency(link)``
per collective launch, hops run one after the other, no overlap with compute (``step_time`` adds
that). What is assumed about the step (what ZeRO-3 does with ``stage3_max_reuse_distance=0`` and
``stage3_param_persistence_threshold=0``): every parameter is gathered once per forward and once
per backward of each micro-batch; gradients are reduce-scattered once per micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from deepspeed_ext.comm import LINK_CLASSES, volume

# Frontier: GCD pair 200 GB/s; GCDs on different MI250X 50-100 GB/s; 4 x 25 GB/s NICs per 8 GCDs.
FRONTIER_BANDWIDTH_GBPS = {"package": 200.0, "node": 50.0, "inter_node": 25.0}
FRONTIER_LATENCY_US = {"package": 2.0, "node": 4.0, "inter_node": 10.0}
# ZeRO++ (arXiv 2306.10209): qwZ sends INT8 weights plus block scales (~half of fp16), qgZ INT4 gradients.
QWZ_BYTES_FACTOR = 0.5
QGZ_BYTES_FACTOR = 0.25


@dataclass(frozen=True)
class Links:
    """Speed of each link class as one rank sees it while every rank of its node communicates."""

    bandwidth_gbps: dict[str, float] = field(default_factory=lambda: dict(FRONTIER_BANDWIDTH_GBPS))
    """GB/s per link: package and node per rank, inter_node per NIC."""
    latency_us: dict[str, float] = field(default_factory=lambda: dict(FRONTIER_LATENCY_US))
    """Per-step latency of a ring collective on each link class (microseconds)."""
    ranks_per_nic: int = 2
    """Ranks sharing one NIC (Frontier: the two GCDs of an MI250X); divides inter_node bandwidth."""

    def rank_bandwidth(self, link: str) -> float:
        """Bytes per second one rank gets on ``link``."""
        share = self.ranks_per_nic if link == "inter_node" else 1
        return self.bandwidth_gbps[link] * 1e9 / share


@dataclass(frozen=True)
class DPShape:
    """The data-parallel group as nodes x packages per node x members per package."""

    nodes: int
    """Nodes holding members of the group."""
    packages_per_node: int
    """Packages per node holding members."""
    per_package: int
    """Members in each package."""

    @property
    def size(self) -> int:
        return self.nodes * self.packages_per_node * self.per_package

    def span(self, nodes: int, packages: int) -> str:
        """Link class of a group spanning ``nodes`` nodes and ``packages`` packages per node."""
        return "inter_node" if nodes > 1 else ("node" if packages > 1 else "package")


@dataclass(frozen=True)
class ModelSpec:
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
class Variant:
    """Where each collective of a ZeRO-3 step runs."""

    name: str
    """Label in reports."""
    secondary: str = "global"
    """Secondary weight copy: global (none), package, node, or hpz (consecutive-rank groups)."""
    hpz_size: int = 1
    """Members of an hpZ group when secondary is hpz."""
    hpz_link: str = "node"
    """Link class an hpZ group spans."""
    hierarchical_gather: bool = False
    """Primary and node-level gathers in hops (cross-node, cross-package, package)."""
    hierarchical_reduce: bool = False
    """Gradient reduce-scatter in hops (package, cross-package, cross-node)."""
    weight_factor: float = 1.0
    """Bytes on the wire per gathered byte on the primary gather (qwZ: 0.5)."""
    grad_factor: float = 1.0
    """Bytes on the wire per reduced byte across nodes (qgZ: 0.25)."""


ZERO3 = Variant("zero3")


def hpz(size: int, link: str = "node") -> Variant:
    return Variant(f"zero++ hpZ({size})", secondary="hpz", hpz_size=size, hpz_link=link)


def zeropp_paper(size: int, link: str = "node") -> Variant:
    """ZeRO++ with hpZ, qwZ and qgZ as the paper describes them (their kernels need a GPU)."""
    return Variant(f"zero++ hpZ({size})+qwZ+qgZ", secondary="hpz", hpz_size=size, hpz_link=link,
                   weight_factor=QWZ_BYTES_FACTOR, grad_factor=QGZ_BYTES_FACTOR)


def hierarchical(secondary: str, grad_reduce: str = "hierarchical") -> Variant:
    return Variant(f"hierarchical({secondary})", secondary=secondary, hierarchical_gather=True,
                   hierarchical_reduce=grad_reduce == "hierarchical")


@dataclass(frozen=True)
class Hop:
    """One collective launch pattern of a step."""

    phase: str
    """forward, backward or step."""
    kind: str
    """gather or reduce."""
    link: str
    """Link class of the group."""
    members: int
    """Group size."""
    nbytes: int
    """Bytes this rank sends per occurrence."""
    launches: int
    """Collective launches per occurrence (for the latency term)."""
    times: int
    """Occurrences per step."""


def _gather_hops(shape: DPShape, level: str, nbytes: int, hierarchical_hops: bool) -> list[tuple[str, int, int]]:
    """(link, members, bytes sent) of gathering ``nbytes`` of full weights over ``level``'s group."""
    n, q, k = shape.nodes, shape.packages_per_node, shape.per_package
    stages = {"package": [(k, "package")], "node": [(q, "node"), (k, "package")],
              "global": [(n, "inter_node"), (q, "node"), (k, "package")]}[level]
    members = math.prod(m for m, _ in stages)
    if not hierarchical_hops:
        link = shape.span(n if level == "global" else 1, q if level != "package" else 1)
        return [(link, members, volume("all_gather", nbytes, members))]
    hops, held = [], nbytes // members
    for m, link in stages:  # outermost first: each hop gathers what the next one spreads
        held *= m
        hops.append((link, m, volume("all_gather", held, m)))
    return hops


def _reduce_hops(shape: DPShape, nbytes: int, hierarchical_hops: bool) -> list[tuple[str, int, int]]:
    n, q, k = shape.nodes, shape.packages_per_node, shape.per_package
    if not hierarchical_hops:
        return [(shape.span(n, q), shape.size, volume("reduce_scatter", nbytes, shape.size))]
    hops, held = [], nbytes
    for m, link in ((k, "package"), (q, "node"), (n, "inter_node")):  # each hop on the previous result
        hops.append((link, m, volume("reduce_scatter", held, m)))
        held //= m
    return hops


def step_hops(model: ModelSpec, shape: DPShape, variant: Variant, micro_batches: int = 1) -> list[Hop]:
    """Every collective of one steady-state optimizer step (``micro_batches`` forward+backward)."""
    dp = shape.size
    w = model.padded(dp) * model.weight_bytes
    g = model.padded(dp) * model.grad_bytes
    primary = [(link, m, int(b * variant.weight_factor))
               for link, m, b in _gather_hops(shape, "global", w, variant.hierarchical_gather)]
    if variant.secondary == "global":
        secondary = primary
    elif variant.secondary == "hpz":
        secondary = [(variant.hpz_link, variant.hpz_size, volume("all_gather", w, variant.hpz_size))]
    else:
        secondary = _gather_hops(shape, variant.secondary, w, variant.hierarchical_gather)
    reduce = [(link, m, int(b * (variant.grad_factor if link == "inter_node" else 1)))
              for link, m, b in _reduce_hops(shape, g, variant.hierarchical_reduce)]
    hops: list[Hop] = []
    for link, m, b in primary:
        hops.append(Hop("forward", "gather", link, m, b, model.gathers_per_pass, 1))
    for link, m, b in secondary:
        if micro_batches > 1:
            hops.append(Hop("forward", "gather", link, m, b, model.gathers_per_pass, micro_batches - 1))
        hops.append(Hop("backward", "gather", link, m, b, model.gathers_per_pass, micro_batches))
    for link, m, b in reduce:
        hops.append(Hop("backward", "reduce", link, m, b, model.reduce_launches, micro_batches))
    return [h for h in hops if h.members > 1]


def bytes_per_link(hops: Sequence[Hop], phase: str | None = None, kind: str | None = None) -> dict[str, int]:
    """Bytes per link class of the hops that match (None matches all): comparable to CommCounter.per_link."""
    out = dict.fromkeys(LINK_CLASSES, 0)
    for h in hops:
        if (phase is None or h.phase == phase) and (kind is None or h.kind == kind):
            out[h.link] += h.nbytes * h.times
    return out


def comm_time(hops: Sequence[Hop], links: Links) -> float:
    """Seconds of communication in one step, hops one after the other."""
    total = 0.0
    for h in hops:
        per = h.nbytes / links.rank_bandwidth(h.link) + h.launches * (h.members - 1) * links.latency_us[h.link] * 1e-6
        total += per * h.times
    return total


def step_time(compute_s: float, comm_s: float, overlap: float) -> float:
    """Step time when a fraction ``overlap`` (0..1) of communication hides behind compute."""
    hidden = min(overlap * comm_s, compute_s)
    return compute_s + comm_s - hidden
