"""Gradient sums that sequence parallelism needs and DeepSpeed does not do.

Parameters replicated over TP but fed a sequence slice (norm weights, RowParallelLinear biases)
are marked ``sequence_parallel``; megatron-core's own DDP sums their gradients over TP, DeepSpeed
ignores the mark. A tensor hook on each sums the gradient over the TP group when autograd
produces it, before any ZeRO stage takes it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def allreduce_sequence_parallel_grads(model: torch.nn.Module, tp_group: dist.ProcessGroup) -> int:
    """Install the TP gradient sum on every ``sequence_parallel`` parameter; returns how many."""
    if dist.get_world_size(tp_group) == 1:
        return 0
    count = 0
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False):

            def _sum(grad: torch.Tensor) -> torch.Tensor:
                grad = grad.clone()
                dist.all_reduce(grad, group=tp_group)
                return grad

            param.register_hook(_sum)
            count += 1
    return count
