"""Entry point of the hierarchical ZeRO-3 variant: checks, plan, groups, then ``deepspeed.initialize``."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Union

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import groups as ds_groups

from deepspeed_ext import comm
from deepspeed_ext.section import ConfigError, read_ds_config
from deepspeed_ext.topology import Topology, detect_topology
from deepspeed_ext.zero import inject
from deepspeed_ext.zero.cost_model import Links, ModelSpec, bytes_per_link, step_hops
from deepspeed_ext.zero.levels import ZeroLevels, build_levels, dp_shape
from deepspeed_ext.zero.planner import (
    SecondaryChoice,
    choose_secondary_level,
    describe,
    hop_buffers,
    links_for,
    variant_for,
)
from plugin_config import PluginConfig, load_plugin_config, validate_against_world

logger = logging.getLogger(__name__)

SUPPORTED_DEEPSPEED = ("0.19.",)
_CONFLICTS = {
    "zero_quantized_weights": "qwZ",
    "zero_quantized_nontrainable_weights": "qwZ for frozen weights",
    "zero_quantized_gradients": "qgZ",
}


@dataclass
class HierarchicalPlan:
    """What the variant decided for this rank, kept on the engine as ``engine.hierarchical_zero``."""

    levels: ZeroLevels
    """Groups and the chosen secondary level."""
    choice: SecondaryChoice
    """The planner's figures."""
    model: ModelSpec
    """This rank's parameters as the cost model sees them."""
    links: Links
    """Link speeds the planner used."""

    def predicted_bytes(self, micro_batches: int = 1) -> dict[str, int]:
        """Bytes per link class this rank sends in one steady-state step (gathers and reductions)."""
        variant = variant_for(self.levels.config, self.levels.secondary_level, self.model)
        return bytes_per_link(step_hops(self.model, self.levels.shape, variant, micro_batches))


def check_deepspeed_version(version: str | None = None) -> None:
    version = version or deepspeed.__version__
    if not version.startswith(SUPPORTED_DEEPSPEED):
        raise ConfigError(
            f"hierarchical_zero supports DeepSpeed {', '.join(v + 'x' for v in SUPPORTED_DEEPSPEED)}, found {version}: "
            "install deepspeed>=0.19,<0.20 or disable hierarchical_zero"
        )


def validate_deepspeed_config(ds: dict) -> None:
    """Reject DeepSpeed settings that cannot work with the variant (no collective runs here)."""
    zero = ds.get("zero_optimization") or {}
    if zero.get("stage", 0) != 3:
        raise ConfigError(
            f"hierarchical_zero needs zero_optimization.stage 3, got {zero.get('stage', 0)}: "
            'set "zero_optimization": {"stage": 3} or disable hierarchical_zero'
        )
    if (zero.get("zero_hpz_partition_size") or 1) > 1:
        raise ConfigError(
            f"zero_optimization.zero_hpz_partition_size={zero['zero_hpz_partition_size']} conflicts with hierarchical_zero, "
            "which places the secondary weight copy itself (hierarchical_zero.secondary_level): remove zero_hpz_partition_size"
        )
    for key, name in _CONFLICTS.items():
        if zero.get(key):
            raise ConfigError(
                f"zero_optimization.{key}=true ({name}) cannot be combined with hierarchical_zero: "
                f"set it to false or disable hierarchical_zero"
            )
    if zero.get("reduce_scatter") is False:
        raise ConfigError(
            "zero_optimization.reduce_scatter=false makes ZeRO-3 all-reduce gradients, which bypasses "
            "the hierarchical reduce-scatter: remove it or disable hierarchical_zero"
        )
    if zero.get("stage3_use_all_reduce_for_fetch_params") or zero.get("use_all_reduce_for_fetch_params"):
        raise ConfigError(
            "zero_optimization.stage3_use_all_reduce_for_fetch_params=true replaces the parameter "
            "all-gather that hierarchical_zero splits into hops: remove it or disable hierarchical_zero"
        )
    offload = zero.get("offload_param") or {}
    if zero.get("cpu_offload_param") or offload.get("device", "none") != "none":
        raise ConfigError(
            "zero_optimization.offload_param is not supported with hierarchical_zero "
            "(the secondary copy would be offloaded too): remove it or disable hierarchical_zero"
        )


def model_spec(model: torch.nn.Module, ds: dict) -> ModelSpec:
    """This rank's parameters (a TP shard under TP) and the element sizes ZeRO-3 sends them in."""
    params = list(model.parameters())
    if not params:
        raise ConfigError("the model has no parameters: nothing for ZeRO-3 to partition")
    numels = tuple(int(getattr(p, "ds_numel", p.numel())) for p in params)
    half = (ds.get("bf16") or {}).get("enabled") or (ds.get("fp16") or {}).get("enabled")
    weight = 2 if half else params[0].element_size()
    grad = {"fp32": 4, "fp16": 2, "bf16": 2}.get(ds.get("communication_data_type") or "", weight)
    owners = sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
    return ModelSpec(param_numels=numels, weight_bytes=weight, grad_bytes=grad, gathers_per_pass=owners)


def largest_collectives(ds: dict, model: ModelSpec) -> tuple[int, int]:
    """Elements of the largest parameter all-gather and gradient reduce-scatter ZeRO-3 issues: a
    prefetch (reduce) bucket, which DeepSpeed closes after the parameter that fills it, so up to one
    parameter more; never more than the model. DeepSpeed's defaults where the config is silent."""
    zero = ds.get("zero_optimization") or {}
    prefetch_key = (
        "stage3_prefetch_bucket_size" if "stage3_prefetch_bucket_size" in zero else "prefetch_bucket_size"
    )
    prefetch = _bucket_elems(zero, prefetch_key, 5e7)
    bucket = _bucket_elems(zero, "reduce_bucket_size", 5e8)
    total, largest = sum(model.param_numels), max(model.param_numels)
    return min(total, prefetch + largest), min(total, bucket + largest)


def _bucket_elems(zero: dict, key: str, default: float) -> int:
    """A bucket size in elements; a whole non-negative number, as DeepSpeed requires ("auto" is
    for the Hugging Face trainer to fill in before DeepSpeed sees the config)."""
    value = zero.get(key, default)
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value < 0:
        raise ConfigError(
            f"zero_optimization.{key}={value!r} is not a bucket size: give a whole number of elements "
            f"such as {int(default)}, or remove the key for DeepSpeed's default"
        )
    return int(value)


def prepare(
    model: torch.nn.Module | ModelSpec,
    config: Union[str, os.PathLike, dict],
    plugin_config: PluginConfig | None = None,
    mpu: Any = None,
    topology: Topology | None = None,
) -> HierarchicalPlan:
    """Check everything, choose the secondary level, then create the level groups (the first
    collective). Pass the result to :func:`initialize` and to :class:`~.inject.Init`; before a model
    exists (to build it under ``Init``) pass a :class:`ModelSpec` of its parameters instead."""
    ds = read_ds_config(config)
    plugin_config = plugin_config or load_plugin_config(ds)
    hz = plugin_config.hierarchical_zero
    if not hz.enabled:
        raise ConfigError("hierarchical_zero.enabled is false: call deepspeed.initialize directly")
    check_deepspeed_version()
    validate_deepspeed_config(ds)
    if hz.grad_sync == "accumulation_boundary" and ds.get("managed_gradient_accumulation") is False:
        raise ConfigError(
            "hierarchical_zero.grad_sync=accumulation_boundary needs DeepSpeed to know the boundary during "
            "backward, which managed_gradient_accumulation=false hides: remove that key or set grad_sync "
            "to every_micro_batch"
        )
    world = dist.get_world_size()
    dp_group = mpu.get_data_parallel_group() if mpu is not None else None
    dp_ranks = dist.get_process_group_ranks(dp_group) if dp_group is not None else list(range(world))
    validate_against_world(plugin_config, world, len(dp_ranks))
    topology = topology or detect_topology(plugin_config.topology, world_size=world)
    shape = dp_shape(topology, dp_ranks)
    spec = model if isinstance(model, ModelSpec) else model_spec(model, ds)
    links = links_for(hz, ranks_per_nic=topology.ranks_per_package)
    micro = int(ds.get("gradient_accumulation_steps") or 1)
    gather, reduce = largest_collectives(ds, spec)
    buffers = hop_buffers(hz, shape, spec, gather, reduce)
    choice = choose_secondary_level(hz, shape, spec, links, micro_batches=micro, buffers=buffers)
    if dist.get_rank() == 0:
        logger.info(describe(choice, shape))
    levels = build_levels(topology, dp_group, choice.level, hz)
    return HierarchicalPlan(levels=levels, choice=choice, model=spec, links=links)


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
    plugin_config: PluginConfig | None = None,
    mpu: Any = None,
    topology: Topology | None = None,
    plan: HierarchicalPlan | None = None,
    **kwargs: Any,
) -> tuple:
    """``deepspeed.initialize`` with the hierarchical variant when ``hierarchical_zero.enabled``
    (else exactly ``deepspeed.initialize``). ``kwargs`` go to ``deepspeed.initialize`` unchanged.
    Returns what it returns; the engine carries the plan as ``engine.hierarchical_zero``."""
    source = _config_source(config, kwargs)
    plugin_config = plugin_config or load_plugin_config(read_ds_config(source))
    if not plugin_config.hierarchical_zero.enabled:
        return deepspeed.initialize(model=model, config=config, mpu=mpu, **kwargs)
    check_deepspeed_version()
    plan = plan or prepare(model, source, plugin_config, mpu=mpu, topology=topology)
    levels = plan.levels
    foreign = [
        p
        for p in model.parameters()
        if hasattr(p, "ds_process_group") and p.ds_process_group is not levels.dp_group
    ]
    if foreign:
        raise ConfigError(
            "the model was partitioned by another zero.Init: build it under "
            "deepspeed_ext.zero.Init(plan.levels) with the same plan, or without zero.Init"
        )
    previous_mpu = ds_groups.mpu
    patched_comm = comm.patch_deepspeed_comm()
    reducer = inject.register(levels)
    level_mpu = inject.LevelMPU(levels, base=mpu, single=levels.self_group)
    with inject.hierarchical_stage3(levels, reducer):
        result = deepspeed.initialize(model=model, config=config, mpu=level_mpu, **kwargs)
    engine = result[0]
    engine.hierarchical_zero = plan
    _undo_on_destroy(engine, level_mpu, previous_mpu, patched_comm)
    return result


def _undo_on_destroy(engine: Any, level_mpu: inject.LevelMPU, previous_mpu: Any, patched_comm: bool) -> None:
    """``engine.destroy()`` then also undoes what :func:`initialize` made: the engine's hop plans
    (and the dispatchers when no engine has any), its process groups, DeepSpeed's ``groups.mpu``
    where it is still ours, and the communication patch if this engine applied it."""
    destroy = engine.destroy

    def destroy_and_undo() -> None:
        destroy()
        levels = engine.hierarchical_zero.levels
        if not levels.groups.groups:  # destroyed already
            return
        inject.unregister(levels)
        levels.destroy_groups()
        if ds_groups.mpu is level_mpu:
            ds_groups.mpu = previous_mpu
        if patched_comm:
            comm.unpatch_deepspeed_comm()

    engine.destroy = destroy_and_undo
