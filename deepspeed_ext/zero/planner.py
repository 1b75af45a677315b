"""Choice of the secondary weight level (``secondary_level: auto``) from the cost model."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from deepspeed_ext.topology import Level, LinkClass
from deepspeed_ext.zero.config import HierarchicalZeroConfig
from deepspeed_ext.zero.cost_model import (
    FRONTIER_BANDWIDTH_GBPS,
    Links,
    ModelSpec,
    Variant,
    comm_time,
    hierarchical,
    step_hops,
)
from deepspeed_ext.zero.levels import DPShape

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SecondaryChoice:
    """The chosen level and the figures behind it."""

    level: Level
    """The secondary copy's level (global: none)."""
    extra_bytes: dict[Level, int]
    """Memory per rank the variant adds at each candidate level (and global): the secondary copy
    plus the fp32 gradient blocks held for the cross-node hop."""
    step_seconds: dict[Level, float]
    """Modelled communication time of one step at each candidate level (and global)."""
    budget_bytes: int
    """secondary_memory_budget_gb in bytes."""
    reason: str
    """One line on why this level."""


def links_for(config: HierarchicalZeroConfig, ranks_per_nic: int) -> Links:
    """The cost model's links from the config (Frontier's figures where it gives none)."""
    bandwidth = dict(FRONTIER_BANDWIDTH_GBPS)
    bandwidth.update({LinkClass(k): v for k, v in (config.link_bandwidth_gbps or {}).items()})
    return Links(bandwidth_gbps=bandwidth, ranks_per_nic=ranks_per_nic)


def variant_for(config: HierarchicalZeroConfig, level: Level, model: ModelSpec) -> Variant:
    """The cost model's variant for this config: boundary sync and quantized hops included (an int
    element of ``bits`` plus one fp32 scale per ``quantization_block``, over the dense element)."""
    per_scale = 4 / config.quantization_block
    weights = (1 + per_scale) / model.weight_bytes if config.quantized_weights else 1.0
    grads = (config.grad_bits / 8 + per_scale) / model.grad_bytes if config.grad_bits else 1.0
    boundary = config.grad_sync == "accumulation_boundary"
    return hierarchical(level, config.grad_reduce, boundary, weights, grads)


def held_bytes(config: HierarchicalZeroConfig, shape: DPShape, model: ModelSpec) -> int:
    """fp32 bytes per rank kept for the cross-node gradient hop: the node-level block summed until
    the boundary (grad_sync) and the error-feedback residual (quantized_gradients)."""
    if shape.nodes == 1:
        return 0
    node_block = model.padded(shape.size) // (shape.per_package * shape.packages_per_node) * 4
    return node_block * ((config.grad_sync == "accumulation_boundary") + (config.grad_bits is not None))


def candidate_sizes(shape: DPShape) -> dict[Level, int]:
    """Secondary levels worth having: a level spanning the whole group would copy the primary
    partition: pure cost, since every module release then copies each weight (docs/gpu.md)."""
    sizes = {Level.PACKAGE: shape.per_package} if shape.per_package < shape.size else {}
    if shape.nodes > 1:
        sizes[Level.NODE] = shape.per_package * shape.packages_per_node
    return sizes


def choose_secondary_level(
    config: HierarchicalZeroConfig, shape: DPShape, model: ModelSpec, links: Links, micro_batches: int = 1
) -> SecondaryChoice:
    """Fastest level whose extra memory fits the budget (auto), or the configured level."""
    full = model.padded(shape.size) * model.weight_bytes
    held = held_bytes(config, shape, model)
    extra = {level: full // size + held for level, size in candidate_sizes(shape).items()}
    seconds = {
        level: comm_time(step_hops(model, shape, variant_for(config, level, model), micro_batches), links)
        for level in (*extra, Level.GLOBAL)
    }
    extra[Level.GLOBAL] = held
    budget = int(config.secondary_memory_budget_gb * 1e9)
    requested = config.secondary_level
    if requested != "auto":
        if requested not in extra:
            level, reason = (
                Level.GLOBAL,
                f"{requested} level spans the whole data-parallel group: no secondary copy",
            )
        else:
            level, reason = Level(requested), "configured"
            if extra[level] > budget:
                reason += f" (over the {config.secondary_memory_budget_gb} GB budget)"
    else:
        fitting = [lvl for lvl in extra if lvl != Level.GLOBAL and extra[lvl] <= budget]
        if fitting:
            level = min(fitting, key=lambda lvl: seconds[lvl])
            reason = "fastest level within the memory budget"
        else:
            level, reason = (
                Level.GLOBAL,
                "no level fits the memory budget: backward gathers use the primary partition",
            )
    return SecondaryChoice(
        level=level, extra_bytes=extra, step_seconds=seconds, budget_bytes=budget, reason=reason
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def describe(choice: SecondaryChoice, shape: DPShape) -> str:
    """One log line with the numbers behind the choice."""
    figures = ", ".join(
        f"{lvl}: +{_size(choice.extra_bytes.get(lvl, 0))}, {choice.step_seconds[lvl] * 1e3:.2f} ms/step"
        for lvl in choice.step_seconds
    )
    return (
        f"hierarchical ZeRO: DP group {shape.size} = {shape.nodes} node(s) x {shape.packages_per_node} "
        f"package(s) x {shape.per_package}; secondary level {choice.level} ({choice.reason}; budget "
        f"{_size(choice.budget_bytes)}); modelled: {figures}"
    )
