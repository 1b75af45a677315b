"""The main job: pretrain a megatron-core GPT under the DeepSpeed engine, with the suite's plugins
when enabled (``python scripts/pretrain_gpt.py`` or ``python -m megatron_ext.trainer.main``, one process per
rank under torchrun, srun or the scripts in ``scripts/``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable

import torch.distributed as dist
from megatron.core import parallel_state as ps

from mdsp_base import comm
from mdsp_base.installer import Installer
from mdsp_base.section import ConfigError
from mdsp_base.shutdown import exit_without_teardown
from mdsp_base.topology import detect_topology
from megatron_ext.data.config import check_shm_space_at_start
from megatron_ext.data.indexed import DatasetFileError
from megatron_ext.integration.core_on_cpu import cpu_support_enabled
from megatron_ext.integration.plugin_config import log_effective_config
from megatron_ext.trainer import components as c
from megatron_ext.trainer import data as d
from megatron_ext.trainer.checks import check_job, env_int
from megatron_ext.trainer.cli import parse_args
from megatron_ext.trainer.loop import log, lr_at, train_loop
from megatron_ext.trainer.notices import StartupNotices, quiet
from megatron_ext.trainer.usage_error import UsageError


def train(
    args: argparse.Namespace,
    installer: Installer,
    notices: StartupNotices,
    iteration_context: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
) -> None:
    """Set up the job, then train; every process-wide change goes through ``installer``; the
    start-up's third-party warnings, collected in ``notices``, are reported once it is done;
    ``iteration_context`` as :func:`~megatron_ext.trainer.loop.train_loop` takes it."""
    world = env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    # Every model-free check, before any process group exists: a bad flag fails before any wait.
    plugins, ds_config, warnings = check_job(args, world)
    rank = c.init_distributed(world, installer)
    for warning in warnings if rank == 0 else []:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    tp = args.tensor_model_parallel_size
    dp = world // tp
    if plugins.hierarchical_zero.enabled and dp == 1 and rank == 0:
        print(
            "warning: hierarchical_zero is on with one data-parallel rank: there is nothing to partition "
            "across levels, so it changes nothing; run more ranks, or switch it off (--no-hierarchical-zero)",
            file=sys.stderr,
            flush=True,
        )
    topology = detect_topology(plugins.topology, world_size=world)  # once; every plugin gets this one
    check_shm_space_at_start(
        plugins.shm_data_loader,
        topology.ranks_per_node,
        tp,
        args.micro_batch_size,
        args.seq_length,
        args.vocab_size,
    )
    tensorboard = c.tensorboard_writer(args, rank, installer)
    log_effective_config(plugins, rank)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    installer.add("megatron.core", "megatron-core's model-parallel groups", ps.destroy_model_parallel)

    tokenizer = d.build_tokenizer(args)
    data_prefix = d.prepare_data(args, rank, tokenizer)
    model, plan = c.build_model(args, plugins, tokenizer, topology, ds_config, installer)
    log(
        rank,
        f"device {next(model.parameters()).device}, backend {dist.get_backend()}, "
        f"megatron-core CPU support {'on' if cpu_support_enabled() else 'off'}",
    )
    engine = c.build_engine(
        args, model, plan, ds_config, plugins, topology, lambda it: lr_at(args, it) / args.lr, installer
    )
    notices.report()
    start_iteration, consumed = 0, 0
    if args.load:
        path, client = engine.load_checkpoint(args.load)
        if path is None:
            log(rank, f"no checkpoint in {args.load}: starting from scratch")
        else:
            start_iteration, consumed = client["iteration"], client["consumed_samples"]
            log(rank, f"resumed from {path} at iteration {start_iteration}, consumed_samples {consumed}")

    global_batch = ds_config["train_micro_batch_size_per_gpu"] * ds_config["gradient_accumulation_steps"] * dp
    data = d.build_data_iterator(
        args, plugins, topology, data_prefix, consumed, global_batch, tokenizer, installer
    )
    counter = c.comm_counter(topology, installer)
    writes_log = bool(args.log_json) and rank == 0
    with (
        open(args.log_json, "a") if writes_log else contextlib.nullcontext() as log_file,
        comm.counting(counter),
    ):
        train_loop(
            args,
            engine,
            data,
            counter,
            start_iteration,
            consumed,
            global_batch,
            log_file,
            tensorboard,
            iteration_context,
        )
    dist.barrier()  # every rank is done before the installer takes the groups down


def main(argv: list[str] | None = None) -> int:
    """Run the job; returns the exit status (2 with one ``error:`` line on bad input)."""
    args = parse_args(argv)
    with Installer() as installer:
        return run(args, installer, quiet(installer))


def run(
    args: argparse.Namespace,
    installer: Installer,
    notices: StartupNotices,
    iteration_context: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
) -> int:
    """Run the job with parsed flags, its changes made through ``installer`` (which holds
    :func:`~megatron_ext.trainer.notices.quiet`'s ``notices``); returns the exit status: 2 with one
    ``error:`` line on bad input, printed by the first rank of each node (a node's environment,
    such as its ``/dev/shm``, may differ from another's; the flags and config are every rank's).
    ``iteration_context`` is entered around each iteration's work (a benchmark's hook; see
    :func:`~megatron_ext.trainer.loop.train_loop`)."""
    try:
        train(args, installer, notices, iteration_context)
    except (UsageError, ConfigError, DatasetFileError) as e:
        if os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
