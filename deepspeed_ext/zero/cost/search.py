"""The planner's search: every configuration of the hierarchical variant worth projecting, each at
the micro-batch and recomputation that fit, against ZeRO-3, hpZ and ZeRO++ at the same setting.

What it may propose is set by :class:`Rules`: exact plans on paths that have run on the job's
backend by default (:mod:`deepspeed_ext.zero.cost.verified`), lossy or unverified ones only when asked;
the user's global batch kept unless freed; a memory headroom and the model build's peak counted.
All figures are computed (:mod:`.projection`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

from deepspeed_ext.zero.config import InterNodeAlgorithm
from deepspeed_ext.zero.cost.projection import Candidate, Projection, Scheme, memory, project, shape
from deepspeed_ext.zero.cost.verified import Backend, Path, has_run
from deepspeed_ext.zero.cost.workload import Buckets, Model, Recompute, System
from mdsp_base.topology import LinkClass

BUCKETS = (50_000_000, 200_000_000)
"""Prefetch and reduce bucket sizes (elements) the search tries."""
MICRO_BATCHES = (8, 4, 2, 1)
"""Micro-batches tried, largest first, where the global batch is free."""
PIPELINE_CHUNKS = 4
"""The pipelined setting the search tries beside 1 chunk."""
BASELINES = (Scheme.ZERO3, Scheme.HPZ, Scheme.HPZ_IDEAL, Scheme.ZEROPP)


@dataclass(frozen=True)
class Rules:
    """What the search may propose, and the memory it may fill."""

    backend: Backend
    """The collective library the job's hops run on."""
    measured: bool = False
    """A probe profile of this cluster is given: the point-to-point algorithm has run on it."""
    allow_lossy: bool = False
    """Propose int8 weights and int4 gradients across nodes (training then differs from stock's)."""
    allow_unverified: bool = False
    """Propose settings that have not run on ``backend`` (:func:`unverified`)."""
    global_batch: int | None = None
    """Sequences per optimizer step, kept: micro-batch x accumulation x DP. None: free."""
    headroom: float = 0.1
    """Fraction of the device's memory left free (allocator fragmentation, the library's buffers)."""
    build_bytes_per_param: int = 2
    """Bytes per parameter of the model as built (2 with bf16, 4 with fp32); 0: the build is not
    counted."""

    def budget_bytes(self, system: System) -> float:
        return system.memory_gb * 1e9 * (1 - self.headroom)


def unverified(plan: Candidate, rules: Rules) -> list[str]:
    """The settings of ``plan`` that have not run on the rules' backend."""
    out = []
    if plan.inter_node == InterNodeAlgorithm.RECURSIVE and not (
        rules.measured or has_run(Path.RECURSIVE, rules.backend)
    ):
        out.append(f"recursive (not run on {rules.backend})")
    if plan.pipeline_chunks > 1 and not has_run(Path.PIPELINED, rules.backend):
        out.append(f"pipeline_chunks {plan.pipeline_chunks}")
    if (plan.quantized_weights or plan.boundary_sync) and not has_run(Path.QUANTIZED, rules.backend):
        out.append("quantized or boundary-sync hops")
    return out


def lossy(plan: Candidate) -> bool:
    return plan.quantized_weights or plan.quantized_gradients


@dataclass(frozen=True)
class Row:
    """One configuration that fits, with its figures (computed)."""

    plan: Candidate
    projection: Projection
    ratios: dict[str, float]
    """Ours' TFLOPS over each baseline's at the same TP, micro-batch and recomputation."""
    peak_bytes: float
    """The larger of the training step's memory and the model build's."""
    unverified: tuple[str, ...]
    """Settings that have not run on the job's backend (empty: all have)."""


def build_bytes(model: Model, plan: Candidate, dp: int, rules: Rules) -> float:
    """The build's peak on one rank: the variant builds partitioned from construction
    (``deepspeed_ext.zero.Init``), so its partition of the model (TP shard over ``dp``) and the two
    modules built last whole, at most two of the largest."""
    return rules.build_bytes_per_param * (model.params / plan.tp / dp + 2 * max(model.modules(plan.tp)))


def micro_batches(system: System, nodes: int, plan: Candidate, rules: Rules) -> tuple[int, ...]:
    """Micro-batches to try: any where the batch is free, else the one that keeps the global batch
    at this TP and accumulation (none when DP x accumulation does not divide it)."""
    if rules.global_batch is None:
        return MICRO_BATCHES
    per_micro = shape(system, nodes, plan.tp).size * plan.grad_accum
    return (rules.global_batch // per_micro,) if rules.global_batch % per_micro == 0 else ()


def fitting(
    system: System, model: Model, nodes: int, plan: Candidate, rules: Rules
) -> tuple[Candidate, Projection, float] | None:
    """``plan`` at the micro-batch and recomputation that fit the budget and project fastest (for
    each recomputation its largest fitting micro-batch), with its peak bytes. None: nothing fits."""
    s = shape(system, nodes, plan.tp)
    best = None
    for rc in Recompute:
        for mb in micro_batches(system, nodes, plan, rules):
            candidate = replace(plan, micro_batch=mb, recompute=rc)
            peak = max(
                memory(system, model, s, candidate)["total"], build_bytes(model, candidate, s.size, rules)
            )
            if peak <= rules.budget_bytes(system):
                mine = project(system, model, nodes, candidate)
                if best is None or mine.tflops_per_gcd > best[1].tflops_per_gcd:
                    best = candidate, mine, peak
                break
    return best


def candidates(system: System, model: Model, nodes: int, grad_accum: int, rules: Rules) -> list[Candidate]:
    """Every distinct configuration of ours the rules admit. Settings that change nothing are left
    out: the point-to-point algorithm on one node, pipelining where every hop runs whole (quantized)."""
    algorithms = [InterNodeAlgorithm.RING] + ([InterNodeAlgorithm.RECURSIVE] if nodes > 1 else [])
    out = []
    for tp in (t for t in (1, 2, 4, 8) if system.ranks_per_node % t == 0 and model.heads % t == 0):
        # No "no copy" plan: hierarchical_zero.secondary_level cannot ask for one (auto may land there).
        levels = [LinkClass.NODE] + ([LinkClass.PACKAGE] if system.ranks_per_package // tp > 1 else [])
        for level, alg, quant, sync, chunks, bucket in itertools.product(
            levels,
            algorithms,
            (False, True) if rules.allow_lossy else (False,),
            (False, True) if grad_accum > 1 else (False,),
            (1, PIPELINE_CHUNKS),
            BUCKETS,
        ):
            if quant and chunks > 1:
                continue
            plan = Candidate(
                Scheme.OURS,
                tp=tp,
                grad_accum=grad_accum,
                secondary=level,
                inter_node=alg,
                quantized_weights=quant,
                quantized_gradients=quant,
                boundary_sync=sync,
                pipeline_chunks=chunks,
                buckets=Buckets(prefetch=bucket, reduce=bucket, max_live=3 * bucket),
            )
            if rules.allow_unverified or not unverified(plan, rules):
                out.append(plan)
    return out


def evaluate(
    system: System,
    model: Model,
    nodes: int,
    ds: dict,
    grad_accum: int,
    rules: Rules,
    progress: Callable[[int, int], None] | None = None,
) -> list[Row]:
    """Every admitted candidate that fits, each with its baselines' ratios at the same TP,
    micro-batch and recomputation (the baselines with the JSON's buckets).

    Args:
        system: the machine.
        model: the GPT.
        nodes: nodes of the job.
        ds: the DeepSpeed config (its buckets).
        grad_accum: gradient-accumulation steps.
        rules: what the recommendation may propose (backend, lossy, unverified, batch, headroom).
        progress: called with (done, total) as candidates are evaluated.

    Returns:
        The rows, fastest first.
    """
    rows, cache = [], {}
    plans = candidates(system, model, nodes, grad_accum, rules)
    for i, candidate in enumerate(plans):
        if progress is not None:
            progress(i, len(plans))
        found = fitting(system, model, nodes, candidate, rules)
        if found is None:
            continue
        plan, mine, peak = found
        key = (plan.tp, plan.micro_batch, plan.recompute)
        if key not in cache:
            cache[key] = {
                scheme.value: project(system, model, nodes, baseline(plan, scheme, ds))
                for scheme in BASELINES
            }
        ratios = {k: mine.tflops_per_gcd / v.tflops_per_gcd for k, v in cache[key].items()}
        rows.append(Row(plan, mine, ratios, peak, tuple(unverified(plan, rules))))
    return sorted(rows, key=lambda r: -r.projection.tflops_per_gcd)


def baseline(plan: Candidate, scheme: Scheme, ds: dict) -> Candidate:
    """A baseline as its user runs it: the candidate's TP, micro-batch and recomputation, with the
    DeepSpeed JSON's own buckets (a stock scheme does not get our tuned ones)."""
    return replace(plan, scheme=scheme, buckets=Buckets.from_json(ds))


def own_best(
    system: System, model: Model, nodes: int, scheme: Scheme, plan: Candidate, rules: Rules
) -> float | None:
    """A baseline's fastest TFLOPS per GCD over TP (its micro-batch and recomputation fitted), None
    where none fits."""
    fits = [
        fitting(system, model, nodes, replace(plan, scheme=scheme, tp=tp), rules)
        for tp in (1, 2, 4, 8)
        if system.ranks_per_node % tp == 0 and model.heads % tp == 0
    ]
    return max((f[1].tflops_per_gcd for f in fits if f), default=None)
