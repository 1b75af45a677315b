"""What the planner reads besides the model: the global batch to keep, a probe profile applied to
the planned machine (with what it does not cover named), and the DeepSpeed JSON it writes back."""

from __future__ import annotations

import argparse
import copy
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import ValidationError

from deepspeed_ext.zero.config import HierarchicalZeroConfig, check_zero_stage
from deepspeed_ext.zero.cost.profile import ProfileError, read
from deepspeed_ext.zero.cost.projection import Candidate
from deepspeed_ext.zero.cost.verified import Backend
from deepspeed_ext.zero.cost.workload import System
from mdsp_base.section import ConfigError, check_deepspeed_sections, describe
from mdsp_base.topology import LinkClass


class PlanInputError(ValueError):
    """An input the planner cannot use, with what to give instead."""


# (flag, attribute, smallest value, whether the smallest itself is refused): the planner's numbers.
RANGES = (
    ("--nodes", "nodes", 1, False),
    ("--layers", "layers", 1, False),
    ("--hidden", "hidden", 1, False),
    ("--heads", "heads", 1, False),
    ("--seq", "seq", 1, False),
    ("--memory-gb", "memory_gb", 0, True),
    ("--grad-accum", "grad_accum", 1, False),
    ("--global-batch", "global_batch", 1, False),
    ("--top", "top", 0, False),
)


def check_numbers(args: argparse.Namespace) -> None:
    """Every number of the command line within what it can mean (``--headroom`` a fraction in [0, 1))."""
    for flag, name, low, exclusive in RANGES:
        value = getattr(args, name)
        if value is not None and (value < low or (exclusive and value == low)):
            words = "a positive number" if exclusive or low == 1 else "0 or more"
            raise PlanInputError(f"{flag} {value}: give {words}")
    if not 0 <= args.headroom < 1:
        raise PlanInputError(f"--headroom {args.headroom}: give a fraction in [0, 1)")
    if args.hidden and args.heads and args.hidden % args.heads:
        raise PlanInputError(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")


def check_config(
    ds: dict, source: Path | str, check_sections: Callable[[dict], object] | None = None
) -> None:
    """``ds`` as the job validates it before its model: DeepSpeed's own sections, then the plugin
    sections.

    Args:
        ds: the DeepSpeed config.
        source: where it was read from, named in the errors.
        check_sections: the suite's check of every plugin section (its configuration assembler,
            which sits above this plugin and is therefore passed in); None: this plugin's own
            section and the ZeRO stage it needs.

    Raises:
        ConfigError: the first section the job would refuse.
    """
    check_deepspeed_sections(ds, str(source))
    if check_sections is not None:
        check_sections(ds)
        return
    try:
        section = HierarchicalZeroConfig.model_validate(ds.get("hierarchical_zero") or {})
    except ValidationError as e:
        raise ConfigError(describe(e, HierarchicalZeroConfig, "hierarchical_zero")) from None
    if section.enabled:
        check_zero_stage((ds.get("zero_optimization") or {}).get("stage", 0))


def _megatron_flag(preset: Path | None, flag: str) -> int | None:
    if preset is None:
        return None
    words = shlex.split(preset.read_text(), comments=True)
    return int(words[words.index(flag) + 1]) if flag in words else None


def global_batch(ds: dict, preset: Path | None, world: int, grad_accum: int, explicit: int | None) -> int:
    """Sequences per optimizer step to keep: ``explicit``; else the JSON's ``train_batch_size``; else
    the preset's ``--global-batch-size``; else micro-batch (the JSON's, else the preset's) x
    ``grad_accum`` x DP at the preset's TP (1 without a preset), as Megatron counts it."""
    if explicit is not None:
        if explicit < 1:
            raise PlanInputError(f"--global-batch {explicit}: give a positive number of sequences")
        return explicit
    if "train_batch_size" in ds:
        return int(ds["train_batch_size"])
    from_preset = _megatron_flag(preset, "--global-batch-size")
    if from_preset is not None:
        return from_preset
    micro = ds.get("train_micro_batch_size_per_gpu") or _megatron_flag(preset, "--micro-batch-size") or 1
    tp = _megatron_flag(preset, "--tensor-model-parallel-size") or 1
    if world % tp:
        raise PlanInputError(f"the preset's TP {tp} does not divide {world} devices: give --global-batch")
    return int(micro) * grad_accum * world // tp


@dataclass(frozen=True)
class MeasuredCosts:
    """A probe profile applied to the planned machine."""

    system: System
    """The planned machine (its topology, compute and memory) with the profile's fitted costs for
    the link classes it measured, the documented ones for the rest."""
    verifies: bool
    """Measured on the planned backend: the paths it timed (the point-to-point algorithm) have run there."""
    job_reads_it: bool
    """Measured on the planned topology: the job's ``hierarchical_zero.profile`` can name it."""
    notes: list[str]
    """What the plan takes from elsewhere, extrapolates or leaves out, one line each."""


def measured_costs(path: Path, system: System, backend: Backend, nodes: int) -> MeasuredCosts:
    """The profile at ``path`` applied to ``system`` on ``nodes`` nodes, with its backend and
    topology compared to the plan's."""
    try:
        profile = read(path)
        measured_on = Backend.of_profile(profile.versions.get("collectives", ""))
    except (ProfileError, ValueError) as exc:
        raise PlanInputError(str(exc)) from exc
    topo = profile.topology
    planned = {
        "world_size": nodes * system.ranks_per_node,
        "ranks_per_node": system.ranks_per_node,
        "ranks_per_package": system.ranks_per_package,
    }
    measured_links = {t.link for t in profile.hop_timings()}
    notes = []
    if measured_on != backend:
        notes.append(
            f"{path} was measured on {measured_on}, the plan runs on {backend}: its costs are used, its runs verify nothing on {backend}"
        )
    job_reads_it = all(topo.get(k) == v for k, v in planned.items())
    if not job_reads_it:
        notes.append(
            f"{path} was measured on {topo.get('world_size')} ranks, {topo.get('ranks_per_node')} per node and "
            f"{topo.get('ranks_per_package')} per package, the plan is for {planned['world_size']}, "
            f"{system.ranks_per_node} and {system.ranks_per_package}: its fits are extrapolated to the plan's "
            "groups, and the JSON leaves hierarchical_zero.profile out (the job would refuse another topology's)"
        )
    documented = [link.value for link in LinkClass if link not in measured_links]
    if documented:
        notes.append(
            f"{path} holds no timings for {', '.join(documented)}: {system.costs.system}'s documented costs there"
        )
    return MeasuredCosts(
        replace(system, costs=profile.costs(system.costs)), measured_on == backend, job_reads_it, notes
    )


def written_config(ds: dict, plan: Candidate, profile: Path | None, batch: int) -> dict:
    """``ds`` with the plan's micro-batch, accumulation, buckets and ``hierarchical_zero`` settings;
    every other key kept."""
    out = copy.deepcopy(ds)
    out["train_micro_batch_size_per_gpu"] = plan.micro_batch
    out["gradient_accumulation_steps"] = plan.grad_accum
    if "train_batch_size" in out:
        out["train_batch_size"] = batch
    zero = out.setdefault("zero_optimization", {})
    zero.update(
        stage=3,  # the plan is hierarchical ZeRO-3's
        stage3_prefetch_bucket_size=plan.buckets.prefetch,
        reduce_bucket_size=plan.buckets.reduce,
        stage3_max_live_parameters=plan.buckets.max_live,
    )
    hz = out.setdefault("hierarchical_zero", {})
    hz.update(
        enabled=True,
        secondary_level=plan.secondary.value if plan.secondary else "auto",
        grad_sync="accumulation_boundary" if plan.boundary_sync else "every_micro_batch",
        quantized_weights=plan.quantized_weights,
        quantized_gradients="int4" if plan.quantized_gradients else "none",
        inter_node_algorithm=plan.inter_node.value,
        pipeline_chunks=plan.pipeline_chunks,
    )
    if profile is not None:
        hz["profile"] = str(profile)
    return out
