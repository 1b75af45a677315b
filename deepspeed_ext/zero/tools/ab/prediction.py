"""The A/B command's prediction of each variant's step: its compute measured alone, then the cost
model (:mod:`deepspeed_ext.zero.cost.step`) with the probe profile and the collectives the engine launched."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from deepspeed_ext.zero.cost import collectives
from deepspeed_ext.zero.cost.profile import Profile
from deepspeed_ext.zero.cost.step import StepPrediction, predict
from deepspeed_ext.zero.cost.workload import Buckets, Model
from deepspeed_ext.zero.tools.ab.model import build_model
from deepspeed_ext.zero.tools.ab.variants import Variant
from mdsp_base.topology import Topology
from mdsp_base.volume import CallKey


def compute_steps(
    shape: Model,
    cfg: dict,
    steps: int,
    warmup: int,
    device: torch.device,
    emulated: AbstractContextManager | None = None,
) -> list[float]:
    """The single-rank step the prediction takes as its compute: the model in the job's dtype,
    micro-batches and Adam step with no ZeRO and no communication, on every rank at once (they share
    the host as the job's ranks do).

    Args:
        shape: the model.
        cfg: the job's DeepSpeed JSON (micro batch, accumulation, dtype).
        steps: timed steps.
        warmup: untimed steps first.
        device: this rank's device.
        emulated: an emulated device entered around each step (idle when it exits); None: ``device``.

    Returns:
        Each timed step's seconds, the slowest rank's.
    """
    micro = int(cfg.get("train_micro_batch_size_per_gpu", 1))
    accumulation = int(cfg.get("gradient_accumulation_steps", 1))
    net = build_model(shape).to(device, job_dtype(cfg))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
    seconds = []
    for step in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        with emulated if emulated is not None else nullcontext():
            for _ in range(accumulation):
                tokens = torch.randint(shape.vocab, (micro, shape.seq + 1), device=device)
                logits = net(tokens[:, :-1])
                F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= warmup:
            seconds.append(slowest(time.perf_counter() - start, device))
    return seconds


def job_dtype(cfg: dict) -> torch.dtype:
    """The dtype the job trains in, in which the compute-only step runs its matmuls as the engines do.

    Args:
        cfg: the job's DeepSpeed JSON.

    Returns:
        bf16 or fp16 where that section is enabled, else fp32.
    """
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if (cfg.get(key) or {}).get("enabled"):
            return dtype
    return torch.float32


def slowest(value: float, device: torch.device) -> float:
    """The largest ``value`` over the ranks (a collective: every rank calls it).

    Args:
        value: this rank's value.
        device: the device of the process group's backend.

    Returns:
        The maximum over the ranks.
    """
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def prefetch_concurrency(cfg: dict, variant: Variant) -> int:
    """All-gathers DeepSpeed's prefetching keeps in flight at once.

    Args:
        cfg: the variant's DeepSpeed JSON.
        variant: the engine.

    Returns:
        0 without prefetch; stock on gloo 2 (its 2 worker threads per group), on NCCL/RCCL 1 (one per
        stream); ours 1 (one hop worker, or one stream, runs whole hop operations in order).
    """
    if Buckets.from_json(cfg).prefetch <= 0:
        return 0
    return 2 if dist.get_backend() == "gloo" and not variant.ours else 1


def predicted(
    calls: dict[CallKey, float],
    cfg: dict,
    profile: Profile,
    topology: Topology,
    variant: Variant,
    accumulation: int,
    compute_s: float,
    fetches: float | None = None,
) -> StepPrediction:
    """The step the cost model predicts for one variant.

    Args:
        calls: the collectives this rank launched per step.
        cfg: the variant's DeepSpeed JSON.
        profile: the probe profile.
        topology: the job's ranks.
        variant: the engine.
        accumulation: micro-batches per step.
        compute_s: the measured single-rank step.
        fetches: DeepSpeed's ``fetch_sub_module`` calls per step (:class:`.gather_wait.GatherWait`);
            None: not counted, and the engine's host cost is left out.

    Returns:
        The predicted step and its parts.
    """
    fallback = collectives.for_topology(topology.ranks_per_package)
    half = (cfg.get("bf16") or {}).get("enabled") or (cfg.get("fp16") or {}).get("enabled")
    return predict(
        profile,
        calls,
        compute_s,
        fetches=fetches,
        passes=2 * accumulation,
        concurrency=prefetch_concurrency(cfg, variant),
        persistent_nbytes=Buckets.from_json(cfg).persistence * (2 if half else 4),
        fallback=fallback,
    )
