"""The A/B's engines: each built clean of the last one's globals, stepped, measured and freed."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
import torch.distributed as dist

from deepspeed_ext.zero.cost.workload import Model
from deepspeed_ext.zero.tools.ab.model import build_model
from deepspeed_ext.zero.tools.ab.prediction import slowest
from deepspeed_ext.zero.tools.ab.variants import Variant
from mdsp_base import spans
from mdsp_base.topology import Topology


class EmulatedDevice(AbstractContextManager, Protocol):
    """A device the steps' tensor work runs on instead of this process's (an emulated cluster's
    stand-in): entered around each step, which ends when it is idle."""

    def synchronize(self) -> None: ...


def initialize(ours: bool, net: torch.nn.Module, cfg: dict, topology: Topology, mpu: Any = None) -> Any:
    """A ZeRO-3 engine built clean of the last one's globals while others may live: DeepSpeed keeps
    the last engine's mpu and hpZ group in module globals that each engine reads when it is built
    (and keeps), so they are cleared before and after.

    Args:
        ours: the hierarchical variant's initialize; False: ``deepspeed.initialize``.
        net: the model.
        cfg: the engine's DeepSpeed JSON.
        topology: the job's ranks (ours only).
        mpu: Megatron's model-parallel state, or None for pure data parallelism.

    Returns:
        The engine.
    """
    import deepspeed
    from deepspeed.utils import groups

    from deepspeed_ext import zero

    groups.mpu, groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None, None
    if ours:
        engine = zero.initialize(
            model=net, config=cfg, mpu=mpu, topology=topology, model_parameters=net.parameters()
        )[0]
    else:
        engine = deepspeed.initialize(model=net, config=cfg, mpu=mpu, model_parameters=net.parameters())[0]
    groups.mpu, groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None, None
    return engine


def build(variant: Variant, cfg: dict, shape: Model, topology: Topology, device: torch.device) -> Any:
    """The A/B model's engine for one variant.

    Args:
        variant: the engine to build.
        cfg: its DeepSpeed JSON (:func:`.variants.ds_config`).
        shape: the model.
        topology: the job's ranks.
        device: this rank's device.

    Returns:
        The engine.
    """
    return initialize(variant.ours, build_model(shape).to(device), cfg, topology)


def one_step(
    engine: Any, shape: Model, step: int, device: torch.device, emulated: EmulatedDevice | None = None
) -> float:
    """One optimizer step (all micro-batches), timed from a barrier.

    Args:
        engine: the variant's engine.
        shape: the model (its vocabulary and sequence set the random tokens).
        step: the step's index (seeds its tokens).
        device: this rank's device.
        emulated: an emulated device the step's tensor work runs on (the step ends when it is idle).

    Returns:
        The slowest rank's seconds.
    """
    dist.barrier()
    start = time.perf_counter()
    with spans.span("step", "step"), emulated if emulated is not None else nullcontext():
        for micro in range(engine.gradient_accumulation_steps()):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
            tokens = torch.randint(
                shape.vocab, (engine.train_micro_batch_size_per_gpu(), shape.seq + 1), generator=g
            )
            tokens = tokens.to(device)
            with spans.span("forward", "phase"):
                logits = engine(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.float().flatten(0, 1), tokens[:, 1:].flatten()
                )
            with spans.span("backward", "phase"):
                engine.backward(loss)
            with spans.span("optimizer step", "phase"):
                engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return slowest(time.perf_counter() - start, device)


def release(engine: Any) -> None:
    """Free an engine and what DeepSpeed left in its globals (hpZ's group, the mpu).

    Args:
        engine: the engine, not used after.
    """
    from deepspeed.utils import groups

    engine.destroy()
    groups.mpu, groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None, None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def peak_bytes(build: Callable[[], Any], step: Callable[[Any, int], object], device: torch.device) -> int:
    """The peak memory of a fresh engine, built and stepped twice, then freed.

    Args:
        build: builds the engine (while the others idle).
        step: takes one optimizer step of the engine; its second argument is the step's index.
        device: this rank's device.

    Returns:
        Bytes: on CUDA the allocator's peak since the engine was built; on the CPU the most the
        process held during the second step.
    """
    from torch.profiler import record_function

    from mdsp_base.allocations import AllocationTrace

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with AllocationTrace() as trace:
        engine = build()
        step(engine, 0)
        with record_function("measured step"):
            step(engine, 1)
    release(engine)
    return (
        torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else trace.process_peak("measured step")
    )


def check_fits(shape: Model, device: torch.device) -> None:
    """Refuse a model whose fp32 weights do not fit this device's free memory, naming the fix: each
    rank builds the model whole before ZeRO partitions it (as the suite's main job does).

    Args:
        shape: the model.
        device: this rank's device (only CUDA is checked).

    Raises:
        ValueError: the weights need more than 80 % of the free memory.
    """
    if device.type != "cuda":
        return
    need = 4 * sum(p.numel() for p in build_model(shape, device="meta").parameters())
    free, _ = torch.cuda.mem_get_info(device)
    if need > 0.8 * free:
        raise ValueError(
            f"the A/B model ({vars(shape)}) needs {need / 2**30:.1f} GiB of fp32 weights on each rank before "
            f"partitioning, {free / 2**30:.1f} GiB are free: pass --layers to shrink it or a smaller preset"
        )
