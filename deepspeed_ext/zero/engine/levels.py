"""The data-parallel group cut into levels (package, node, global) and the hop schedules built on them.

A *hop schedule* runs a collective over a parent group as a chain of collectives over sub-groups
whose sizes multiply to the parent's: reduce-scatter innermost first, all-gather outermost first
(:mod:`.hops`). The level and link-class enums are :mod:`mdsp_base.topology`'s, shared with the
byte counter and the node loader."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deepspeed_ext.zero.config import HierarchicalZeroConfig, InterNodeAlgorithm
from deepspeed_ext.zero.cost.profile import Profile
from deepspeed_ext.zero.cost.shape import DPShape, dp_shape
from mdsp_base.topology import (
    GroupKind,
    Level,
    LevelGroups,
    LinkClass,
    Topology,
    all_level_groups,
    check_rank_aligned,
    partition_of,
)

if TYPE_CHECKING:
    import torch.distributed as dist

# The link each hop group's ring runs on.
HOP_LINKS = {
    GroupKind.PACKAGE: LinkClass.PACKAGE,
    GroupKind.CROSS_PACKAGE: LinkClass.NODE,
    GroupKind.CROSS_NODE: LinkClass.INTER_NODE,
}


@dataclass(frozen=True)
class HopSchedule:
    """A collective over ``parent`` run as hops, innermost (fastest link) first."""

    parent: tuple[int, ...]
    """Global ranks of the parent group in group-rank order (sorted)."""
    sizes: tuple[int, ...]
    """Members of each hop's group, innermost first; their product is the parent's size."""
    groups: tuple[dist.ProcessGroup, ...]
    """This rank's process group for each hop."""
    links: tuple[LinkClass, ...]
    """Link class each hop runs on."""
    inter_node: InterNodeAlgorithm = InterNodeAlgorithm.RING
    """Algorithm of the hops that cross nodes (auto: chosen per call from ``profile``)."""
    profile: Profile | None = None
    """The probe's timings ``auto`` compares the algorithms with (None: auto runs ring)."""
    row_cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Per device, the hop-order row of each parent member that :func:`.hops.pack` writes to, made
    on the device at the first pack there and freed with the plan (so no pack copies an index to
    the device)."""

    @property
    def is_trivial(self) -> bool:
        """True when at most one hop moves data: the flat collective is the same thing."""
        return sum(size > 1 for size in self.sizes) <= 1


@dataclass
class ZeroLevels:
    """Everything the hierarchical variant needs about this rank's data-parallel group."""

    topology: Topology
    """Rank placement."""
    shape: DPShape
    """The data-parallel group as nodes x packages x members."""
    groups: LevelGroups
    """Process groups of each level and cross group, our own objects (not megatron's)."""
    secondary_level: Level
    """Level of the secondary 16-bit weight partition (global: none)."""
    config: HierarchicalZeroConfig
    """How the hops run (gradient reduce, cross-node sync, quantization)."""
    self_group: dist.ProcessGroup
    """A group of this rank alone: the model-parallel group when the model has no mpu (the same
    object as a level group of this rank alone, e.g. the package group at one member per package)."""
    profile: Profile | None = None
    """The probe's timings ``inter_node_algorithm: auto`` compares the algorithms with."""

    def destroy_groups(self) -> None:
        """Destroy the process groups made for these levels that hold this rank (each rank its own;
        no collective), each once however many kinds share it. The levels are unusable afterwards."""
        import torch.distributed as dist

        made = {id(g): g for g in (*self.groups.groups.values(), self.self_group)}
        for group in made.values():
            dist.destroy_process_group(group)
        self.groups = LevelGroups(members={}, groups={})

    @property
    def grad_reduce(self) -> str:
        return self.config.grad_reduce

    @property
    def dp_ranks(self) -> tuple[int, ...]:
        return tuple(self.groups.members[GroupKind.GLOBAL])

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """Our own data-parallel group: the identity the collective dispatchers recognise."""
        return self.groups.groups[GroupKind.GLOBAL]

    @property
    def secondary_group(self) -> dist.ProcessGroup | None:
        return (
            None
            if self.secondary_level == Level.GLOBAL
            else self.groups.groups[GroupKind(self.secondary_level)]
        )

    def _plan(self, kinds: Sequence[GroupKind], parent: GroupKind) -> HopSchedule:
        sizes = tuple(len(self.groups.members[k]) for k in kinds)
        return HopSchedule(
            parent=tuple(self.groups.members[parent]),
            sizes=sizes,
            groups=tuple(self.groups.groups[k] for k in kinds),
            links=tuple(HOP_LINKS[k] for k in kinds),
            inter_node=self.config.inter_node_algorithm,
            profile=self.profile,
        )

    def dp_plan(self) -> HopSchedule:
        """Hops over the whole data-parallel group."""
        return self._plan(
            (GroupKind.PACKAGE, GroupKind.CROSS_PACKAGE, GroupKind.CROSS_NODE), GroupKind.GLOBAL
        )

    def secondary_plan(self) -> HopSchedule | None:
        """Hops of a secondary (backward) gather; None when there is no secondary copy."""
        if self.secondary_level == Level.GLOBAL:
            return None
        kinds = [GroupKind.PACKAGE] + (
            [GroupKind.CROSS_PACKAGE] if self.secondary_level == Level.NODE else []
        )
        return self._plan(kinds, GroupKind(self.secondary_level))


def build_levels(
    topology: Topology,
    dp_group: dist.ProcessGroup | None,
    secondary_level: Level,
    config: HierarchicalZeroConfig,
    profile: Profile | None = None,
) -> ZeroLevels:
    """Create the level groups of every data-parallel group of the job. Collective over the whole job
    (each rank learns the others' DP groups, then all create the same groups in the same order)."""
    import torch.distributed as dist

    mine = sorted(
        dist.get_process_group_ranks(dp_group) if dp_group is not None else range(dist.get_world_size())
    )
    shape = dp_shape(topology, mine)
    secondary_size = {Level.PACKAGE: shape.per_package, Level.NODE: shape.per_node}
    if secondary_size.get(Level(secondary_level), 0) == shape.size:
        # its group would be the data-parallel group itself (one object, one route for both)
        raise ValueError(
            f"secondary level {secondary_level} spans the whole data-parallel group: "
            "no secondary copy there, use global"
        )
    everyone: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    parents = sorted({tuple(p) for p in everyone if p is not None})
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for parent in parents:
        check_rank_aligned(topology, partition_of(topology, parent, GroupKind.CROSS_NODE))
    groups = all_level_groups(topology, parents, made=made)
    for r in range(dist.get_world_size()):  # a group of each rank alone, shared with such level groups
        if (r,) not in made:
            made[(r,)] = dist.new_group([r])
    return ZeroLevels(
        topology=topology,
        shape=shape,
        groups=groups,
        secondary_level=Level(secondary_level),
        config=config,
        self_group=made[(dist.get_rank(),)],
        profile=profile,
    )
