"""The probe's measurement of the engine's own host cost (:mod:`deepspeed_ext.zero.cost.host`).

Every rank at once, as the job's ranks share their host: two stacks of small linear layers, each
stepped by a DeepSpeed ZeRO-3 engine whose groups hold this rank alone (its collectives then cost
next to nothing, so what its step costs beyond plain torch is hooks, fetch bookkeeping and Python)
and by plain torch with Adam, counting DeepSpeed's parameter fetches per step. Every parameter is
partitioned and gathered (``stage3_param_persistence_threshold`` 0), as in the layers of a model
large enough to need ZeRO-3.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepspeed_ext.zero.cost.host import HostTiming

MODULES = (4, 32)
"""Linear layers of the two stacks: the line between their host costs is the cost per fetch."""
STEPS = 5
"""Steps per timed repeat: one step is a few milliseconds, near the host's scheduling noise."""
WIDTH = 64
"""The layers' width: small, so that the step is bookkeeping rather than arithmetic."""


class OneRank:
    """DeepSpeed's ``mpu`` with this rank alone in every group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.group

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1

    get_model_parallel_group = get_tensor_model_parallel_group = get_data_parallel_group
    get_model_parallel_rank = get_tensor_model_parallel_rank = get_data_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size = get_data_parallel_world_size


def engine_config(dtype: torch.dtype) -> dict[str, Any]:
    """ZeRO-3 with every parameter gathered, torch's Adam (no compiled optimizer), the probe's dtype."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "steps_per_print": 2**62,
    }


def stack(modules: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """``modules`` linear layers of :data:`WIDTH`, initialised alike on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(modules))).to(device, dtype)


def host_timings(
    repeats: int,
    dtype: torch.dtype,
    device: torch.device,
    timed: Callable[[Callable[[], object]], list[float]],
) -> list[HostTiming]:
    """Each stack of :data:`MODULES` stepped both ways; ``timed`` times a step's ``repeats`` (after
    one warm-up), each the slowest rank's seconds from a barrier."""
    alone, _ = dist.new_subgroups(group_size=1)
    return [one_stack(modules, alone, repeats, dtype, device, timed) for modules in MODULES]


def one_stack(
    modules: int,
    alone: dist.ProcessGroup,
    repeats: int,
    dtype: torch.dtype,
    device: torch.device,
    timed: Callable[[Callable[[], object]], list[float]],
) -> HostTiming:
    """One stack stepped by a ZeRO-3 engine on the one-rank group ``alone``, then by plain torch."""
    import deepspeed
    from deepspeed.utils import groups

    from deepspeed_ext.zero.tools.ab.gather_wait import GatherWait

    x = torch.randn(8, WIDTH, dtype=dtype, device=device)
    model = stack(modules, dtype, device)
    engine = deepspeed.initialize(
        model=model, config=engine_config(dtype), model_parameters=model.parameters(), mpu=OneRank(alone)
    )[0]

    def engine_steps() -> None:
        for _ in range(STEPS):
            engine.backward(engine(x).float().square().mean())
            engine.step()

    engine_steps()  # DeepSpeed traces the modules' order on its first step: not a steady one
    with GatherWait() as counted:
        engine_seconds = timed(engine_steps)
    engine.destroy()
    groups.mpu = None  # DeepSpeed keeps the mpu in a global that the next engine would read
    net = stack(modules, dtype, device)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)

    def plain_steps() -> None:
        for _ in range(STEPS):
            net(x).float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    fetches = counted.fetches / (repeats + 1) / STEPS  # the warm-up call is counted too
    per_step = lambda seconds: tuple(s / STEPS for s in seconds)  # noqa: E731
    return HostTiming(modules, fetches, per_step(engine_seconds), per_step(timed(plain_steps)))
