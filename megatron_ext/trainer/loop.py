"""The training loop of the main job: Megatron's learning-rate schedule, micro-batches through the
engine, one log record per iteration, checkpoints where asked."""

from __future__ import annotations

import argparse
import json
import math
import resource
import time
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from deepspeed_ext.zero.cost.workload import Model, Recompute
from megatron_ext.integration.gpt import gpt_loss
from megatron_ext.trainer.components import plugin_figures


def lr_at(args: argparse.Namespace, iteration: int) -> float:
    """Linear warm-up then cosine decay to --min-lr, as Megatron's default schedule."""
    if iteration < args.lr_warmup_iters:
        return args.lr * (iteration + 1) / args.lr_warmup_iters
    span = max(1, args.train_iters - args.lr_warmup_iters)
    progress = min(1.0, (iteration - args.lr_warmup_iters) / span)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


def train_loop(
    args: argparse.Namespace,
    engine: Any,
    data: Any,
    counter: Any,
    start_iteration: int,
    consumed: int,
    global_batch: int,
    log_file: Any,
    tensorboard: Any = None,
) -> None:
    """Train from ``start_iteration`` to ``--train-iters`` (or ``--exit-interval``), logging each
    iteration's loss, learning rate, tokens/s and the plugins' figures (to ``log_file`` and a
    TensorBoard writer where given), saving where asked."""
    rank, dp = dist.get_rank(), ps.get_data_parallel_world_size()
    device = next(engine.module.parameters()).device
    flops = iteration_flops(args, engine, global_batch)
    for iteration in range(start_iteration, args.train_iters):
        counter.reset()
        t0 = time.perf_counter()
        lr = engine.get_lr()[0]  # the rate this iteration's step uses
        losses = []
        for _ in range(engine.gradient_accumulation_steps()):
            batch = {k: v.to(device, non_blocking=True) for k, v in next(data).items()}
            loss = gpt_loss(engine, batch)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        consumed += global_batch
        mean = torch.stack(losses).mean().reshape(1).float()
        dist.all_reduce(mean, group=ps.get_data_parallel_group())
        mean = mean.item() / dp
        elapsed = time.perf_counter() - t0
        figures = plugin_figures(data, counter)
        done = iteration + 1
        grad_norm = engine.get_global_grad_norm()
        record = {
            "iteration": done,
            "loss": mean,
            "lr": lr,
            "ms_per_iter": elapsed * 1e3,
            "tokens_per_s": global_batch * args.seq_length / elapsed,
            "tflops_per_gpu": flops / elapsed / dist.get_world_size() / 1e12,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "memory_gb": peak_memory_gb(device),
            **figures,
        }
        if done % args.log_interval == 0:
            extras = "".join(f" | {k} {v}" for k, v in figures.items())
            norm = "n/a" if record["grad_norm"] is None else f"{record['grad_norm']:.3f}"
            log(
                rank,
                f"iteration {done}/{args.train_iters} | loss {mean:.4f} | lr {lr:.3e} | "
                f"elapsed time per iteration (ms): {record['ms_per_iter']:.1f} | grad norm {norm} | "
                f"tokens/s {record['tokens_per_s']:.1f} | "
                f"TFLOP/s/GPU {record['tflops_per_gpu']:.3f} | {memory_label(device)} {record['memory_gb']:.2f} GB{extras}",
            )
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


def iteration_flops(args: argparse.Namespace, engine: Any, global_batch: int) -> float:
    """Model FLOPs of one iteration, as Megatron counts them for its TFLOP/s (Narayanan et al.,
    arXiv 2104.04473, eq. 3, without recomputation), over the padded vocabulary the model holds."""
    weight = engine.module.embedding.word_embeddings.weight
    vocab = getattr(weight, "ds_shape", weight.shape)[0] * ps.get_tensor_model_parallel_world_size()
    model = Model(args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length, vocab)
    return model.flops(global_batch, Recompute.NONE)


def peak_memory_gb(device: torch.device) -> float:
    """This rank's peak memory so far: the device's most allocated bytes, or on the CPU the
    process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def memory_label(device: torch.device) -> str:
    return "max allocated" if device.type == "cuda" else "peak RSS"


def log(rank: int, message: str) -> None:
    """Print on rank 0."""
    if rank == 0:
        print(message, flush=True)
