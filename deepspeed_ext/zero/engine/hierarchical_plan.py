"""The plan types of the hierarchical ZeRO-3 variant: what it reads of the configuration
(:class:`Sections`) and what it decided for this rank (:class:`HierarchicalPlan`).

Kept apart from the entry point so that both it and the registry of this process's plans
(:mod:`.known_plans`) name the plan's type without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from deepspeed_ext.zero.config import HierarchicalZeroConfig
from deepspeed_ext.zero.cost.secondary_level import SecondaryChoice, placement_for
from deepspeed_ext.zero.cost.volume import ShardSpec, bytes_per_link, step_hops
from deepspeed_ext.zero.engine.levels import ZeroLevels
from mdsp_base.topology import LinkClass, TopologyConfig


class Sections(Protocol):
    """What the variant reads of the effective configuration: its own section and the topology's
    (the suite's assembled configuration is one; without one they are read from the DeepSpeed JSON)."""

    # Read-only, so that a frozen dataclass (JsonSections) conforms as well as a pydantic model.
    @property
    def hierarchical_zero(self) -> HierarchicalZeroConfig: ...
    @property
    def topology(self) -> TopologyConfig: ...


@dataclass(frozen=True)
class JsonSections:
    """The two sections as the DeepSpeed JSON gives them."""

    hierarchical_zero: HierarchicalZeroConfig
    """The ``hierarchical_zero`` section."""
    topology: TopologyConfig
    """The ``topology`` section."""

    @classmethod
    def of(cls, ds: dict) -> JsonSections:
        """The sections of the DeepSpeed config ``ds``, validated (defaults where absent)."""
        return cls(
            HierarchicalZeroConfig.parse(ds.get("hierarchical_zero"), "hierarchical_zero"),
            TopologyConfig.parse(ds.get("topology"), "topology"),
        )


@dataclass
class HierarchicalPlan:
    """What the variant decided for this rank, kept on the engine as ``engine.hierarchical_zero``."""

    levels: ZeroLevels
    """Groups and the chosen secondary level."""
    choice: SecondaryChoice
    """The planner's figures."""
    model: ShardSpec
    """This rank's parameters as the cost model sees them."""

    def predicted_bytes(self, micro_batches: int = 1) -> dict[LinkClass, int]:
        """Bytes per link class this rank sends in one steady-state step (gathers and reductions).

        Args:
            micro_batches: gradient-accumulation steps per optimizer step.

        Returns:
            Bytes by link class (package, node, inter-node).
        """
        variant = placement_for(self.levels.config, self.levels.secondary_level, self.model)
        return bytes_per_link(step_hops(self.model, self.levels.shape, variant, micro_batches))
