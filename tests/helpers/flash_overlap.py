"""Helpers shared by the Flash-Overlap tests: megatron-core's tensor-parallel state on a pool's
gloo ranks, and a process group stood in for where no ranks run."""

from __future__ import annotations

from typing import Any

import torch


def setup_tp(tp: int, sequence_parallel: bool = True) -> tuple[Any, Any]:
    """megatron-core's parallel state at TP=``tp`` on the CPU (float32 parameters initialised there);
    returns its ModelParallelConfig and the tensor-parallel group."""
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig

    from megatron_ext.integration.core_on_cpu import enable_cpu_support

    enable_cpu_support()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    config = ModelParallelConfig(
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        sequence_parallel=sequence_parallel,
    )
    return config, ps.get_tensor_model_parallel_group()


class FakeGroup:
    """A tensor-parallel group of the given global ranks, seen from its rank 0 (no processes)."""

    group_name = "tp"

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        return 0
