"""The ``mpu`` object DeepSpeed expects, backed by megatron-core's ``parallel_state``.

Without it DeepSpeed treats every rank as data-parallel and broadcasts rank 0's TP shards over
the others: training runs but is silently wrong. Pipeline size 1: model parallel = tensor parallel.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state as ps


class MegatronMPU:
    """The subset of DeepSpeed's mpu interface (0.19) mapped onto megatron-core's groups."""

    def __init__(self) -> None:
        if not ps.model_parallel_is_initialized():
            raise RuntimeError(
                "initialize megatron-core model parallelism (initialize_model_parallel) before MegatronMPU()"
            )
        if ps.get_pipeline_model_parallel_world_size() != 1:
            raise NotImplementedError(
                "pipeline parallelism is not supported by the plugins yet: use --pipeline-model-parallel-size 1"
            )

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return ps.get_data_parallel_group()

    def get_data_parallel_rank(self) -> int:
        return ps.get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return ps.get_data_parallel_world_size()

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return ps.get_tensor_model_parallel_group()

    def get_model_parallel_rank(self) -> int:
        return ps.get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return ps.get_tensor_model_parallel_world_size()

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
