"""Pretrain a megatron-core GPT under the DeepSpeed engine, with the suite's plugins when enabled.

One process per rank (torchrun, srun, or the scripts in scripts/). Megatron-style flags; plugin
switches come from the DeepSpeed JSON sections and the flags of ``megatron_ext.args``. Without
--data-path a small local corpus is generated. On a machine without CUDA it runs on CPU with gloo.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import warnings
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)  # run from a checkout without installing

from scripts.train_setup import (  # noqa: E402
    UsageError,
    build_data_iterator,
    build_engine,
    build_model,
    build_tokenizer,
    comm_counter,
    deepspeed_config_for,
    init_distributed,
    plugin_figures,
    prepare_data,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megatron_ext.args import extra_args_provider

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and activations")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument(
        "--tokenizer-type",
        choices=["NullTokenizer"],
        default="NullTokenizer",
        help="Megatron's tokenizer types that need no files: NullTokenizer (ids 0..N-1, EOD = N)",
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        default=256,
        help="vocabulary size before EOD and padding, Megatron's meaning; 256 fits the generated "
        "byte corpus, a corpus from a real tokenizer needs its own (e.g. 50257 for GPT-2's)",
    )
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument(
        "--global-batch-size", type=int, default=None, help="default: micro batch x data-parallel size"
    )
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument(
        "--dataloader-type",
        choices=["single", "cyclic"],
        default="single",
        help="sample order: Megatron's sequential (single) or random (cyclic) sampler",
    )
    g = p.add_argument_group("data and checkpoints")
    g.add_argument(
        "--data-path", default=None, help="prefix of .bin/.idx files; default: a generated local corpus"
    )
    g.add_argument("--data-cache-path", default=None, help="where dataset indices (and the local corpus) go")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="stop (after saving, with --save) once the iteration count is a multiple of this",
    )
    g.add_argument("--deepspeed-config", "--deepspeed_config", dest="deepspeed_config", default=None)
    g.add_argument(
        "--log-json", default=None, help="also write per-iteration records to this JSON-lines file"
    )
    extra_args_provider(p)
    args = p.parse_args(argv)
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    return args


def _lr_at(args: argparse.Namespace, iteration: int) -> float:
    """Linear warm-up then cosine decay to --min-lr, as Megatron's default schedule."""
    if iteration < args.lr_warmup_iters:
        return args.lr * (iteration + 1) / args.lr_warmup_iters
    span = max(1, args.train_iters - args.lr_warmup_iters)
    progress = min(1.0, (iteration - args.lr_warmup_iters) / span)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


def train(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from deepspeed_ext import comm as deepspeed_comm
    from deepspeed_ext.topology import detect_topology
    from megatron_ext.args import plugin_config_from_args
    from megatron_ext.cpu import cpu_support_enabled
    from megatron_ext.layers.p2p_link import shutdown_posters
    from plugin_config import log_effective_config, validate_against_world

    plugins = plugin_config_from_args(args)  # config errors surface before any process group exists
    world, rank = init_distributed(args)
    tp = args.tensor_model_parallel_size
    dp = world // tp
    validate_against_world(plugins, world, dp)
    topology = detect_topology(plugins.topology, world_size=world)  # once; every plugin gets this one
    ds_config = deepspeed_config_for(args, dp)
    log_effective_config(plugins, rank)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)

    tokenizer = build_tokenizer(args)
    data_prefix = prepare_data(args, rank, tokenizer)
    model = build_model(args, plugins, tokenizer, topology)
    _log(
        rank,
        f"device {next(model.parameters()).device}, backend {dist.get_backend()}, "
        f"megatron-core CPU support {'on' if cpu_support_enabled() else 'off'}",
    )
    engine = build_engine(args, model, ds_config, plugins, topology, lambda it: _lr_at(args, it) / args.lr)

    start_iteration, consumed = 0, 0
    if args.load:
        path, client = engine.load_checkpoint(args.load)
        if path is None:
            _log(rank, f"no checkpoint in {args.load}: starting from scratch")
        else:
            start_iteration, consumed = client["iteration"], client["consumed_samples"]
            _log(rank, f"resumed from {path} at iteration {start_iteration}, consumed_samples {consumed}")

    global_batch = ds_config["train_micro_batch_size_per_gpu"] * ds_config["gradient_accumulation_steps"] * dp
    data = build_data_iterator(args, plugins, topology, data_prefix, consumed, global_batch, tokenizer)
    log_file = open(args.log_json, "a") if args.log_json and rank == 0 else None  # noqa: SIM115
    counter = comm_counter(topology)
    try:
        with deepspeed_comm.counting(counter):
            _train_loop(args, engine, data, counter, start_iteration, consumed, global_batch, log_file)
    finally:
        data.close()
        shutdown_posters()
        engine.destroy()  # a hierarchical engine also drops its groups, dispatchers and patches
        deepspeed_comm.unpatch_deepspeed_comm()  # the byte counter's patch (comm_counter)
        if log_file:
            log_file.close()
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _train_loop(
    args: argparse.Namespace,
    engine: Any,
    data: Any,
    counter: Any,
    start_iteration: int,
    consumed: int,
    global_batch: int,
    log_file: Any,
) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext.gpt import gpt_loss

    rank, dp = dist.get_rank(), ps.get_data_parallel_world_size()
    device = next(engine.module.parameters()).device
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
        record = {
            "iteration": done,
            "loss": mean,
            "lr": lr,
            "tokens_per_s": global_batch * args.seq_length / elapsed,
            **figures,
        }
        if done % args.log_interval == 0:
            extras = "".join(f" | {k} {v}" for k, v in figures.items())
            _log(
                rank,
                f"iteration {done}/{args.train_iters} | loss {mean:.4f} | lr {lr:.3e} | "
                f"tokens/s {record['tokens_per_s']:.1f}{extras}",
            )
        if log_file:
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
        stop = done == args.train_iters or bool(args.exit_interval and done % args.exit_interval == 0)
        if args.save and (stop or (args.save_interval and done % args.save_interval == 0)):
            engine.save_checkpoint(
                args.save,
                tag=f"iter_{done:07d}",
                client_state={"iteration": done, "consumed_samples": consumed},
            )
        if stop:
            break


def _log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


def main(argv: list[str] | None = None) -> int:
    from deepspeed_ext.section import ConfigError
    from megatron_ext.data.gpt_dataset import DatasetFileError

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # megatron-core and torch warn once per rank about optional fused kernels and deprecations.
    for module in ("megatron", "torch", "deepspeed"):
        warnings.filterwarnings("ignore", category=UserWarning, module=module)
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = parse_args(argv)
    try:
        train(args)
    except (UsageError, ConfigError, DatasetFileError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        _leave_groups()
        return 2
    return 0


def _leave_groups() -> None:
    """Leave megatron-core's and torch's groups after a start-up error (matters when called in-process)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
