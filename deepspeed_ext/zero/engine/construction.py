"""A model built partitioned over the hierarchical levels: ``deepspeed.zero.Init`` on our groups.

No rank ever holds the model whole. Unlike DeepSpeed's Init, a module's parameters are partitioned
when the next module's ``__init__`` ends, so that what a parent writes into a child's weight right
after building it (megatron-core's position embeddings) is kept; the price is one module more
whole at a time. Why: docs/hierarchical_zero_modules.md."""

from __future__ import annotations

from typing import Any

import deepspeed
import deepspeed.comm as ds_comm
import torch
from deepspeed.accelerator import get_accelerator

from deepspeed_ext.zero.engine.inject import register, secondary_group_global
from deepspeed_ext.zero.engine.levels import ZeroLevels

INIT_CHANGES = (
    "a partitioned build (hierarchical: deepspeed_ext.zero.Init's level groups, its hop thread and "
    "DeepSpeed's collectives dispatched to its hops), undone by the engine built on it or at teardown"
)
"""What building a model under :class:`Init` changes, in the installers' words."""


class Init(deepspeed.zero.Init):
    """``deepspeed.zero.Init`` that partitions over our data-parallel group and builds the secondary
    copy on our secondary group: use it (with the same ``levels``) to build a model partitioned."""

    def __init__(self, levels: ZeroLevels, **kwargs: Any) -> None:
        for key in ("data_parallel_group", "zero_param_parallel_group", "sequence_data_parallel_group"):
            if kwargs.get(key) is not None:
                raise ValueError(f"Init({key}=...) is set from levels; remove the argument")
        # DeepSpeed reads its config's batch arithmetic through deepspeed.comm, which only
        # deepspeed.initialize would otherwise set up: before it, a silent world size of 1.
        ds_comm.init_distributed(dist_backend=get_accelerator().communication_backend_name())
        register(levels)
        kwargs["data_parallel_group"] = levels.dp_group
        kwargs["zero_param_parallel_group"] = levels.secondary_group
        self._levels = levels
        self._waiting: list[torch.nn.Module] = []
        """The module built last: its parameters are whole until the next module is built."""
        with secondary_group_global(levels.secondary_group):
            super().__init__(**kwargs)

    def _post_init_method(self, module: torch.nn.Module) -> None:
        """``module``'s ``__init__`` ended: the module that ended before it is partitioned (its
        parent has moved on to build another); ``module`` waits for the next one."""
        ready, self._waiting = self._waiting, [module]
        self._partition_modules(ready)

    def _partition_modules(self, modules: list[torch.nn.Module]) -> None:
        with secondary_group_global(self._levels.secondary_group):  # DeepSpeed reads hpZ sizes from it
            for module in modules:
                super()._post_init_method(module)

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> Any:
        waiting, self._waiting = self._waiting, []
        if exc_type is None:  # the last module built
            self._partition_modules(waiting)
        return super().__exit__(exc_type, exc_value, traceback)
