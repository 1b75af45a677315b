"""How the hierarchical variant enters DeepSpeed 0.19: subclasses and two collective dispatchers.

* ``partition_parameters._dist_allgather_fn`` (every ZeRO-3 parameter all-gather) and
  ``stage3.reduce_scatter_coalesced`` (every gradient reduce-scatter) are replaced by dispatchers
  that run a :class:`~.levels.HopPlan` when the group is one of OUR groups, and call DeepSpeed's
  own function otherwise. Our groups are fresh objects made for this engine (never megatron's or
  DeepSpeed's), so a stock engine in the same process is untouched; with no plan registered the
  dispatchers only add a dict lookup.
* The stage-3 optimizer subclass sets DeepSpeed's hpZ group global to our secondary group while it
  is constructed (DeepSpeed reads the secondary group's size and rank from that global, not from the
  group it is passed) and restores it after, so nothing leaks into a later engine.
* :class:`LevelMPU` hands DeepSpeed our data-parallel group object and delegates the rest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.zero import partition_parameters as ds_partition
from deepspeed.runtime.zero import stage3 as ds_stage3
from deepspeed.utils import groups as ds_groups

from deepspeed_ext.zero import hops
from deepspeed_ext.zero.levels import HopPlan, ZeroLevels

_gather_plans: dict[int, tuple[dist.ProcessGroup, HopPlan]] = {}
_reduce_plans: dict[int, tuple[dist.ProcessGroup, HopPlan]] = {}
_originals: dict[str, Any] = {}


class _Completed:
    """Work handle of a collective that already ran (the hops are synchronous)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _lookup(table: dict[int, tuple[dist.ProcessGroup, HopPlan]], group: Any) -> HopPlan | None:
    entry = table.get(id(group))
    return entry[1] if entry is not None and entry[0] is group else None


def _allgather_dispatch(input_tensor: torch.Tensor, output_tensor: torch.Tensor, group: Any = None) -> Any:
    plan = _lookup(_gather_plans, group)
    if plan is None:
        return _originals["allgather"](input_tensor, output_tensor, group=group)
    with torch.no_grad():
        hops.all_gather(plan, input_tensor, output_tensor)
    return _Completed()


def _reduce_scatter_dispatch(tensors: Sequence[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
    plan = _lookup(_reduce_plans, group)
    if plan is None:
        return _originals["reduce_scatter"](tensors, group)
    with torch.no_grad():
        return hops.reduce_scatter_coalesced(plan, tensors)


def install_dispatchers() -> None:
    """Put the dispatchers in place (idempotent)."""
    if "allgather" not in _originals:
        _originals["allgather"] = ds_partition._dist_allgather_fn
        _originals["reduce_scatter"] = ds_stage3.reduce_scatter_coalesced
    ds_partition._dist_allgather_fn = _allgather_dispatch
    ds_stage3.reduce_scatter_coalesced = _reduce_scatter_dispatch


def uninstall_dispatchers() -> None:
    """Restore DeepSpeed's functions and forget every plan."""
    if "allgather" in _originals:
        ds_partition._dist_allgather_fn = _originals.pop("allgather")
        ds_stage3.reduce_scatter_coalesced = _originals.pop("reduce_scatter")
    _gather_plans.clear()
    _reduce_plans.clear()


def unregister(levels: ZeroLevels) -> None:
    """Forget the plans of ``levels``; with no plan left, DeepSpeed's functions are restored."""
    for table in (_gather_plans, _reduce_plans):
        for group in (levels.dp_group, levels.secondary_group):
            if _lookup(table, group) is not None:
                del table[id(group)]
    if not _gather_plans and not _reduce_plans:
        uninstall_dispatchers()


def register(levels: ZeroLevels) -> None:
    """Route this engine's collectives: primary and node-level gathers and (hierarchical) gradient
    reduce-scatters in hops; a package-level gather is one hop, so DeepSpeed's own call does it."""
    install_dispatchers()
    dp = levels.dp_plan()
    if not dp.is_trivial:
        _gather_plans[id(levels.dp_group)] = (levels.dp_group, dp)
        if levels.grad_reduce == "hierarchical":
            _reduce_plans[id(levels.dp_group)] = (levels.dp_group, dp)
    secondary = levels.secondary_plan()
    if secondary is not None and not secondary.is_trivial:
        _gather_plans[id(levels.secondary_group)] = (levels.secondary_group, secondary)


@contextlib.contextmanager
def secondary_group_global(group: dist.ProcessGroup | None) -> Iterator[None]:
    """DeepSpeed's hpZ group global set to ``group`` (None: no secondary copy) for a construction."""
    previous = ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP
    ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = group
    try:
        yield
    finally:
        ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = previous


@contextlib.contextmanager
def hierarchical_stage3(levels: ZeroLevels) -> Iterator[type]:
    """While active, the engine builds our stage-3 optimizer (it looks the class up in ``stage3``)."""
    base = ds_stage3.DeepSpeedZeroOptimizer_Stage3

    class HierarchicalZeroOptimizer(base):  # type: ignore[misc, valid-type]
        """ZeRO-3 whose secondary weight copy lives on ``levels.secondary_group``."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            with secondary_group_global(levels.secondary_group):
                super().__init__(*args, **kwargs)
            self.hierarchical_levels = levels

    ds_stage3.DeepSpeedZeroOptimizer_Stage3 = HierarchicalZeroOptimizer
    try:
        yield HierarchicalZeroOptimizer
    finally:
        ds_stage3.DeepSpeedZeroOptimizer_Stage3 = base


class Init(deepspeed.zero.Init):
    """``deepspeed.zero.Init`` that partitions over our data-parallel group and builds the secondary
    copy on our secondary group: use it (with the same ``levels``) to build a model partitioned."""

    def __init__(self, levels: ZeroLevels, **kwargs: Any) -> None:
        for key in ("data_parallel_group", "zero_param_parallel_group", "sequence_data_parallel_group"):
            if kwargs.get(key) is not None:
                raise ValueError(f"Init({key}=...) is set from levels; remove the argument")
        register(levels)
        kwargs["data_parallel_group"] = levels.dp_group
        kwargs["zero_param_parallel_group"] = levels.secondary_group
        with secondary_group_global(levels.secondary_group):
            super().__init__(**kwargs)


class LevelMPU:
    """DeepSpeed's ``mpu`` with our data-parallel group; model parallel from ``base`` (or size 1)."""

    def __init__(self, levels: ZeroLevels, base: Any = None, single: dist.ProcessGroup | None = None) -> None:
        if base is None and single is None:
            raise ValueError("LevelMPU needs the model's mpu or a one-rank group for model parallelism")
        self._levels = levels
        self._base = base
        self._single = single

    def __getattr__(self, name: str) -> Any:  # what DeepSpeed probes with hasattr goes to the base
        if name.startswith("_") or self._base is None:
            raise AttributeError(name)
        return getattr(self._base, name)

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self._levels.dp_group

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._levels.dp_group)

    def get_data_parallel_world_size(self) -> int:
        return len(self._levels.dp_ranks)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._levels.dp_ranks)

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self._single if self._base is None else self._base.get_model_parallel_group()

    def get_model_parallel_rank(self) -> int:
        return 0 if self._base is None else self._base.get_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return 1 if self._base is None else self._base.get_model_parallel_world_size()

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        base = self._base
        return self.get_model_parallel_group() if base is None else base.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_rank(self) -> int:
        return 0 if self._base is None else self._base.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_world_size(self) -> int:
        return 1 if self._base is None else self._base.get_tensor_model_parallel_world_size()
