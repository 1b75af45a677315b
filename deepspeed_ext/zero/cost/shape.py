"""The shape of a data-parallel group: nodes x packages per node x members per package. The cost
model charges by it and the engine cuts its levels by it; it imports no torch, so that the
recommendation CLI starts in well under a second."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mdsp_base.section import ConfigError
from mdsp_base.topology import GroupKind, Topology, check_uniform, level_members


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
    def per_node(self) -> int:
        """Members on each node."""
        return self.packages_per_node * self.per_package

    @property
    def size(self) -> int:
        return self.nodes * self.per_node


def dp_shape(topology: Topology, dp_ranks: Sequence[int]) -> DPShape:
    """Nodes x packages x members of a data-parallel group.

    Args:
        topology: the ranks' placement on nodes and packages.
        dp_ranks: the group's global ranks.

    Returns:
        Its shape.

    Raises:
        ConfigError: the group does not hold the same number of ranks in every package or node.
    """
    ranks = sorted(dp_ranks)
    check_uniform(topology, ranks)
    members = level_members(topology, ranks, ranks[0])
    per_package = len(members[GroupKind.PACKAGE])
    per_node = len(members[GroupKind.NODE])
    if per_node % per_package or len(ranks) % per_node:
        raise ConfigError(
            f"level sizes do not divide the data-parallel size {len(ranks)}: {per_package} per package, "
            f"{per_node} per node; fix topology.ranks_per_node / ranks_per_package or the TP size"
        )
    return DPShape(
        nodes=len(ranks) // per_node, packages_per_node=per_node // per_package, per_package=per_package
    )
