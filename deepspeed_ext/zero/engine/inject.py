"""How the hierarchical variant enters DeepSpeed 0.19: subclasses and three collective dispatchers.

DeepSpeed's parameter all-gather, ``deepspeed.comm.all_gather_into_tensor`` and the stage-3
gradient reduce-scatter are replaced by dispatchers that run a :class:`~.levels.HopSchedule` on
our groups and DeepSpeed's own function on any other, so a stock engine in the same process is
untouched. The stage-3 optimizer subclass and :class:`LevelMPU` hand DeepSpeed our groups. What
each piece does: docs/hierarchical_zero_modules.md."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import deepspeed.comm as ds_comm
import torch
import torch.distributed as dist
from deepspeed.runtime.zero import partition_parameters as ds_partition
from deepspeed.runtime.zero import stage3 as ds_stage3
from deepspeed.utils import groups as ds_groups

from deepspeed_ext.zero.engine import hops
from deepspeed_ext.zero.engine.grad_sync import CHECKPOINT_KEY, GradientReducer, restore_residuals
from deepspeed_ext.zero.engine.hop_worker import HopWorker
from deepspeed_ext.zero.engine.levels import HopSchedule, ZeroLevels


@dataclass
class _Route:
    """How one of our groups' collectives run."""

    group: dist.ProcessGroup
    """Our group object (dispatch is by identity)."""
    plan: HopSchedule
    """Its hops."""
    worker: HopWorker
    """The engine's owner of hop collectives."""
    int8_block: int | None = None
    """Fetch gathers of this group send blockwise int8 across nodes (quantized_weights)."""
    reducer: GradientReducer | None = None
    """Gradient reduce-scatter of this group (hierarchical grad_reduce)."""
    pieces: int = 1
    """Pieces each unquantized gather is pipelined in (pipeline_chunks)."""

    def gather(self, block: torch.Tensor, out: torch.Tensor, int8_block: int | None = None) -> Any:
        """Start the hops of one all-gather; the handle completes when they have run."""
        if self.pieces > 1 and int8_block is None:
            return self.worker.submit_stages(
                out.device, hops.all_gather_stages(self.plan, block, out, self.pieces)
            )
        return self.worker.submit(
            out.device, functools.partial(hops.all_gather, self.plan, block, out, int8_block)
        )


ENGINE_CHANGES = (
    "a DeepSpeed engine (hierarchical: DeepSpeed's collectives dispatched to its hops, its hop threads "
    "and level groups, DeepSpeed's groups.mpu, the byte-counting patch), undone by engine.destroy()"
)
"""What an engine changes beyond itself, in the words the installers list it with."""

_routes: dict[int, _Route] = {}
_originals: dict[str, Any] = {}


def _route(group: Any) -> _Route | None:
    route = _routes.get(id(group))
    return route if route is not None and route.group is group else None


def _fetch_gather_dispatch(input_tensor: torch.Tensor, output_tensor: torch.Tensor, group: Any = None) -> Any:
    """``_dist_allgather_fn``: ZeRO-3's forward/backward parameter fetches (quantizable)."""
    route = _route(group)
    if route is None:
        return _originals["fetch_gather"](input_tensor, output_tensor, group=group)
    return route.gather(input_tensor, output_tensor, route.int8_block)


def _gather_dispatch(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    **kwargs: Any,
) -> Any:
    """``deepspeed.comm.all_gather_into_tensor``: every other gather on our groups
    (``GatheredParameters``, persistent parameters, checkpoints), in hops, never quantized."""
    route = _route(group)
    if route is None:
        return _originals["gather"](output_tensor, tensor, group=group, async_op=async_op, **kwargs)
    handle = route.gather(tensor, output_tensor)
    if async_op:
        return handle
    handle.wait()
    return None


def _reduce_scatter_dispatch(tensors: Sequence[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
    route = _route(group)
    if route is None or route.reducer is None:
        return _originals["reduce_scatter"](tensors, group)
    return route.reducer.reduce(tensors, route.worker)


def install_dispatchers() -> None:
    """Put the dispatchers in place (idempotent)."""
    if not _originals:
        _originals["fetch_gather"] = ds_partition._dist_allgather_fn
        _originals["gather"] = ds_comm.all_gather_into_tensor
        _originals["reduce_scatter"] = ds_stage3.reduce_scatter_coalesced
    ds_partition._dist_allgather_fn = _fetch_gather_dispatch
    ds_comm.all_gather_into_tensor = _gather_dispatch
    ds_stage3.reduce_scatter_coalesced = _reduce_scatter_dispatch


def uninstall_dispatchers() -> None:
    """Restore DeepSpeed's functions and forget every route."""
    if _originals:
        ds_partition._dist_allgather_fn = _originals.pop("fetch_gather")
        ds_comm.all_gather_into_tensor = _originals.pop("gather")
        ds_stage3.reduce_scatter_coalesced = _originals.pop("reduce_scatter")
    for route in _routes.values():
        route.worker.shutdown()
    _routes.clear()


def unregister(levels: ZeroLevels) -> None:
    """Forget the routes of ``levels`` and stop their worker; with no route left, DeepSpeed's
    functions are restored. Levels whose groups are destroyed were unregistered before."""
    if not levels.groups.groups:
        return
    for group in (levels.dp_group, levels.secondary_group):
        route = _route(group)
        if route is not None:
            route.worker.shutdown()
            del _routes[id(group)]
    if not _routes:
        uninstall_dispatchers()


def register(levels: ZeroLevels) -> GradientReducer | None:
    """Route this engine's collectives: gathers over the DP group and the secondary group in hops
    (one worker runs them all, so the groups see one order), gradient reduce-scatters through a
    :class:`GradientReducer` when ``grad_reduce`` is hierarchical. Returns that reducer."""
    install_dispatchers()
    # Init(levels) and then initialize() register the same levels: keep one worker (one thread, one order)
    previous = _route(levels.dp_group) or _route(levels.secondary_group)
    config, worker = levels.config, previous.worker if previous is not None else HopWorker()
    reducer = None
    dp = levels.dp_plan()
    across_nodes = config.quantized_weights or config.grad_bits or config.grad_sync == "accumulation_boundary"
    if not dp.is_trivial or across_nodes:
        if levels.grad_reduce == "hierarchical":
            reducer = GradientReducer(
                dp,
                config.grad_sync == "accumulation_boundary",
                config.grad_bits,
                config.quantization_block,
                config.pipeline_chunks,
            )
        int8 = config.quantization_block if config.quantized_weights else None
        _routes[id(levels.dp_group)] = _Route(
            levels.dp_group, dp, worker, int8, reducer, config.pipeline_chunks
        )
    secondary = levels.secondary_plan()
    if secondary is not None:  # also when it is one hop: its package group is a hop group of the DP plan
        assert levels.secondary_group is not None  # a secondary plan has its group
        _routes[id(levels.secondary_group)] = _Route(
            levels.secondary_group, secondary, worker, pieces=config.pipeline_chunks
        )
    return reducer


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
def hierarchical_stage3(levels: ZeroLevels, reducer: GradientReducer | None) -> Iterator[type]:
    """While active, the engine builds our stage-3 optimizer (it looks the class up in ``stage3``)."""
    base = ds_stage3.DeepSpeedZeroOptimizer_Stage3
    sp_mean = levels.config.sequence_parallel_gradients == "mean"

    class HierarchicalZeroOptimizer(base):  # type: ignore[misc, valid-type]
        """ZeRO-3 whose secondary weight copy lives on ``levels.secondary_group`` and whose gradient
        reducer learns from it where micro-batches start and steps end."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            with secondary_group_global(levels.secondary_group):
                super().__init__(*args, **kwargs)
            self.hierarchical_levels = levels
            self.hierarchical_reducer = reducer
            if reducer is not None:
                reducer.bind(self.is_gradient_accumulation_boundary)

        def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self, params: Any, dtype: Any) -> list:
            """DeepSpeed's reduce-scatter of a gradient bucket (its mean over the partition group);
            with ``sequence_parallel_gradients: mean`` times SP: the mean over data-parallel replicas."""
            parts = super()._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(params, dtype)
            if sp_mean and self.sequence_parallel_size > 1:
                return [part.mul_(self.sequence_parallel_size) for part in parts]
            return parts

        def clear_backward_seen_flag(self) -> None:  # the engine calls it at every forward
            super().clear_backward_seen_flag()
            if reducer is not None:
                reducer.start_micro_batch()

        def step(self, *args: Any, **kwargs: Any) -> Any:
            if reducer is not None:
                reducer.check_flushed()
            return super().step(*args, **kwargs)

        def state_dict(self) -> dict[str, Any]:  # with error feedback's residuals: a resume continues them
            state = super().state_dict()
            if reducer is not None and reducer.grad_bits:
                state[CHECKPOINT_KEY] = reducer.residual_state()
            return state

        def load_state_dict(
            self, state_dict_list: Any, load_optimizer_states: bool = True, **kwargs: Any
        ) -> None:
            """DeepSpeed's load (the engine passes keywords), after this rank's residuals: read first,
            as a serial load deletes them."""
            if load_optimizer_states:
                folder = kwargs.get("checkpoint_folder")
                mine = None if folder else state_dict_list[dist.get_rank(self.dp_process_group)]
                restore_residuals(reducer, mine, universal=bool(folder))
            super().load_state_dict(state_dict_list, load_optimizer_states, **kwargs)

    ds_stage3.DeepSpeedZeroOptimizer_Stage3 = HierarchicalZeroOptimizer
    try:
        yield HierarchicalZeroOptimizer
    finally:
        ds_stage3.DeepSpeedZeroOptimizer_Stage3 = base


class LevelMPU:
    """DeepSpeed's ``mpu`` with our partition group; model parallel from ``base`` (or size 1).

    DeepSpeed partitions over ``get_data_parallel_group()`` when it converts a model built whole,
    and over the sequence-data-parallel group in its optimizer: both are the levels' parent here.
    With Ulysses (a base whose sequence-data-parallel group is larger than its data-parallel
    group) the data-parallel size and rank stay the base's, because DeepSpeed reads them for batch
    arithmetic only (train_batch_size = micro batch x accumulation x data-parallel ranks)."""

    def __init__(self, levels: ZeroLevels, base: Any = None, single: dist.ProcessGroup | None = None) -> None:
        if base is None and single is None:
            raise ValueError("LevelMPU needs the model's mpu or a one-rank group for model parallelism")
        self._levels = levels
        self._base = base
        self._single = single
        self._batch = base if base is not None and hasattr(base, "get_sequence_data_parallel_group") else None

    def __getattr__(self, name: str) -> Any:  # what DeepSpeed probes with hasattr goes to the base
        if name.startswith("_") or self._base is None:
            raise AttributeError(name)
        return getattr(self._base, name)

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self._levels.dp_group

    def get_data_parallel_rank(self) -> int:
        if self._batch is not None:
            return self._batch.get_data_parallel_rank()
        return dist.get_rank(self._levels.dp_group)

    def get_data_parallel_world_size(self) -> int:
        if self._batch is not None:
            return self._batch.get_data_parallel_world_size()
        return len(self._levels.dp_ranks)

    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup:
        return self._levels.dp_group

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank(self._levels.dp_group)

    def get_sequence_data_parallel_world_size(self) -> int:
        return len(self._levels.dp_ranks)

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        if self._base is None:
            assert self._single is not None  # __init__ refuses a missing base and single both
            return self._single
        return self._base.get_model_parallel_group()

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
