"""Time of one collective as a function of (operation, algorithm, ranks, message size, link class).

The one function through which the planner, the projection and the hops' algorithm dispatch
charge every collective, flat rings and hops alike: ``steps x step latency + bus bytes x
concurrent groups / node bandwidth``. Frontier's constants come from its hardware documentation
(the uncertain ones as ranges), H100's from published nccl-tests figures, or a probe profile's
fits replace them; none is fitted to a ratio it is checked against. The model and its sources:
docs/hierarchical_zero_modules.md."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from mdsp_base.topology import LinkClass


class Operation(StrEnum):
    """A collective, by what it computes."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"


class Algorithm(StrEnum):
    """How a collective's blocks travel."""

    RING = "ring"
    """Neighbour to neighbour, ``members - 1`` steps."""
    RECURSIVE = "recursive"
    """Distance doubling / halving, ``ceil(log2 members)`` steps."""


@dataclass(frozen=True)
class AlgorithmFit:
    """One algorithm's cost on one link class."""

    step_us: float
    """Latency of one algorithm step (microseconds)."""
    bus_gbps: float
    """Bus bandwidth at large messages (GB/s): per rank inside a node; across nodes, what one
    communicator pushes through its node's NICs."""


@dataclass(frozen=True)
class CollectiveCosts:
    """Fitted costs of one system's collective library."""

    system: str
    """Label: the machine and library the fits describe."""
    fits: Mapping[tuple[LinkClass, Algorithm], AlgorithmFit]
    """Cost per (link class, algorithm)."""
    nic_gbps: float
    """What a node's NICs carry at once (GB/s), shared by its concurrent inter-node communicators."""
    by_operation: Mapping[tuple[Operation, LinkClass, Algorithm], AlgorithmFit] = field(default_factory=dict)
    """Fits that differ for one operation (RCCL's reduce-scatter across nodes)."""

    def fit(self, operation: Operation, algorithm: Algorithm, link: LinkClass) -> AlgorithmFit:
        """The fit charged to ``operation`` run with ``algorithm`` over ``link``."""
        key = (LinkClass(link), Algorithm(algorithm))
        special = self.by_operation.get((Operation(operation), *key))
        if special is not None:
            return special
        if key not in self.fits:
            raise KeyError(f"{self.system} has no fitted cost for {algorithm} on {link}: add one to its fits")
        return self.fits[key]


def algorithm_steps(algorithm: Algorithm, members: int) -> int:
    """Communication steps of ``algorithm`` over ``members`` ranks."""
    if members <= 1:
        return 0
    return members - 1 if algorithm == Algorithm.RING else math.ceil(math.log2(members))


def recursive_schedule(p: int) -> list[tuple[int, int]]:
    """(distance, blocks) of each distance-doubling step over ``p`` members (halving runs them in
    reverse): the engine's P2P algorithms follow it and the memory model sizes their buffers by it."""
    steps, d = [], 1
    while d < p:
        steps.append((d, min(d, p - d)))
        d *= 2
    return steps


def bus_bytes(operation: Operation, members: int, nbytes: float) -> float:
    """Bytes each rank sends in a bandwidth-optimal algorithm; ``nbytes`` is the gathered output
    (all-gather), the input (reduce-scatter, all-to-all) or the tensor (all-reduce, broadcast: a
    pipelined broadcast forwards all of it)."""
    if members <= 1:
        return 0.0
    if operation == Operation.BROADCAST:
        return float(nbytes)
    factor = 2.0 if operation == Operation.ALL_REDUCE else 1.0
    return factor * nbytes * (members - 1) / members


def seconds(
    costs: CollectiveCosts,
    operation: Operation,
    algorithm: Algorithm,
    members: int,
    nbytes: float,
    link: LinkClass,
    concurrent: int = 1,
) -> float:
    """Seconds of one collective, with ``concurrent`` such communicators per node sharing its NICs.

    Args:
        costs: the link constants (documented, or a probe profile's fits).
        operation: all-gather, reduce-scatter, ...
        algorithm: ring, or the recursive point-to-point algorithm.
        members: ranks in the group.
        nbytes: the gathered (or reduced) message size in bytes.
        link: the slowest link class the group spans.
        concurrent: communicators of the node running at once (all of its ranks).

    Returns:
        Seconds, latency steps plus bus bytes over the bandwidth each communicator gets.
    """
    if members <= 1:
        return 0.0
    fit = costs.fit(operation, algorithm, link)
    steps = algorithm_steps(algorithm, members)
    if operation == Operation.ALL_REDUCE:
        steps *= 2  # a reduce-scatter, then an all-gather
    rate = fit.bus_gbps * 1e9
    volume = bus_bytes(operation, members, nbytes)
    if LinkClass(link) == LinkClass.INTER_NODE:
        rate = min(concurrent * rate, costs.nic_gbps * 1e9) / concurrent
    return steps * fit.step_us * 1e-6 + volume / rate


def fastest(
    costs: CollectiveCosts,
    operation: Operation,
    members: int,
    nbytes: float,
    link: LinkClass,
    concurrent: int = 1,
) -> Algorithm:
    """The algorithm the model projects faster for this call (ring on a tie)."""
    return min(
        (a for a in (Algorithm.RING, Algorithm.RECURSIVE) if (LinkClass(link), a) in costs.fits),
        key=lambda a: seconds(costs, operation, a, members, nbytes, link, concurrent),
    )


MIB = 2**20
# Frontier, from its documentation; nothing fitted. OLCF's Frontier user guide (node architecture):
# the two GCDs of an MI250X share 200 GB/s (package), GCDs on different MI250X 50-100 GB/s (node:
# the lower), one 25 GB/s Slingshot-11 NIC per MI250X, four per node, taken at 90 % (nic_gbps 90).
# Across nodes a ring communicator is assumed to push one NIC's 22.5 GB/s, and each rank pair of the
# point-to-point algorithm half of its MI250X's NIC (its two GCDs share it), 11.25 GB/s. The step
# latency across nodes, 10 us for both algorithms, is an assumption (Slingshot's MPI latency is ~2 us;
# a library step adds its own work). The uncertain two are swept by the projection: ring step 1-10 us,
# ring bandwidth from FRONTIER_RING_GBPS_LOW (what PCCL's smallest speed-up over RCCL, 6x, implies
# per communicator) up to the NIC.
FRONTIER_RING_STEP_US = 10.0
FRONTIER_RING_GBPS = 22.5
FRONTIER_RING_GBPS_LOW = 5.84
FRONTIER_RING_STEP_RANGE_US = (1.0, 10.0)


def frontier_costs(
    ring_step_us: float = FRONTIER_RING_STEP_US, ring_gbps: float = FRONTIER_RING_GBPS
) -> CollectiveCosts:
    """Frontier's costs with the two uncertain inputs given: the inter-node step latency (both
    algorithms) and one ring communicator's inter-node bandwidth."""
    return CollectiveCosts(
        system=f"Frontier (documented hardware; inter-node step {ring_step_us:g} us, ring {ring_gbps:g} GB/s)",
        fits={
            (LinkClass.PACKAGE, Algorithm.RING): AlgorithmFit(step_us=2.0, bus_gbps=200.0),
            (LinkClass.NODE, Algorithm.RING): AlgorithmFit(step_us=4.0, bus_gbps=50.0),
            (LinkClass.INTER_NODE, Algorithm.RING): AlgorithmFit(step_us=ring_step_us, bus_gbps=ring_gbps),
            (LinkClass.INTER_NODE, Algorithm.RECURSIVE): AlgorithmFit(step_us=ring_step_us, bus_gbps=11.25),
        },
        nic_gbps=90.0,
    )


FRONTIER_RCCL = frontier_costs()
# DGX H100 with NCCL (nccl-tests figures quoted in benchmarks/results/zero.md, "The cost model's
# constants against the published figures"): NVLink-4 all-reduce bus bandwidth 460-480 GB/s on 8
# GPUs; 400-450 GB/s across NDR 400 Gb/s nodes, one communicator's rings spread over the node's
# 8 x 50 GB/s NICs; point-to-point hops on one GPU's own NIC. Step latencies assumed (no published per-step figure found).
H100_NCCL = CollectiveCosts(
    system="DGX H100, NCCL over NVLink-4 and 8 x NDR 400 Gb/s",
    fits={
        (LinkClass.PACKAGE, Algorithm.RING): AlgorithmFit(step_us=3.0, bus_gbps=470.0),
        (LinkClass.NODE, Algorithm.RING): AlgorithmFit(step_us=3.0, bus_gbps=470.0),
        (LinkClass.INTER_NODE, Algorithm.RING): AlgorithmFit(step_us=6.0, bus_gbps=425.0),
        (LinkClass.INTER_NODE, Algorithm.RECURSIVE): AlgorithmFit(step_us=12.0, bus_gbps=50.0),
    },
    nic_gbps=425.0,
)


def with_bandwidths(costs: CollectiveCosts, gbps: Mapping[LinkClass, float] | None) -> CollectiveCosts:
    """``costs`` with the link speeds a config gives (``hierarchical_zero.link_bandwidth_gbps``):
    package and node set every algorithm's bus bandwidth on that link, inter_node the node's NICs
    together; latencies stay fitted."""
    if not gbps:
        return costs
    fits = {
        key: replace(fit, bus_gbps=gbps[key[0]]) if key[0] in gbps and key[0] != LinkClass.INTER_NODE else fit
        for key, fit in costs.fits.items()
    }
    return replace(costs, fits=fits, nic_gbps=gbps.get(LinkClass.INTER_NODE, costs.nic_gbps))


def for_topology(ranks_per_package: int, gbps: Mapping[LinkClass, float] | None = None) -> CollectiveCosts:
    """The costs the planner charges and ``inter_node_algorithm: auto`` compares: Frontier's
    RCCL where a package holds several ranks (MI250X), NCCL on H100 nodes otherwise; with ``gbps``
    (``hierarchical_zero.link_bandwidth_gbps``) the link speeds a config gives."""
    return with_bandwidths(FRONTIER_RCCL if ranks_per_package > 1 else H100_NCCL, gbps)
