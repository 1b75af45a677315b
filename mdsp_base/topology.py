"""Where each rank sits (node, package, local index) and the process groups of each level.

Ranks are assumed node-contiguous (global rank = node * ranks_per_node + local index), which is
what srun's block distribution and torchrun give; a launch that breaks it is rejected. The level
groups are cut from any parent group (e.g. megatron-core's data-parallel group, whose members are
strided when TP > 1), never from consecutive global ranks.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from pydantic import Field

from mdsp_base.section import ConfigError, Section

# The cost model and the planner CLI import the level enums from here: torch is imported where a
# process group is made, so that they start in well under a second.
if TYPE_CHECKING:
    import torch.distributed as dist

RANK_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def require_launcher(module: str, example_args: str) -> None:
    """Exit 2 with one line saying how to start ``python -m module`` when the launcher's variables
    are missing (a program of one process per rank started by hand), instead of torch's traceback."""
    missing = [name for name in RANK_VARIABLES if name not in os.environ]
    if missing:
        print(
            f"error: python -m {module} runs one process per rank and {', '.join(missing)} are not set: start it "
            f"with torchrun --nnodes <nodes> --nproc-per-node <GPUs per node> -m {module} {example_args}, "
            "or under srun",
            file=sys.stderr,
        )
        raise SystemExit(2)


FRONTIER_RANKS_PER_NODE = 8
FRONTIER_RANKS_PER_PACKAGE = 2  # two GCDs per MI250X: (0,1), (2,3), (4,5), (6,7)


class Level(StrEnum):
    """A unit that holds ranks, innermost first; global is the whole parent group."""

    PACKAGE = "package"
    NODE = "node"
    GLOBAL = "global"


class LinkClass(StrEnum):
    """The slowest link a transfer or a group crosses."""

    PACKAGE = "package"
    NODE = "node"
    INTER_NODE = "inter_node"


class GroupKind(StrEnum):
    """The process groups cut from a parent group: one per level, and the strided groups hops run
    over (the same position in the node's other packages, in the other nodes)."""

    PACKAGE = "package"
    NODE = "node"
    GLOBAL = "global"
    CROSS_PACKAGE = "cross_package"
    CROSS_NODE = "cross_node"


class TopologyConfig(Section):
    ranks_per_node: int | None = Field(default=None, ge=1)
    """Ranks (GPUs/GCDs) per node; null detects it from SLURM_NTASKS_PER_NODE or LOCAL_WORLD_SIZE."""
    ranks_per_package: int | None = Field(default=None, ge=1)
    """Ranks sharing one package (2 GCDs of an MI250X on Frontier, 1 elsewhere); null detects it."""


def check_layout(world_size: int, ranks_per_node: int | None, ranks_per_package: int | None) -> None:
    """Whole packages per node and whole nodes per job (None: not given, nothing to check)."""
    if ranks_per_node and ranks_per_package and ranks_per_node % ranks_per_package:
        raise ConfigError(
            f"topology.ranks_per_node({ranks_per_node}) is not a multiple of "
            f"topology.ranks_per_package({ranks_per_package}): set ranks per package to a divisor"
        )
    if ranks_per_node and world_size > ranks_per_node and world_size % ranks_per_node:
        raise ConfigError(
            f"world({world_size}) is not a whole number of nodes of topology.ranks_per_node({ranks_per_node}): "
            "launch whole nodes or set topology.ranks_per_node"
        )


def check_data_parallel(world_size: int, data_parallel_size: int) -> None:
    """The data-parallel size divides the world (every rank in one DP group of that size)."""
    if data_parallel_size < 1 or world_size % data_parallel_size:
        raise ConfigError(f"data-parallel size {data_parallel_size} does not divide world({world_size})")


@dataclass(frozen=True)
class Topology:
    """The job's layout: ``world_size`` ranks in nodes of ``ranks_per_node``, packages of ``ranks_per_package``."""

    world_size: int
    """Number of ranks in the job."""
    ranks_per_node: int
    """Ranks on each node (the last node may hold fewer only when the job is smaller than a node)."""
    ranks_per_package: int
    """Ranks sharing one package (fast link), 1 where a package is one GPU."""

    def __post_init__(self) -> None:
        check_layout(self.world_size, self.ranks_per_node, self.ranks_per_package)

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.ranks_per_node)

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_index(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def package(self, rank: int) -> int:
        """Global package id of ``rank``."""
        return rank // self.ranks_per_package

    def link_class(self, a: int, b: int) -> LinkClass:
        """The link a transfer between ranks a and b crosses."""
        if self.package(a) == self.package(b):
            return LinkClass.PACKAGE
        return LinkClass.NODE if self.node(a) == self.node(b) else LinkClass.INTER_NODE

    def level_of(self, rank: int, level: Level) -> int:
        """Id of the unit at ``level`` that holds ``rank`` (the whole job for global)."""
        return {Level.PACKAGE: self.package, Level.NODE: self.node, Level.GLOBAL: lambda r: 0}[level](rank)


def _is_frontier(env: Mapping[str, str]) -> bool:
    names = (env.get("SLURM_CLUSTER_NAME", ""), env.get("LMOD_SYSTEM_NAME", ""), socket.gethostname())
    return any(n.lower().startswith("frontier") for n in names)


def _int_env(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value:  # neither unset nor empty
            try:
                return int(value.split("(")[0].split(",")[0])  # SLURM_TASKS_PER_NODE looks like "8(x2)"
            except ValueError:
                raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None
    return None


def detect_topology(
    config: TopologyConfig | None = None, env: Mapping[str, str] | None = None, world_size: int | None = None
) -> Topology:
    """Build the topology from the config section, else Slurm or torchrun variables, Frontier recognised."""
    env = os.environ if env is None else env
    config = config or TopologyConfig()
    world = world_size or _int_env(env, "WORLD_SIZE", "SLURM_NTASKS") or 1
    frontier = _is_frontier(env)
    per_node = (
        config.ranks_per_node
        or _int_env(env, "SLURM_NTASKS_PER_NODE", "LOCAL_WORLD_SIZE", "SLURM_TASKS_PER_NODE")
        or (FRONTIER_RANKS_PER_NODE if frontier else world)
    )
    per_package = config.ranks_per_package or (
        FRONTIER_RANKS_PER_PACKAGE if frontier and per_node % 2 == 0 else 1
    )
    topo = Topology(world_size=world, ranks_per_node=min(per_node, world), ranks_per_package=per_package)
    _check_rank_order(topo, env)
    return topo


def _check_rank_order(topo: Topology, env: Mapping[str, str]) -> None:
    rank = _int_env(env, "RANK", "SLURM_PROCID")
    # SLURM_LOCALID first: with one visible GCD per task the scripts set LOCAL_RANK=0 for device choice.
    local = _int_env(env, "SLURM_LOCALID", "LOCAL_RANK")
    node = _int_env(env, "SLURM_NODEID", "GROUP_RANK")
    if rank is None or local is None:
        return
    if topo.local_index(rank) != local or (node is not None and topo.node(rank) != node):
        raise ConfigError(
            f"rank {rank} has local index {local} on node {node}, but a block layout of "
            f"{topo.ranks_per_node} ranks per node puts it at {topo.local_index(rank)} on node {topo.node(rank)}: "
            "launch with block distribution (srun -m block) or set topology.ranks_per_node"
        )


def level_members(topo: Topology, parent: Sequence[int], rank: int) -> dict[GroupKind, list[int]]:
    """Members of ``parent`` that share ``rank``'s package, node and (all of) the job, plus the
    strided groups a hop needs: same position in the other packages of the node (``cross_package``)
    and same position in the node on the other nodes (``cross_node``)."""
    if rank not in parent:
        raise ValueError(f"rank {rank} is not in the parent group {list(parent)}")
    members = {
        GroupKind(level): [r for r in parent if topo.level_of(r, level) == topo.level_of(rank, level)]
        for level in Level
    }
    in_package, in_node = _positions(topo, parent, Level.PACKAGE), _positions(topo, parent, Level.NODE)
    members[GroupKind.CROSS_PACKAGE] = [
        r for r in members[GroupKind.NODE] if in_package[r] == in_package[rank]
    ]
    members[GroupKind.CROSS_NODE] = [r for r in parent if in_node[r] == in_node[rank]]
    return members


def _positions(topo: Topology, parent: Sequence[int], level: Level) -> dict[int, int]:
    """Each parent member's position among the parent members of its unit at ``level``."""
    seen: dict[int, int] = {}
    positions = {}
    for r in parent:
        unit = topo.level_of(r, level)
        positions[r] = seen.get(unit, 0)
        seen[unit] = positions[r] + 1
    return positions


def partition_of(topo: Topology, parent: Sequence[int], kind: GroupKind) -> list[list[int]]:
    """All groups of one kind (a level or a cross group) that cover ``parent``, in a fixed order."""
    seen: list[list[int]] = []
    for r in parent:
        group = level_members(topo, parent, r)[kind]
        if group not in seen:
            seen.append(group)
    return seen


def check_uniform(topo: Topology, parent: Sequence[int]) -> None:
    """Hierarchical hops need every package (node) to hold the same number of parent members."""
    for level in (Level.PACKAGE, Level.NODE):
        sizes = {len(g) for g in partition_of(topo, parent, GroupKind(level))}
        if len(sizes) > 1:
            raise ConfigError(
                f"the parent group {list(parent)} has {sorted(sizes)} members per {level}: "
                "hierarchical levels need the same count in each; change TP size or topology"
            )


def check_rank_aligned(topo: Topology, cross_node_groups: Sequence[Sequence[int]]) -> None:
    """Each group that crosses nodes holds one local rank position on every node (PCCL's
    rank-aligned sub-communicators): a node's ranks then all send across nodes at once, each in its
    own group, so every NIC carries traffic. Raises ConfigError naming a group that is not."""
    for group in cross_node_groups:
        positions = sorted({topo.local_index(r) for r in group})
        nodes = [topo.node(r) for r in group]
        if len(positions) > 1 or len(set(nodes)) != len(nodes):
            raise ConfigError(
                f"the cross-node group {list(group)} holds local positions {positions} on nodes {nodes}: "
                "each must hold one position, one rank per node; check topology.ranks_per_node against "
                "the launch (block distribution: srun -m block)"
            )


@dataclass
class LevelGroups:
    """This rank's process groups per level, cut from one parent group."""

    members: dict[GroupKind, list[int]]
    """Global ranks of each group this rank belongs to, by kind."""
    groups: dict[GroupKind, dist.ProcessGroup]
    """The process group of each kind."""


def new_level_groups(
    topo: Topology,
    parent_ranks: Sequence[int],
    backend: str | None = None,
    made: dict[tuple[int, ...], dist.ProcessGroup] | None = None,
) -> LevelGroups:
    """Create the level groups of ``parent_ranks``. Collective over the WHOLE job: every rank calls it
    with the same parent lists in the same order (``dist.new_group`` requires that), even ranks
    outside the parent. Returns this rank's groups, or empty maps when it is not a member.

    Each distinct member set becomes one group, shared by every kind that has those members (with
    one member per package, ``cross_package`` is the node group); ``made`` (sorted members -> group,
    filled in here) carries the groups over between calls, so that a set made earlier is reused."""
    import torch.distributed as dist

    parent = sorted(parent_ranks)
    check_uniform(topo, parent)
    rank = dist.get_rank()
    made = {} if made is None else made
    groups: dict[GroupKind, dist.ProcessGroup] = {}
    for kind in GroupKind:
        for members in partition_of(topo, parent, kind):
            key = tuple(sorted(members))
            if key not in made:
                made[key] = dist.new_group(list(key), backend=backend)
            if rank in key:
                groups[kind] = made[key]
    return LevelGroups(members=level_members(topo, parent, rank) if rank in parent else {}, groups=groups)


def all_level_groups(
    topo: Topology,
    parents: Sequence[Sequence[int]],
    backend: str | None = None,
    made: dict[tuple[int, ...], dist.ProcessGroup] | None = None,
) -> LevelGroups:
    """Level groups for a family of disjoint parents (e.g. every DP group): call on every rank.
    ``made`` as in :func:`new_level_groups`."""
    import torch.distributed as dist

    mine = LevelGroups(members={}, groups={})
    rank = dist.get_rank()
    made = {} if made is None else made
    for parent in parents:
        lg = new_level_groups(topo, parent, backend, made)
        if rank in parent:
            mine = lg
    return mine
