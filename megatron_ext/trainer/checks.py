"""The main job's checks that need neither a process group nor a model: the flags' ranges, the
parallel layout against the world size, the plugin sections and DeepSpeed's own sections of the
JSON, and the batch. The job runs them first on every rank; the Slurm scripts' dry run runs them
once, before the queue (``python -m megatron_ext.trainer.checks --world-size N -- FLAGS``).

Each failure is a :class:`UsageError` or a :class:`~mdsp_base.section.ConfigError` whose message
names the flag or key, the value and the fix; :func:`main` prints it as one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from mdsp_base.section import ConfigError, check_deepspeed_sections, read_ds_config
from megatron_ext.integration.args import plugin_config_from_args
from megatron_ext.integration.plugin_config import PluginConfig, validate_against_world
from megatron_ext.trainer.usage_error import UsageError

# Flags that count something: zero or less is never a valid setting.
POSITIVE = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "max_position_embeddings",
    "micro_batch_size",
    "make_vocab_size_divisible_by",
    "tensor_model_parallel_size",
    "log_interval",
)
# Flags where zero means "off" or "none", and below zero means nothing.
NOT_NEGATIVE = ("train_iters", "lr", "min_lr", "lr_warmup_iters")
# Zero here would divide by zero or mean "never": give no flag instead.
POSITIVE_WHEN_GIVEN = (
    "global_batch_size",
    "save_interval",
    "exit_interval",
    "ffn_hidden_size",
    "recompute_num_layers",
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_int(*names: str, default: int) -> int:
    """The first of the variables ``names`` that is set (torchrun's, then srun's), else ``default``."""
    for name in names:
        if os.environ.get(name):
            return int(os.environ[name])
    return default


def check_ranges(args: argparse.Namespace) -> None:
    """Every numeric flag within the values it can take."""
    for names, low, words in (
        (POSITIVE, 1, "a positive number"),
        (NOT_NEGATIVE, 0, "zero or more"),
        (POSITIVE_WHEN_GIVEN, 1, "a positive number, or leave the flag out"),
    ):
        for name in names:
            value = getattr(args, name)
            if value is not None and value < low:
                raise UsageError(f"{_flag(name)} {value}: give {words}")


def check_layout(args: argparse.Namespace, plugins: PluginConfig, world: int) -> None:
    """Tensor parallelism against the world size, the heads, the hidden size and, when sequence
    parallelism is on for any reason (``--sequence-parallel``, or Flash-Overlap, which runs its
    linears sequence-parallel), the sequence."""
    tp = args.tensor_model_parallel_size
    if world % tp:
        raise UsageError(
            f"--tensor-model-parallel-size {tp} does not divide the world size {world}: "
            f"use a divisor of {world}"
        )
    if args.pipeline_model_parallel_size != 1:
        raise UsageError("--pipeline-model-parallel-size other than 1 is not supported by this job")
    heads = args.num_attention_heads
    if heads % tp:
        raise UsageError(
            f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}"
        )
    if args.hidden_size % heads:
        raise UsageError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {heads}: "
            "each head gets hidden/heads channels"
        )
    if args.seq_length % tp and (args.sequence_parallel or plugins.flash_overlap.enabled):
        why = "--sequence-parallel" if args.sequence_parallel else "flash_overlap (it runs sequence-parallel)"
        raise UsageError(
            f"{why} needs --seq-length divisible by --tensor-model-parallel-size: {args.seq_length} is not "
            f"a multiple of {tp}; use e.g. --seq-length {args.seq_length - args.seq_length % tp or tp}"
        )


def check_recompute(args: argparse.Namespace) -> None:
    """Megatron's recompute flags together: full needs a method and a layer count, which mean
    nothing without it (megatron-core's TransformerConfig would refuse them after start-up)."""
    full = args.recompute_granularity == "full"
    given = args.recompute_method is not None and args.recompute_num_layers is not None
    if full and not given:
        raise UsageError(
            "--recompute-granularity full needs --recompute-method and --recompute-num-layers "
            "(e.g. --recompute-method uniform --recompute-num-layers 1: every layer on its own)"
        )
    if not full and (args.recompute_method is not None or args.recompute_num_layers is not None):
        raise UsageError(
            "--recompute-method and --recompute-num-layers apply to --recompute-granularity full only"
        )
    if full and args.recompute_num_layers > args.num_layers:
        raise UsageError(
            f"--recompute-num-layers {args.recompute_num_layers} is more than --num-layers {args.num_layers}"
        )


def deepspeed_config_for(args: argparse.Namespace, dp: int) -> dict[str, Any]:
    """The user's DeepSpeed JSON with the batch and precision flags applied; a conflict is an error."""
    config = dict(read_ds_config(args.deepspeed_config))  # {} without one
    mbs = args.micro_batch_size
    gbs = args.global_batch_size or mbs * dp
    if gbs % (mbs * dp):
        raise UsageError(
            f"--global-batch-size {gbs} is not a multiple of micro batch ({mbs}) x data-parallel ({dp})"
        )
    accum = gbs // (mbs * dp)
    for key, want in (
        ("train_micro_batch_size_per_gpu", mbs),
        ("gradient_accumulation_steps", accum),
        ("train_batch_size", gbs),
    ):
        if key in config and config[key] != want:
            raise UsageError(
                f"{args.deepspeed_config}: {key}={config[key]} but the flags give {want} "
                f"(micro batch {mbs}, global batch {gbs}, data-parallel {dp}): make them agree"
            )
    config.update(train_micro_batch_size_per_gpu=mbs, gradient_accumulation_steps=accum, train_batch_size=gbs)
    config.setdefault("optimizer", {"type": "Adam", "params": {"torch_adam": True}})
    config["optimizer"].setdefault("params", {})["lr"] = args.lr
    if args.bf16:
        config["bf16"] = {"enabled": True}
    config.setdefault("steps_per_print", 10**9)
    return config


def checkpoint_warnings(args: argparse.Namespace) -> list[str]:
    """Settings that run but do not do what they seem to: an interval with nowhere to save."""
    if args.save_interval and not args.save:
        return [
            f"--save-interval {args.save_interval} without --save: no checkpoint will be written; "
            "pass --save DIR (the Slurm scripts: CHECKPOINT_DIR=DIR or --checkpoint-dir DIR)"
        ]
    return []


def check_job(args: argparse.Namespace, world: int) -> tuple[PluginConfig, dict[str, Any], list[str]]:
    """Every check of the job that needs no process group and no model, in the order a user fixes
    them; returns the plugin configuration, the DeepSpeed config the engine gets and the warnings."""
    check_ranges(args)
    check_recompute(args)
    plugins = plugin_config_from_args(args)
    check_layout(args, plugins, world)
    dp = world // args.tensor_model_parallel_size
    validate_against_world(plugins, world, dp)
    ds_config = deepspeed_config_for(args, dp)
    check_deepspeed_sections(ds_config, args.deepspeed_config)
    return plugins, ds_config, checkpoint_warnings(args)


def check_upstream(flags: list[str], world: int) -> None:
    """What the suite checks of an upstream script's flags before its model: the plugin sections
    and flags, tensor parallelism against the world size, and, for Megatron-DeepSpeed's
    ``--deepspeed_config``, DeepSpeed's own sections. The rest is the upstream parser's to check."""
    from megatron_ext.integration.upstream.hooks import with_plugin_args  # imports torch

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # as Megatron's parsers
    parser.add_argument("--deepspeed_config", dest="deepspeed_json", default=None)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    args, _ = with_plugin_args()(parser).parse_known_args(flags)
    tp = args.tensor_model_parallel_size
    if tp < 1 or world % tp:
        raise UsageError(
            f"--tensor-model-parallel-size {tp} does not divide the world size {world}: use a divisor of {world}"
        )
    args.deepspeed_config = args.deepspeed_config or args.deepspeed_json
    validate_against_world(plugin_config_from_args(args), world, world // tp)
    if args.deepspeed_json:
        check_deepspeed_sections(read_ds_config(args.deepspeed_json), args.deepspeed_json)


def main(argv: list[str] | None = None) -> int:
    """``--world-size N [--upstream] [--] FLAGS``: the job's checks on FLAGS for N ranks (with
    ``--upstream``, those of an upstream script's); exit 2 with one ``error:`` line on the first
    failure, 0 (warnings printed) otherwise."""
    from megatron_ext.trainer.cli import parse_args

    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext.trainer.checks",
        description="Run the main job's checks that need no process group and no model.",
    )
    parser.add_argument("--world-size", type=int, required=True, help="ranks the job would run")
    parser.add_argument("--upstream", action="store_true", help="FLAGS are an upstream pretrain_gpt.py's")
    ours, flags = parser.parse_known_args(argv)
    flags = [f for f in flags if f != "--"]
    if ours.world_size < 1:
        parser.exit(2, f"error: --world-size {ours.world_size}: give a positive number of ranks\n")
    try:
        if ours.upstream:
            check_upstream(flags, ours.world_size)
            return 0
        _, _, warnings = check_job(parse_args(flags), ours.world_size)
    except (UsageError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    # No device is used: on a login node DeepSpeed would warn at import that it found none.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.exit(main())
