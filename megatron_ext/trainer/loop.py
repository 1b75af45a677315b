"""The training loop of the main job: Megatron's learning-rate schedule, micro-batches through the
engine, one log record per iteration, checkpoints where asked."""

from __future__ import annotations

import argparse
import json
import math
import resource
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import IO, TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from mdsp_base.gpt_flops import gpt_flops
from megatron_ext.integration.gpt import gpt_loss
from megatron_ext.trainer.components import plugin_figures
from megatron_ext.trainer.iteration_log import Interval, iteration_line, loss_scale

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from torch.utils.tensorboard import SummaryWriter

    from mdsp_base.comm import CommCounter
    from megatron_ext.data.batch import BatchIterator


def lr_at(args: argparse.Namespace, iteration: int) -> float:
    """Linear warm-up then cosine decay to --min-lr, as Megatron's default schedule."""
    if iteration < args.lr_warmup_iters:
        return args.lr * (iteration + 1) / args.lr_warmup_iters
    span = max(1, args.train_iters - args.lr_warmup_iters)
    progress = min(1.0, (iteration - args.lr_warmup_iters) / span)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


def train_loop(
    args: argparse.Namespace,
    engine: DeepSpeedEngine,
    data: BatchIterator,
    counter: CommCounter,
    start_iteration: int,
    consumed: int,
    global_batch: int,
    log_file: IO[str] | None,
    tensorboard: SummaryWriter | None = None,
    iteration_context: Callable[[], AbstractContextManager[object]] = nullcontext,
) -> None:
    """Train from ``start_iteration`` to ``--train-iters`` (or ``--exit-interval``), saving where
    asked. Every ``--log-interval`` iterations rank 0 prints Megatron's iteration line
    (:mod:`megatron_ext.trainer.iteration_log`) with tokens/s, memory and the plugins' figures;
    every iteration's figures go to ``log_file`` and a TensorBoard writer where given.

    ``iteration_context()`` is entered around each iteration's timed work (micro-batches, step,
    loss reduction and read) and left before the clock stops: the hook through which a benchmark
    runs that work elsewhere, such as on an emulated device (the job itself passes none)."""
    rank, dp = dist.get_rank(), ps.get_data_parallel_world_size()
    device = next(engine.module.parameters()).device
    # Megatron's model TFLOP/s: a figure for accelerators; a CPU run prints none
    flops = iteration_flops(args, engine, global_batch) if device.type == "cuda" else None
    interval = Interval()
    for iteration in range(start_iteration, args.train_iters):
        counter.reset()
        t0 = time.perf_counter()
        lr = engine.get_lr()[0]  # the rate this iteration's step uses
        skipped_before = engine.skipped_steps
        losses = []
        with iteration_context():
            for _ in range(engine.gradient_accumulation_steps()):
                # None marks a key another pipeline stage gets: the job has one stage, so none is
                batch = {k: v.to(device, non_blocking=True) for k, v in next(data).items() if v is not None}
                loss = gpt_loss(engine, batch)
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach())
            total = torch.stack(losses).mean().reshape(1).float()
            dist.all_reduce(total, group=ps.get_data_parallel_group())
            mean = total.item() / dp
        consumed += global_batch
        elapsed = time.perf_counter() - t0
        skipped = engine.skipped_steps > skipped_before
        interval.add(elapsed, mean, skipped)
        figures = plugin_figures(data, counter)
        done = iteration + 1
        grad_norm = engine.get_global_grad_norm()
        record = {
            "iteration": done,
            "consumed_samples": consumed,
            "loss": mean,
            "lr": lr,
            "ms_per_iter": elapsed * 1e3,
            "tokens_per_s": global_batch * args.seq_length / elapsed,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "skipped": skipped,
            "memory_gb": peak_memory_gb(device),
            **figures,
        }
        if flops is not None:
            record["tflops_per_gpu"] = flops / elapsed / dist.get_world_size() / 1e12
        if done % args.log_interval == 0:
            per_iteration = interval.seconds / interval.iterations
            line = iteration_line(
                iteration=done,
                train_iters=args.train_iters,
                consumed_samples=consumed,
                interval=interval,
                learning_rate=lr,
                global_batch_size=global_batch,
                scale=loss_scale(engine),
                grad_norm=record["grad_norm"],
                throughput=None if flops is None else flops / per_iteration / dist.get_world_size() / 1e12,
                extras={
                    "tokens/s": f"{global_batch * args.seq_length / per_iteration:.1f}",
                    f"{memory_label(device)} (GB)": f"{record['memory_gb']:.2f}",
                    **figures,
                },
            )
            log(rank, line)
            interval = Interval()
        if log_file:
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
        if tensorboard is not None:
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)):
                    tensorboard.add_scalar(key, value, done)
        stop = done == args.train_iters or bool(args.exit_interval and done % args.exit_interval == 0)
        if args.save and (stop or (args.save_interval and done % args.save_interval == 0)):
            engine.save_checkpoint(
                args.save,
                tag=f"iter_{done:07d}",
                client_state={"iteration": done, "consumed_samples": consumed},
            )
        if stop:
            break


def iteration_flops(args: argparse.Namespace, engine: DeepSpeedEngine, global_batch: int) -> float:
    """Model FLOPs of one iteration, as Megatron counts them for its TFLOP/s (Narayanan et al.,
    arXiv 2104.04473, eq. 3, without recomputation), over the padded vocabulary the model holds."""
    weight = engine.module.embedding.word_embeddings.weight
    vocab = getattr(weight, "ds_shape", weight.shape)[0] * ps.get_tensor_model_parallel_world_size()
    return gpt_flops(global_batch, args.seq_length, args.num_layers, args.hidden_size, vocab)


def peak_memory_gb(device: torch.device) -> float:
    """This rank's peak memory so far: the device's most allocated bytes, or on the CPU the
    process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def memory_label(device: torch.device) -> str:
    """What :func:`peak_memory_gb` measures on ``device``."""
    return "max allocated" if device.type == "cuda" else "peak RSS"


def log(rank: int, message: str) -> None:
    """Print on rank 0."""
    if rank == 0:
        print(message, flush=True)
