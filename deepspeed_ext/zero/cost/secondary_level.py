"""Choice of the secondary weight level (``secondary_level: auto``) from the cost model."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from deepspeed_ext.zero.config import GradSync, HierarchicalZeroConfig, InterNodeAlgorithm
from deepspeed_ext.zero.cost import collectives, projection
from deepspeed_ext.zero.cost.memory import NO_BUFFERS, HopBuffers, held_bytes
from deepspeed_ext.zero.cost.profile import Profile
from deepspeed_ext.zero.cost.shape import DPShape
from deepspeed_ext.zero.cost.volume import Placement, ShardSpec, hierarchical
from deepspeed_ext.zero.cost.workload import Buckets, System
from mdsp_base.topology import Level, LinkClass, Topology

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SecondaryChoice:
    """The chosen level and the figures behind it."""

    level: Level
    """The secondary copy's level (global: none)."""
    extra_bytes: dict[Level, int]
    """Memory per rank the variant adds at each candidate level (and global): the secondary copy,
    the fp32 gradient blocks held for the cross-node hop and the transient hop buffers."""
    step_seconds: dict[Level, float]
    """Modelled communication time of one step at each candidate level (and global): the
    projection's (projection.comm_seconds), as the planner CLI computes it."""
    budget_bytes: int
    """secondary_memory_budget_gb in bytes."""
    buffers: HopBuffers
    """Transient hop buffers, counted in every level's extra bytes."""
    reason: str
    """One line on why this level."""


def placement_for(config: HierarchicalZeroConfig, level: Level, model: ShardSpec) -> Placement:
    """The cost model's variant for this config: boundary sync and quantized hops included (an int
    element of ``bits`` plus one fp32 scale per ``quantization_block``, over the dense element)."""
    per_scale = 4 / config.quantization_block
    weights = (1 + per_scale) / model.weight_bytes if config.quantized_weights else 1.0
    grads = (config.grad_bits / 8 + per_scale) / model.grad_bytes if config.grad_bits else 1.0
    boundary = config.grad_sync == "accumulation_boundary"
    return hierarchical(level, config.grad_reduce, boundary, weights, grads)


def as_charged(config: HierarchicalZeroConfig, micro_batches: int) -> HierarchicalZeroConfig:
    """The config as the planner charges it: boundary sync at one micro-batch per step holds
    nothing (every micro-batch is a boundary) and moves what every-micro-batch sync moves."""
    if micro_batches == 1 and config.grad_sync == GradSync.ACCUMULATION_BOUNDARY:
        return config.model_copy(update={"grad_sync": GradSync.EVERY_MICRO_BATCH})
    return config


def level_seconds(
    config: HierarchicalZeroConfig,
    shape: DPShape,
    model: ShardSpec,
    topology: Topology,
    level: Level,
    micro_batches: int = 1,
    buckets: Buckets | None = None,
    profile: Profile | None = None,
) -> float:
    """Communication of one step with the secondary copy at ``level`` (global: none), computed
    by the projection the planner CLI uses: DeepSpeed's gathers (one per parameter-owning module
    and pass, split at the prefetch bucket) and reduce buckets, each charged through
    :mod:`.collectives` with the costs the probe's ``profile`` fits, else the documented costs of this
    topology (Frontier's where packages hold several ranks, H100's otherwise). Hops across nodes
    are charged the algorithm the runtime runs: auto is ring without a profile."""
    buckets = buckets or Buckets()
    costs = collectives.for_topology(topology.ranks_per_package, config.link_bandwidth_gbps)
    system = System(
        costs if profile is None else profile.costs(costs),
        ranks_per_node=topology.ranks_per_node,
        ranks_per_package=topology.ranks_per_package,
    )
    inter_node = config.inter_node_algorithm
    if inter_node == InterNodeAlgorithm.AUTO and profile is None:
        inter_node = InterNodeAlgorithm.RING
    plan = projection.Candidate(
        projection.Scheme.OURS,
        grad_accum=micro_batches,
        secondary=None if level == Level.GLOBAL else LinkClass(level),
        inter_node=inter_node,
        quantized_weights=config.quantized_weights,
        quantized_gradients=config.grad_bits is not None,
        boundary_sync=config.grad_sync == "accumulation_boundary",
        pipeline_chunks=config.pipeline_chunks,
        buckets=buckets,
    )
    # DeepSpeed keeps parameters under the persistence threshold whole; the rest it gathers per
    # parameter-owning module, which ShardSpec counts but does not size: equal shares.
    owners = max(1, model.gathers_per_pass)
    gathered = sum(n for n in model.param_numels if n > buckets.persistence)
    gathers = projection.gather_calls([gathered // owners] * owners, replace(buckets, persistence=0))
    total = sum(model.param_numels)
    return projection.comm_seconds(system, gathers, projection.reduce_calls(total, buckets), shape, plan)


def candidate_sizes(shape: DPShape) -> dict[Level, int]:
    """Secondary levels worth having: a level spanning the whole group would copy the primary
    partition: pure cost, since every module release then copies each weight (docs/gpu.md)."""
    sizes = {Level.PACKAGE: shape.per_package} if shape.per_package < shape.size else {}
    if shape.nodes > 1:
        sizes[Level.NODE] = shape.per_node
    return sizes


def choose_secondary_level(
    config: HierarchicalZeroConfig,
    shape: DPShape,
    model: ShardSpec,
    topology: Topology,
    micro_batches: int = 1,
    buffers: HopBuffers = NO_BUFFERS,
    buckets: Buckets | None = None,
    profile: Profile | None = None,
) -> SecondaryChoice:
    """The level of the secondary copy: with ``secondary_level: auto`` the fastest whose extra
    memory fits the budget, else the configured one.

    Args:
        config: the ``hierarchical_zero`` section (as charged: :func:`as_charged`).
        shape: the data-parallel group as nodes x packages x members.
        model: this rank's parameters.
        topology: the ranks' placement, for the collectives' link classes.
        micro_batches: gradient-accumulation steps per optimizer step.
        buffers: the transient buffers of the hops, counted in the budget.
        buckets: DeepSpeed's buckets the step is timed with; None: DeepSpeed's defaults.
        profile: a probe profile whose fits replace the documented constants; None: those.

    Returns:
        The chosen level with the figures behind it (extra memory and step time per candidate).
    """
    full = model.padded(shape.size) * model.weight_bytes
    held = held_bytes(config, shape, model) + buffers.total
    extra = {level: full // size + held for level, size in candidate_sizes(shape).items()}
    seconds = {
        level: level_seconds(config, shape, model, topology, level, micro_batches, buckets, profile)
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
        level=level,
        extra_bytes=extra,
        step_seconds=seconds,
        budget_bytes=budget,
        buffers=buffers,
        reason=reason,
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
        f"{_size(choice.budget_bytes)}; hop buffers +{_size(choice.buffers.gather)} gather, "
        f"+{_size(choice.buffers.reduce)} reduce, in every figure); modelled: {figures}"
    )
