"""Choice of the secondary weight level (``secondary_level: auto``) from the cost model."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from deepspeed_ext.zero import collective_cost, p2p_hops, projection
from deepspeed_ext.zero.config import HierarchicalZeroConfig, InterNodeAlgorithm
from deepspeed_ext.zero.cost_model import (
    Links,
    ModelSpec,
    Variant,
    hierarchical,
)
from deepspeed_ext.zero.levels import DPShape
from deepspeed_ext.zero.profile import Profile
from deepspeed_ext.zero.workload import Buckets, System
from plugin_base.topology import Level, LinkClass

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
    node_block = model.padded(shape.size) // shape.per_node * 4
    return node_block * ((config.grad_sync == "accumulation_boundary") + (config.grad_bits is not None))


@dataclass(frozen=True)
class HopBuffers:
    """Peak bytes per rank that one hop collective allocates beyond the flat one it replaces
    (computed from the buffers hops.py and quantize.py allocate; tests/test_hop_memory.py measures)."""

    gather: int
    """One parameter all-gather: the innermost hop's input and output (the flat call writes straight
    into DeepSpeed's buffer), with pipelined hops also the cross-node hop's output (computed, an
    upper bound), or the int8 cross-node hop's integers and fp32 values if larger."""
    reduce: int
    """One gradient reduce-scatter: nothing for ring hops (they run in place in DeepSpeed's packed
    bucket); the recursive cross-node hop's receive buffer; the quantized cross-node hop's fp32
    copy, working copy and integers; boundary sync's zeros handed to DeepSpeed."""

    @property
    def total(self) -> int:
        """Both at once: the all-gather and reduce-scatter streams may overlap."""
        return self.gather + self.reduce


def hop_buffers(
    config: HierarchicalZeroConfig, shape: DPShape, model: ModelSpec, gather_elems: int, reduce_elems: int
) -> HopBuffers:
    """:class:`HopBuffers` for all-gathers of ``gather_elems`` and reduce-scatters of ``reduce_elems``
    elements (the largest calls DeepSpeed makes: a prefetch bucket, a reduce bucket)."""
    sizes = [s for s in (shape.per_package, shape.packages_per_node, shape.nodes) if s > 1]
    if len(sizes) < 2:  # one hop is the flat collective itself (HopPlan.is_trivial)
        return HopBuffers(0, 0)
    p, wb, gb = shape.size, model.weight_bytes, model.grad_bytes
    gather = gather_elems * wb + gather_elems // sizes[0] * wb
    if config.pipeline_chunks > 1 and shape.nodes > 1:
        # pieces waiting for the next lane hold their cross-node hop's output besides the serial peak
        gather += gather_elems // shape.per_node * wb
    if config.quantized_weights and shape.nodes > 1:
        # int8 hop across nodes on h = G/p elements: input, output, payload, gathered payloads, fp32 values
        h = math.ceil(gather_elems / p)
        gather = max(gather, h * (wb + shape.nodes * (wb + 1 + 4) + 1))
    reduce = 0
    if config.grad_reduce == "hierarchical" and shape.nodes > 1:
        node_elems = math.ceil(reduce_elems / p) * shape.nodes  # the block that crosses nodes
        if config.inter_node_algorithm != InterNodeAlgorithm.RING:
            # distance halving receives the largest step's blocks into one buffer
            most = max(blocks for _, blocks in p2p_hops.schedule(shape.nodes))
            reduce = most * math.ceil(reduce_elems / p) * gb
        if config.grad_sync == "accumulation_boundary":  # zeros handed to DeepSpeed between boundaries
            reduce = max(reduce, math.ceil(reduce_elems / p) * gb)
        if config.grad_bits:
            padded = -(-node_elems // config.quantization_block) * config.quantization_block
            # fp32 copy of the block (the next residual), then 6 bytes per padded element at once
            # (payload, received payload and the fp32 values dequantized from it), the scales sent
            # and received, and the fp32 sum
            scales = 2 * 4 * padded // config.quantization_block
            reduce = max(reduce, node_elems * 4 + padded * 6 + scales + node_elems // shape.nodes * 4)
    return HopBuffers(gather=gather, reduce=reduce)


def level_seconds(
    config: HierarchicalZeroConfig,
    shape: DPShape,
    model: ModelSpec,
    links: Links,
    level: Level,
    micro_batches: int = 1,
    buckets: Buckets | None = None,
    profile: Profile | None = None,
) -> float:
    """Communication of one step with the secondary copy at ``level`` (global: none), computed
    by the projection the planner CLI uses: DeepSpeed's gathers (one per parameter-owning module
    and pass, split at the prefetch bucket) and reduce buckets, each charged through
    collective_cost with the costs the probe's ``profile`` fits, else the documented costs of this
    topology (Frontier's where packages hold several ranks, H100's otherwise). Hops across nodes
    are charged the algorithm the runtime runs: auto is ring without a profile."""
    buckets = buckets or Buckets()
    costs = collective_cost.for_topology(links.ranks_per_nic, config.link_bandwidth_gbps)
    system = System(
        costs if profile is None else profile.costs(costs),
        ranks_per_node=max(links.ranks_per_node, shape.per_node),
        ranks_per_package=links.ranks_per_nic,
    )
    inter_node = config.inter_node_algorithm
    if inter_node == InterNodeAlgorithm.AUTO and profile is None:
        inter_node = InterNodeAlgorithm.RING
    plan = projection.Plan(
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
    # parameter-owning module, which ModelSpec counts but does not size: equal shares.
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
    model: ModelSpec,
    links: Links,
    micro_batches: int = 1,
    buffers: HopBuffers = HopBuffers(0, 0),
    buckets: Buckets | None = None,
    profile: Profile | None = None,
) -> SecondaryChoice:
    """Fastest level whose extra memory fits the budget (auto), or the configured level; timed
    with DeepSpeed's ``buckets`` (its defaults when None)."""
    full = model.padded(shape.size) * model.weight_bytes
    held = held_bytes(config, shape, model) + buffers.total
    extra = {level: full // size + held for level, size in candidate_sizes(shape).items()}
    seconds = {
        level: level_seconds(config, shape, model, links, level, micro_batches, buckets, profile)
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
