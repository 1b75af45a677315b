"""Entry point of the hierarchical ZeRO-3 variant: checks, plan, groups, then ``deepspeed.initialize``."""

from __future__ import annotations

import logging
import os
from typing import Any, Union

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import groups as ds_groups

from deepspeed_ext.zero.config import HierarchicalZeroConfig, InterNodeAlgorithm
from deepspeed_ext.zero.cost.memory import hop_buffers
from deepspeed_ext.zero.cost.profile import Profile, ProfileError
from deepspeed_ext.zero.cost.profile import load as load_profile
from deepspeed_ext.zero.cost.secondary_level import as_charged, choose_secondary_level, describe
from deepspeed_ext.zero.cost.shape import dp_shape
from deepspeed_ext.zero.cost.volume import ShardSpec
from deepspeed_ext.zero.cost.workload import Buckets
from deepspeed_ext.zero.engine import inject, known_plans
from deepspeed_ext.zero.engine.contract import (
    check_before_collectives,
    check_deepspeed_version,
    largest_collectives,
    shard_spec,
)
from deepspeed_ext.zero.engine.hierarchical_plan import HierarchicalPlan, JsonSections, Sections
from deepspeed_ext.zero.engine.levels import build_levels
from mdsp_base import comm
from mdsp_base.installer import Installer
from mdsp_base.section import ConfigError, read_ds_config
from mdsp_base.topology import Topology, check_data_parallel, detect_topology

logger = logging.getLogger(__name__)


def partition_group(mpu: Any) -> dist.ProcessGroup | None:
    """The group stock ZeRO-3 partitions over, which the levels are cut from.

    With Ulysses (``--ds-sequence-parallel-size`` > 1) DeepSpeed's engine shards and reduces
    gradients over sequence x data parallel ranks, since each sequence rank holds other tokens'
    gradients: the mpu's sequence-data-parallel group where it has one.

    Args:
        mpu: the model-parallel unit; None: the world.

    Returns:
        Its sequence-data-parallel group, else its data-parallel group; None for the world.
    """
    if mpu is None:
        return None
    if hasattr(mpu, "get_sequence_data_parallel_group"):
        return mpu.get_sequence_data_parallel_group()
    return mpu.get_data_parallel_group()


def measured_profile(config: HierarchicalZeroConfig, topology: Topology) -> Profile | None:
    """The probe profile ``auto`` and the planner read. Rank 0 reads it and every rank gets its
    answer (a collective), so all ranks pick alike. A profile that does not fit this job is an
    error line on every rank, not used.

    Args:
        config: the ``hierarchical_zero`` section (its ``profile``).
        topology: this job's placement.

    Returns:
        The profile, or None: every hop then runs the library's collective.
    """
    answer: list = [None, None]  # the profile, or the reason it is not used
    if dist.get_rank() == 0:
        if config.profile is None:
            if config.inter_node_algorithm == InterNodeAlgorithm.AUTO:
                logger.warning(
                    "hierarchical ZeRO: no profile measured on this cluster (hierarchical_zero.profile): "
                    "every hop runs the library's collective; python -m deepspeed_ext.zero.probe measures one"
                )
        else:
            try:
                answer[0] = load_profile(config.profile, topology)
                logger.info(f"hierarchical ZeRO: auto and the planner read the profile {config.profile}")
            except ProfileError as exc:
                answer[1] = str(exc)
    if config.profile is not None:
        dist.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        logger.error(f"hierarchical ZeRO: {answer[1]}. This job runs every hop on the library's collectives.")
    return answer[0]


def prepare(
    model: torch.nn.Module | ShardSpec,
    config: Union[str, os.PathLike, dict],
    plugin_config: Sections | None = None,
    mpu: Any = None,
    topology: Topology | None = None,
) -> HierarchicalPlan:
    """Check everything, choose the secondary level, then create the level groups (the first
    collective). Pass the result to :func:`initialize` and to :class:`~.construction.Init`.

    Args:
        model: the model, or before it exists (to build it under ``Init``) a :class:`ShardSpec` of
            its parameters.
        config: the DeepSpeed config (dict or JSON path).
        plugin_config: the variant's and the topology's sections; None: read from ``config``.
        mpu: the model-parallel unit whose (sequence-)data-parallel group is partitioned over;
            None: the world.
        topology: the ranks' placement; None: detected from the topology section.

    Returns:
        The plan: the level groups (already created) and the planner's figures.

    Raises:
        ConfigError: a configuration the variant cannot run, before any collective.
    """
    ds = read_ds_config(config)
    plugin_config = plugin_config or JsonSections.of(ds)
    hz = plugin_config.hierarchical_zero
    check_before_collectives(ds, hz)
    world = dist.get_world_size()
    dp_group = partition_group(mpu)
    dp_ranks = dist.get_process_group_ranks(dp_group) if dp_group is not None else list(range(world))
    check_data_parallel(world, len(dp_ranks))  # the mpu's group, which no flag checked
    topology = topology or detect_topology(plugin_config.topology, world_size=world)
    shape = dp_shape(topology, dp_ranks)
    spec = model if isinstance(model, ShardSpec) else shard_spec(model, ds)
    micro = int(ds.get("gradient_accumulation_steps") or 1)
    charged = as_charged(hz, micro)
    gather, reduce = largest_collectives(ds, spec)
    buffers = hop_buffers(charged, shape, spec, gather, reduce)
    measured = measured_profile(hz, topology)
    choice = choose_secondary_level(
        charged,
        shape,
        spec,
        topology,
        micro_batches=micro,
        buffers=buffers,
        buckets=Buckets.from_json(ds),
        profile=measured,
    )
    if dist.get_rank() == 0:  # a warning: seen also where nothing configures logging
        logger.warning(describe(choice, shape))
    levels = build_levels(topology, dp_group, choice.level, hz, measured)
    plan = HierarchicalPlan(levels=levels, choice=choice, model=spec)
    known_plans.remember(plan)
    return plan


def _config_source(
    config: Union[str, os.PathLike, dict, None], kwargs: dict
) -> Union[str, os.PathLike, dict]:
    """The DeepSpeed config wherever ``deepspeed.initialize`` would find it (config, config_params,
    args.deepspeed_config)."""
    source = config if config is not None else kwargs.get("config_params")
    source = source if source is not None else getattr(kwargs.get("args"), "deepspeed_config", None)
    if source is None:
        raise ConfigError("no DeepSpeed config: pass config=<dict or JSON path> (or args.deepspeed_config)")
    return source


def initialize(
    model: torch.nn.Module,
    config: Union[str, os.PathLike, dict, None] = None,
    plugin_config: Sections | None = None,
    mpu: Any = None,
    topology: Topology | None = None,
    plan: HierarchicalPlan | None = None,
    installer: Installer | None = None,
    **kwargs: Any,
) -> tuple:
    """``deepspeed.initialize`` with the hierarchical variant when ``hierarchical_zero.enabled``,
    else ``deepspeed.initialize`` with the same arguments; either way the engine's ``destroy()`` is
    recorded on ``installer`` when one is given.

    Args:
        model: the model, built whole or partitioned under :class:`~.construction.Init`.
        config: the DeepSpeed config (dict or JSON path); None: ``config_params`` or
            ``args.deepspeed_config`` from ``kwargs``, where DeepSpeed finds it.
        plugin_config: the variant's and the topology's sections; None: read from the config.
        mpu: the model-parallel unit, as ``deepspeed.initialize`` takes it.
        topology: the ranks' placement; None: detected from the topology section.
        plan: the plan the model was built partitioned on (:func:`prepare`); None: the plan of an
            earlier engine or ``Init`` on this model, else a new one.
        installer: where the engine's process-wide changes are recorded, undone by its
            ``destroy()`` when the installer closes; None: the caller destroys the engine.
        kwargs: passed to ``deepspeed.initialize`` unchanged.

    Returns:
        What ``deepspeed.initialize`` returns; with the variant on, the engine carries the plan as
        ``engine.hierarchical_zero``.
    """
    if plugin_config is None:
        plugin_config = JsonSections.of(read_ds_config(_config_source(config, kwargs)))
    if plugin_config.hierarchical_zero.enabled:
        result = _hierarchical_initialize(model, config, plugin_config, mpu, topology, plan, kwargs)
    else:
        result = deepspeed.initialize(model=model, config=config, mpu=mpu, **kwargs)
    if installer is not None:
        installer.add("deepspeed_ext.zero", inject.ENGINE_CHANGES, result[0].destroy)
    return result


def _hierarchical_initialize(
    model: torch.nn.Module,
    config: Union[str, os.PathLike, dict, None],
    sections: Sections,
    mpu: Any,
    topology: Topology | None,
    plan: HierarchicalPlan | None,
    kwargs: dict,
) -> tuple:
    """:func:`initialize` with the variant on: the plan (given, found by the model's partition, or
    made), then ``deepspeed.initialize`` with DeepSpeed's collectives dispatched to its levels."""
    check_deepspeed_version()
    source = _config_source(config, kwargs)
    # what deepspeed.initialize does first: a caller may leave creating the process group to it
    deepspeed.comm.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        distributed_port=kwargs.get("distributed_port", 29500),
        dist_init_required=kwargs.get("dist_init_required"),
    )
    known = known_plans.plan_of_partition(model, plan)
    if known is not None:
        if plan is None and known.plan.levels.config != sections.hierarchical_zero:
            raise ConfigError(
                "the model's parameters are partitioned by an earlier hierarchical engine (or Init) whose "
                "hierarchical_zero section differs from this config's: give the same section, or build the "
                "model again"
            )
        check_before_collectives(read_ds_config(source), sections.hierarchical_zero)
        plan = known.plan
    else:
        plan = plan or prepare(model, source, sections, mpu=mpu, topology=topology)
        known = known_plans.remember(plan)
    levels = plan.levels
    previous_mpu = ds_groups.mpu
    patched_comm = comm.patch_deepspeed_comm()
    reducer = inject.register(levels)
    level_mpu = inject.LevelMPU(levels, base=mpu, single=levels.self_group)
    with inject.hierarchical_stage3(levels, reducer):
        result = deepspeed.initialize(model=model, config=config, mpu=level_mpu, **kwargs)
    engine = result[0]
    engine.hierarchical_zero = plan
    known.engines += 1
    _undo_on_destroy(engine, known, level_mpu, previous_mpu, patched_comm)
    return result


def _undo_on_destroy(
    engine: Any,
    known: known_plans.KnownPlan,
    level_mpu: inject.LevelMPU,
    previous_mpu: Any,
    patched_comm: bool,
) -> None:
    """``engine.destroy()`` then also undoes what :func:`initialize` made: DeepSpeed's ``groups.mpu``
    where it is still ours, the communication patch if this engine applied it, and, when it is the
    last live engine of its plan, the plan's hop routes (and the dispatchers when no plan has any)
    and its process groups."""
    destroy = engine.destroy
    destroyed = False

    def destroy_and_undo() -> None:
        nonlocal destroyed
        destroy()
        levels = engine.hierarchical_zero.levels
        if destroyed or not levels.groups.groups:  # destroyed already
            return
        destroyed = True
        known.engines -= 1
        if known.engines == 0:  # engines built on one module share its plan's groups: the last one frees them
            inject.unregister(levels)
            levels.destroy_groups()
        if ds_groups.mpu is level_mpu:
            ds_groups.mpu = previous_mpu
        if patched_comm:
            comm.unpatch_deepspeed_comm()

    engine.destroy = destroy_and_undo
