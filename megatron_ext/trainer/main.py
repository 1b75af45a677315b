"""The main job: pretrain a megatron-core GPT under the DeepSpeed engine, with the suite's plugins
when enabled (``python scripts/pretrain_gpt.py`` or ``python -m megatron_ext.trainer.main``, one process per
rank under torchrun, srun or the scripts in ``scripts/``)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import warnings

import torch.distributed as dist
from megatron.core import parallel_state as ps

from mdsp_base import comm
from mdsp_base.installer import Installer
from mdsp_base.section import ConfigError
from mdsp_base.shutdown import exit_without_teardown
from mdsp_base.topology import detect_topology
from megatron_ext.data.config import check_shm_space_at_start
from megatron_ext.data.indexed import DatasetFileError
from megatron_ext.integration.args import plugin_config_from_args
from megatron_ext.integration.core_on_cpu import cpu_support_enabled
from megatron_ext.integration.plugin_config import log_effective_config, validate_against_world
from megatron_ext.trainer import components as c
from megatron_ext.trainer import data as d
from megatron_ext.trainer.cli import parse_args
from megatron_ext.trainer.loop import log, lr_at, train_loop


def train(args: argparse.Namespace, installer: Installer) -> None:
    """Set up the job, then train; every process-wide change goes through ``installer``."""
    plugins = plugin_config_from_args(args)  # config errors surface before any process group exists
    world, rank = c.init_distributed(args, installer)
    tp = args.tensor_model_parallel_size
    dp = world // tp
    validate_against_world(plugins, world, dp)
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
    ds_config = c.deepspeed_config_for(args, dp)
    tensorboard = c.tensorboard_writer(args, rank, installer)
    log_effective_config(plugins, rank)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    installer.add("megatron.core", "megatron-core's model-parallel groups", ps.destroy_model_parallel)

    tokenizer = d.build_tokenizer(args)
    data_prefix = d.prepare_data(args, rank, tokenizer)
    model = c.build_model(args, plugins, tokenizer, topology, ds_config, installer)
    log(
        rank,
        f"device {next(model.parameters()).device}, backend {dist.get_backend()}, "
        f"megatron-core CPU support {'on' if cpu_support_enabled() else 'off'}",
    )
    engine = c.build_engine(
        args, model, ds_config, plugins, topology, lambda it: lr_at(args, it) / args.lr, installer
    )
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
            args, engine, data, counter, start_iteration, consumed, global_batch, log_file, tensorboard
        )
    dist.barrier()  # every rank is done before the installer takes the groups down


def _quiet(installer: Installer) -> None:
    """megatron-core, torch and DeepSpeed warn once per rank about optional fused kernels and
    deprecations, and log every collective set-up: keep the job's log to its own lines."""
    installer.enter(
        "megatron_ext.trainer",
        "warnings filters for megatron, torch and deepspeed",
        warnings.catch_warnings(),
    )
    for module in ("megatron", "torch", "deepspeed"):
        warnings.filterwarnings("ignore", category=UserWarning, module=module)
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        installer.setattr(
            "megatron_ext.trainer",
            "DeepSpeed's and torch.distributed's loggers at WARNING",
            logging.getLogger(name),
            "level",
            logging.WARNING,
        )
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
        installer.add("megatron_ext.trainer", "a root log handler", lambda: root.removeHandler(handler))
    installer.setattr("megatron_ext.trainer", "the root logger at INFO", root, "level", logging.INFO)


def main(argv: list[str] | None = None) -> int:
    """Run the job; returns the exit status (2 with one ``error:`` line on bad input)."""
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the job with parsed flags; returns the exit status (2 with one ``error:`` line on bad input)."""
    try:
        with Installer() as installer:
            _quiet(installer)
            train(args, installer)
    except (c.UsageError, ConfigError, DatasetFileError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
