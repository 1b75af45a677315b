"""Step time, TFLOPS per GCD and memory per rank of ZeRO-3, hpZ, ZeRO++ and the hierarchical variant.

One model for the planner, ``secondary_level: auto`` and the Frontier benchmark. Every collective
is charged through :func:`.collectives.seconds`; launches and message sizes come from the
DeepSpeed JSON's buckets; communication overlaps compute only as ``overlap`` says. All figures are
computed. What it assumes: docs/hierarchical_zero_modules.md."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from enum import StrEnum

from deepspeed_ext.zero.config import (
    GradientQuantization,
    GradSync,
    HierarchicalZeroConfig,
    InterNodeAlgorithm,
)
from deepspeed_ext.zero.cost.collectives import (
    Algorithm,
    CollectiveCosts,
    Operation,
    bus_bytes,
    fastest,
    seconds,
)
from deepspeed_ext.zero.cost.memory import held_bytes, hop_buffers
from deepspeed_ext.zero.cost.shape import DPShape
from deepspeed_ext.zero.cost.step import overlapped
from deepspeed_ext.zero.cost.volume import QGZ_BYTES_FACTOR, QWZ_BYTES_FACTOR, ShardSpec
from deepspeed_ext.zero.cost.workload import Buckets, Model, Recompute, System
from mdsp_base.topology import LinkClass

PACKAGE, NODE, INTER = LinkClass.PACKAGE, LinkClass.NODE, LinkClass.INTER_NODE
QWZ, QGZ = QWZ_BYTES_FACTOR, QGZ_BYTES_FACTOR  # ZeRO++: int8 weights, int4 gradients, per 16-bit byte
OURS_INT8, OURS_INT4 = (1 + 4 / 256) / 2, (0.5 + 4 / 256) / 2  # ours: one fp32 scale per 256 elements


class Scheme(StrEnum):
    """Where a step's collectives run."""

    ZERO3 = "zero3"
    """DeepSpeed's ZeRO-3: flat all-gathers and reduce-scatters over the DP group."""
    HPZ = "hpz"
    """DeepSpeed's hpZ: its groups are consecutive global ranks (the TP group when TP > 1)."""
    HPZ_IDEAL = "hpz_ideal"
    """hpZ with groups cut from the data-parallel group inside the node (what DeepSpeed cannot build at TP > 1)."""
    ZEROPP = "zeropp"
    """DeepSpeed's hpZ + qwZ + qgZ (qgZ: an all-to-all inside the node, then one across nodes)."""
    OURS = "ours"
    """The hierarchical variant: hop collectives, a secondary copy at a level."""


@dataclass(frozen=True)
class Candidate:
    """One configuration to project."""

    scheme: Scheme
    """Which collectives run where."""
    tp: int = 1
    """Tensor-parallel size."""
    micro_batch: int = 1
    """Sequences per micro-batch per DP rank."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    recompute: Recompute = Recompute.NONE
    """Activation recomputation."""
    secondary: LinkClass | None = NODE
    """Ours: the secondary copy's level (package or node; None: none)."""
    inter_node: InterNodeAlgorithm = InterNodeAlgorithm.AUTO
    """Ours: inter_node_algorithm."""
    quantized_weights: bool = False
    """Ours: int8 weights across nodes (quantized_weights)."""
    quantized_gradients: bool = False
    """Ours: int4 gradients across nodes, error feedback (quantized_gradients: int4)."""
    boundary_sync: bool = False
    """Ours: gradients cross nodes once per optimizer step."""
    pipeline_chunks: int = 1
    """Ours: chunks so the inter-node, node and package hops overlap."""
    buckets: Buckets = Buckets()
    """DeepSpeed's buckets."""

    def hierarchical_config(self) -> HierarchicalZeroConfig:
        """The ``hierarchical_zero`` section that runs this plan (ours)."""
        return HierarchicalZeroConfig(
            enabled=True,
            quantized_weights=self.quantized_weights,
            quantized_gradients=GradientQuantization.INT4
            if self.quantized_gradients
            else GradientQuantization.NONE,
            grad_sync=GradSync.ACCUMULATION_BOUNDARY if self.boundary_sync else GradSync.EVERY_MICRO_BATCH,
            inter_node_algorithm=self.inter_node,
            pipeline_chunks=self.pipeline_chunks,
        )


def shape(system: System, nodes: int, tp: int) -> DPShape:
    """A DP group under Megatron's rank order (TP innermost): its members per node and package."""
    if system.ranks_per_node % tp:
        raise ValueError(f"TP={tp} must divide the {system.ranks_per_node} GPUs of a node: choose a divisor")
    per_package = max(1, system.ranks_per_package // tp)
    return DPShape(nodes, system.ranks_per_node // tp // per_package, per_package)


def flat(costs: CollectiveCosts, op: Operation, s: DPShape, system: System, nbytes: float) -> float:
    """One library collective over the whole DP group: its ring crosses the node's NICs (one
    communicator per TP rank at once) and every link inside the node (its slowest edge, charged at
    that link's fitted bus bandwidth, as an in-node collective is)."""
    edge = NODE if s.per_node > s.per_package else PACKAGE
    if s.nodes == 1:
        return seconds(costs, op, Algorithm.RING, s.size, nbytes, edge)
    concurrent = max(1, system.ranks_per_node // s.per_node)
    across = seconds(costs, op, Algorithm.RING, s.size, nbytes, INTER, concurrent)
    if s.per_node == 1:
        return across
    inside = bus_bytes(op, s.size, nbytes) / (costs.fit(op, Algorithm.RING, edge).bus_gbps * 1e9)
    return max(across, inside)


def hop_levels(s: DPShape, nbytes: float, across: float = 1.0) -> list[tuple[int, LinkClass, float]]:
    """Members, link class and bytes of each level of a hop collective of ``nbytes`` (gathered
    output / reduce-scatter input) over the DP group ``s``, outermost first; levels of one member
    are left out."""
    levels = (
        (s.nodes, INTER, nbytes / s.per_node * across),
        (s.packages_per_node, NODE, nbytes / s.per_package),
        (s.per_package, PACKAGE, nbytes),
    )
    return [level for level in levels if level[0] > 1]


def hops(
    costs: CollectiveCosts,
    op: Operation,
    s: DPShape,
    system: System,
    nbytes: float,
    plan: Candidate,
    across: float = 1.0,
) -> float:
    """Our hop collective of ``nbytes`` (gathered output / reduce-scatter input) over the DP group:
    rank-aligned groups across nodes (one per GPU of a node, so every NIC works at once), then
    across packages, then inside the package; each level sees ``nbytes`` over the members of the
    levels inside it. ``across`` scales the inter-node bytes (quantization: a quantized gradient
    hop is an all-to-all, integers are not summed in flight). Pipelined over ``pipeline_chunks``:
    the slowest level plus one chunk of every other (fill and drain)."""
    c = plan.pipeline_chunks
    levels = []
    for members, link, size in hop_levels(s, nbytes, across):
        if link != INTER:
            levels.append(c * seconds(costs, op, Algorithm.RING, members, size / c, link))
            continue
        hop_op = Operation.ALL_TO_ALL if op == Operation.REDUCE_SCATTER and across < 1 else op
        n = system.ranks_per_node
        alg = (
            fastest(costs, hop_op, members, size / c, link, n)
            if plan.inter_node == InterNodeAlgorithm.AUTO
            else Algorithm(plan.inter_node)
        )
        levels.append(c * seconds(costs, hop_op, alg, members, size / c, link, n))
    if not levels:
        return 0.0
    slowest = max(levels)
    return slowest + (sum(levels) - slowest) / c


@dataclass(frozen=True)
class Projection:
    """Computed figures of one plan."""

    compute_s: float
    """GEMM time of one optimizer step."""
    comm_s: float
    """Communication of one step, none of it hidden."""
    step_s: float
    """Step time with the system's ``overlap`` of the communication hidden."""
    tflops_per_gcd: float
    """Model FLOPs (no recomputation counted) per GCD per second, in TFLOPS."""
    memory: dict[str, float]
    """Bytes per rank: states, secondary, held, live, buckets, hop_buffers, activations, total."""

    def fits(self, system: System) -> bool:
        return self.memory["total"] <= system.memory_gb * 1e9


def gather_calls(modules: list[int], buckets: Buckets) -> list[int]:
    """Elements of each all-gather of one pass: a module per call, split at the prefetch bucket (0:
    no prefetching, a module per call); parameters under the persistence threshold stay whole and
    are never gathered."""
    calls = []
    for m in modules:
        if m > buckets.persistence:
            pieces = math.ceil(m / buckets.prefetch) if buckets.prefetch > 0 else 1
            calls += [m // pieces] * pieces
    return calls


def reduce_calls(total: int, buckets: Buckets) -> list[int]:
    """Elements of each reduce-scatter of one micro-batch: ``total`` gradients in reduce buckets."""
    count = math.ceil(total / buckets.reduce) if buckets.reduce > 0 else 1
    return [total // count] * count


def _secondary_gather(
    costs: CollectiveCosts, s: DPShape, system: System, plan: Candidate, nbytes: float
) -> float:
    """A forward (after the first micro-batch) or backward gather from the secondary copy."""
    if plan.scheme in (Scheme.HPZ, Scheme.ZEROPP) and plan.tp > 1:
        # DeepSpeed's hpZ group: the node's consecutive ranks, TP peers included (wrong shards).
        return seconds(costs, Operation.ALL_GATHER, Algorithm.RING, system.ranks_per_node, nbytes, NODE)
    if plan.scheme in (Scheme.HPZ, Scheme.HPZ_IDEAL, Scheme.ZEROPP):
        return flat(costs, Operation.ALL_GATHER, replace(s, nodes=1), system, nbytes)
    if plan.secondary is None:
        return hops(costs, Operation.ALL_GATHER, s, system, nbytes, plan)
    inner = DPShape(1, 1, s.per_package) if plan.secondary == PACKAGE else replace(s, nodes=1)
    return hops(costs, Operation.ALL_GATHER, inner, system, nbytes, plan)


def comm_seconds(
    system: System, gathers: list[int], reduces: list[int], s: DPShape, plan: Candidate
) -> float:
    """Communication of one optimizer step (``grad_accum`` micro-batches), nothing hidden, for
    all-gathers of ``gathers`` elements per pass and reduce-scatters of ``reduces`` per micro-batch."""
    costs, ga = system.costs, plan.grad_accum
    ag, rs = Operation.ALL_GATHER, Operation.REDUCE_SCATTER
    # What the runtime runs whole, whatever pipeline_chunks says: a quantized gather, and a gradient
    # reduce-scatter that is quantized or held for boundary sync (inject.py, grad_sync.py).
    whole = replace(plan, pipeline_chunks=1)
    gather_plan = whole if plan.quantized_weights else plan
    reduce_plan = whole if plan.quantized_gradients or plan.boundary_sync else plan
    total = 0.0
    # A model's layers repeat: each distinct call size is priced once and counted (the planner
    # projects hundreds of candidates, each with hundreds of calls).
    for elems, count in Counter(gathers).items():
        b = 2.0 * elems
        if plan.scheme == Scheme.ZERO3:
            total += count * 2 * ga * flat(costs, ag, s, system, b)
            continue
        if plan.scheme == Scheme.OURS:
            first = hops(costs, ag, s, system, b, gather_plan, OURS_INT8 if plan.quantized_weights else 1.0)
        else:
            first = flat(costs, ag, s, system, b * (QWZ if plan.scheme == Scheme.ZEROPP else 1.0))
        total += count * (first + (2 * ga - 1) * _secondary_gather(costs, s, system, plan, b))
    inner = replace(s, nodes=1)
    for elems, count in Counter(reduces).items():
        b = 2.0 * elems
        if plan.scheme == Scheme.ZEROPP:  # qgZ: int4 all-to-all in the node, then across nodes
            local = seconds(costs, Operation.ALL_TO_ALL, Algorithm.RING, s.per_node, b * QGZ, NODE)
            remote = seconds(
                costs,
                Operation.ALL_TO_ALL,
                Algorithm.RING,
                s.nodes,
                b * QGZ / s.per_node,
                INTER,
                system.ranks_per_node,
            )
            total += count * ga * (local + remote)
        elif plan.scheme == Scheme.OURS:
            full = hops(costs, rs, s, system, b, reduce_plan, OURS_INT4 if plan.quantized_gradients else 1.0)
            total += count * (
                full
                + (ga - 1) * (hops(costs, rs, inner, system, b, reduce_plan) if plan.boundary_sync else full)
            )
        else:
            total += count * ga * flat(costs, rs, s, system, b)
    return total


def memory(system: System, model: Model, s: DPShape, plan: Candidate) -> dict[str, float]:
    """Bytes per rank: bf16 weights and gradients and fp32 master and Adam states partitioned over
    DP (16 bytes per element, ZeRO-3), the secondary bf16 copy, ours' fp32 gradient block held for
    boundary sync or the int4 residual and its hop buffers (both as the planner counts them,
    :mod:`.memory`), gathered parameters live at once, DeepSpeed's reduce bucket (double-buffered
    with overlap_comm) and activations."""
    p = model.params / plan.tp
    group = {Scheme.ZERO3: 0, Scheme.HPZ_IDEAL: s.per_node, Scheme.OURS: 0}.get(
        plan.scheme, system.ranks_per_node
    )
    if plan.scheme == Scheme.OURS and plan.secondary is not None:
        group = s.per_package if plan.secondary == PACKAGE else s.per_node
    largest = max(model.modules(plan.tp))
    gather = min(plan.buckets.prefetch, largest)
    held = buffers = 0.0
    if plan.scheme == Scheme.OURS:
        config, spec = plan.hierarchical_config(), ShardSpec((int(p),))
        held = held_bytes(config, s, spec)
        buffers = hop_buffers(config, s, spec, gather, int(min(plan.buckets.reduce, p))).total
    out = {
        "states": 16 * p / s.size,
        "secondary": 2 * p / group if group else 0.0,
        "held": held,
        "live": 2 * min(plan.buckets.max_live, plan.buckets.prefetch + largest),
        "buckets": 2 * 2 * min(plan.buckets.reduce, p),
        "hop_buffers": buffers,
        "activations": model.activation_bytes(plan.micro_batch, plan.tp, plan.recompute),
    }
    out["total"] = sum(out.values())
    return out


def project(system: System, model: Model, nodes: int, plan: Candidate) -> Projection:
    """Step time, TFLOPS per GCD and memory per rank of ``plan`` (computed, not measured).

    Args:
        system: the machine.
        model: the GPT.
        nodes: nodes of the job.
        plan: the candidate configuration (scheme, TP, micro-batch, buckets, recomputation).

    Returns:
        The projection.
    """
    s = shape(system, nodes, plan.tp)
    per_gcd = plan.grad_accum * model.flops(plan.micro_batch, plan.recompute) / plan.tp
    compute = per_gcd / (system.peak_tflops * 1e12 * system.gemm_efficiency)
    calls = (
        gather_calls(model.modules(plan.tp), plan.buckets),
        reduce_calls(model.params // plan.tp, plan.buckets),
    )
    comm = comm_seconds(system, *calls, s, plan)
    step = overlapped(compute, comm, system.overlap)
    useful = plan.grad_accum * model.flops(plan.micro_batch, Recompute.NONE) / plan.tp
    return Projection(compute, comm, step, useful / step / 1e12, memory(system, model, s, plan))
