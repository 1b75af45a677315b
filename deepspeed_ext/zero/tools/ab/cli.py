"""A/B of ZeRO-3 variants on this cluster, in one job: what a user runs before switching.

    torchrun --nnodes N --nproc-per-node G -m deepspeed_ext.zero.bench --deepspeed-config ds.json \\
        --megatron-args scripts/presets/gpt-1.3b.args [--profile profile.json] [--json ab.json]

On the preset's model and the JSON's buckets, batch and dtype, each rank builds stock ZeRO-3, hpZ at
each valid partition size, ZeRO++ where its kernels build, and ours; their timed steps alternate, so
each ratio has a paired 95 % interval. Per variant: step time, TFLOPS, bytes per link class, peak
memory and, with --profile, the predicted step (docs/hierarchical_zero.md).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from typing import Any

from deepspeed_ext.zero.cost.workload import Model
from mdsp_base.shutdown import exit_without_teardown
from mdsp_base.topology import require_launcher

QUICK = Model(layers=2, hidden=64, heads=4, seq=32, vocab=1024)
"""The model without a preset, and with --quick."""
# Model field -> this command's flag
MODEL_FLAGS = {
    "layers": "--layers",
    "hidden": "--hidden",
    "heads": "--heads",
    "seq": "--seq-length",
    "vocab": "--vocab",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command's flags.

    Args:
        argv: the arguments; None: the process's.

    Returns:
        The flags, ``steps`` and ``warmup`` settled (``--quick``: 5 and 1).
    """
    parser = argparse.ArgumentParser(
        prog="python -m deepspeed_ext.zero.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--deepspeed-config",
        help="the job's DeepSpeed JSON (buckets, micro batch, accumulation, dtype, topology, hierarchical_zero)",
    )
    parser.add_argument(
        "--megatron-args", help="a Megatron flags file (scripts/presets/*.args) giving the model's shape"
    )
    for name, flag in MODEL_FLAGS.items():
        parser.add_argument(
            flag,
            type=int,
            dest=name,
            help=f"model {name} (overrides --megatron-args; default {getattr(QUICK, name)})",
        )
    parser.add_argument("--profile", help="a probe profile for ours (hierarchical_zero.profile)")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed optimizer steps per variant (default 10; 5 with --quick)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    parser.add_argument("--json", help="write one object per variant here (rank 0)")
    parser.add_argument("--plot", help="write a bar plot of the step times here (rank 0; PNG)")
    parser.add_argument(
        "--quantized-hops",
        action="store_true",
        help="also ours with int8 weight and int4 gradient hops across nodes (ZeRO++'s qwZ / qgZ widths)",
    )
    parser.add_argument(
        "--trace",
        metavar="DIR",
        help="one more step per variant after the timed ones, traced: DIR/<variant>.trace.json.gz "
        "(Chrome/Perfetto, every rank) and DIR/trace.md (what each step's time went to; rank 0)",
    )
    parser.add_argument(
        "--no-peak", action="store_true", help="CPU: skip the peak-memory pass (a second engine per variant)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny model, 1 warm-up and (unless --steps) 5 timed steps: a smoke test",
    )
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 5 if args.quick else 10
    if args.quick:
        args.warmup = 1
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"need --steps >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    return args


def model_shape(args: argparse.Namespace) -> Model:
    """The model the variants train.

    Args:
        args: the parsed flags.

    Returns:
        The preset's model (the quick one with --quick or without a preset) with the flags on top; a
        preset without a vocabulary gets Megatron's padded GPT-2 one (50304).
    """
    base = (
        Model.from_megatron_args(args.megatron_args, **{**asdict(QUICK), "vocab": 50304})
        if args.megatron_args and not args.quick
        else QUICK
    )
    return replace(
        base, **{name: getattr(args, name) for name in MODEL_FLAGS if getattr(args, name) is not None}
    )


def main(argv: list[str] | None = None, emulated: Any = None) -> list[dict]:
    """Run every variant; rank 0 prints the table and writes the JSON and plot.

    Args:
        argv: the arguments; None: the process's.
        emulated: an emulated device the steps run on (:class:`.engine.EmulatedDevice`).

    Returns:
        One row per variant.
    """
    args = parse_args(argv)
    require_launcher("deepspeed_ext.zero.bench", "--deepspeed-config ds.json")
    from deepspeed_ext.zero.tools.ab.run import run  # torch, DeepSpeed: after the flags are read

    return run(args, model_shape(args), emulated)


if __name__ == "__main__":
    main()
    exit_without_teardown()
