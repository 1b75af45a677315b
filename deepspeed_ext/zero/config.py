"""The ``hierarchical_zero`` section of the DeepSpeed JSON."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from deepspeed_ext.section import Section


class HierarchicalZeroConfig(Section):
    enabled: bool = False
    """Use the hierarchical ZeRO-3 variant (needs zero_optimization.stage 3)."""
    secondary_level: Literal["auto", "package", "node"] = "auto"
    """Level of the secondary 16-bit weight partition; auto picks the fastest one that fits the budget."""
    secondary_memory_budget_gb: float = Field(default=8.0, gt=0)
    """Extra memory per rank (GB) that the secondary weight copy may take when secondary_level is auto."""
    grad_reduce: Literal["hierarchical", "flat"] = "hierarchical"
    """Gradient reduce-scatter in hops package -> node -> global, or one flat reduce-scatter."""
    link_bandwidth_gbps: dict[Literal["package", "node", "inter_node"], float] | None = None
    """GB/s per link class (package, node, inter_node) for the cost model; null uses Frontier's 200 / 50 / 25."""
