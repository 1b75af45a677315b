"""Time of one collective as a function of (operation, algorithm, ranks, message size, link class).

The one function through which the planner, the projection and the hops' algorithm dispatch
charge every collective: the baseline's flat rings and our hops alike (our hops are the same
library's collectives on smaller groups, or point-to-point transfers). Model: ``steps x step
latency + bus bytes / bus bandwidth``, where a ring takes ``members - 1`` steps and the recursive
algorithms ``ceil(log2 members)``, and both move the bandwidth-optimal bus bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from deepspeed_ext.topology import LinkClass


class Operation(StrEnum):
    """A collective, by what it computes."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"


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
    """Bus bandwidth one rank achieves at large messages (GB/s)."""


@dataclass(frozen=True)
class CollectiveCosts:
    """Fitted costs of one system's collective library."""

    system: str
    """Label: the machine and library the fits describe."""
    fits: Mapping[tuple[LinkClass, Algorithm], AlgorithmFit]
    """Cost per (link class, algorithm)."""


def algorithm_steps(algorithm: Algorithm, members: int) -> int:
    """Communication steps of ``algorithm`` over ``members`` ranks."""
    if members <= 1:
        return 0
    return members - 1 if algorithm == Algorithm.RING else math.ceil(math.log2(members))


def bus_bytes(operation: Operation, members: int, nbytes: float) -> float:
    """Bytes each rank sends in a bandwidth-optimal algorithm; ``nbytes`` is the gathered output
    (all-gather), the input (reduce-scatter, all-to-all) or the tensor (all-reduce)."""
    if members <= 1:
        return 0.0
    factor = 2.0 if operation == Operation.ALL_REDUCE else 1.0
    return factor * nbytes * (members - 1) / members


def seconds(
    costs: CollectiveCosts,
    operation: Operation,
    algorithm: Algorithm,
    members: int,
    nbytes: float,
    link: LinkClass,
) -> float:
    """Seconds of one collective of ``nbytes`` over ``members`` ranks spanning ``link``."""
    if members <= 1:
        return 0.0
    fit = costs.fits[(LinkClass(link), Algorithm(algorithm))]
    steps = algorithm_steps(algorithm, members)
    if operation == Operation.ALL_REDUCE:
        steps *= 2  # a reduce-scatter, then an all-gather
    return steps * fit.step_us * 1e-6 + bus_bytes(operation, members, nbytes) / (fit.bus_gbps * 1e9)


def fastest(
    costs: CollectiveCosts, operation: Operation, members: int, nbytes: float, link: LinkClass
) -> Algorithm:
    """The algorithm the model projects faster for this call (ring on a tie)."""
    return min(
        (Algorithm.RING, Algorithm.RECURSIVE),
        key=lambda a: seconds(costs, operation, a, members, nbytes, link),
    )


# TO CALIBRATE: the previous cost model's assumed figures (25 GB/s NIC shared by 2 ranks, 10 us per
# step), until the fit to published measurements replaces them.
_ASSUMED = {
    (LinkClass.PACKAGE, Algorithm.RING): AlgorithmFit(2.0, 200.0),
    (LinkClass.NODE, Algorithm.RING): AlgorithmFit(4.0, 50.0),
    (LinkClass.INTER_NODE, Algorithm.RING): AlgorithmFit(10.0, 12.5),
    (LinkClass.INTER_NODE, Algorithm.RECURSIVE): AlgorithmFit(10.0, 12.5),
}
FRONTIER_RCCL = CollectiveCosts("frontier-rccl (assumed)", _ASSUMED)
H100_NCCL = CollectiveCosts("h100-nccl (assumed)", _ASSUMED)


def for_topology(ranks_per_package: int) -> CollectiveCosts:
    """The fitted costs ``inter_node_algorithm: auto`` uses: Frontier's RCCL where a package holds
    several ranks (MI250X), NCCL on H100 nodes otherwise."""
    return FRONTIER_RCCL if ranks_per_package > 1 else H100_NCCL
