"""Measure this cluster's collectives per link class and write a profile for hierarchical ZeRO.

    torchrun --nnodes N --nproc-per-node G -m deepspeed_ext.zero.probe --out profile.json

Every rank takes part; each link class's groups run at once, as the job's hops do. It times the
library's collectives per level and size (across nodes also the point-to-point algorithm) and the
stock baselines on the whole job's group. Point a job at the result with
``hierarchical_zero.profile``. What it times and when it stops: docs/hierarchical_zero_modules.md."""

from __future__ import annotations

import argparse

from mdsp_base.shutdown import exit_without_teardown
from mdsp_base.topology import require_launcher


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and each flag's default after its help (flags without one say
    in their help what happens when they are left out)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.required:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m deepspeed_ext.zero.probe",
        description=__doc__,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "--out", required=True, help="where rank 0 writes the profile, a JSON file (required)"
    )
    parser.add_argument(
        "--deepspeed-config",
        help="the job's DeepSpeed JSON: its topology section is used (default: none; the topology is detected)",
    )
    parser.add_argument("--ranks-per-node", type=int, help="topology.ranks_per_node (default: detected)")
    parser.add_argument(
        "--ranks-per-package", type=int, help="topology.ranks_per_package (default: detected)"
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        help="message sizes in bytes (default: a 4x sweep from --smallest to --largest)",
    )
    parser.add_argument("--smallest", type=int, default=4096, help="first size of the sweep, in bytes")
    parser.add_argument(
        "--largest", type=int, default=256 * 2**20, help="last size of the sweep, in bytes (256 MiB)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per size, after one warm-up")
    parser.add_argument(
        "--max-call-s",
        type=float,
        default=0.5,
        help="a collective stops growing once a call takes this many seconds",
    )
    parser.add_argument(
        "--budget-s", type=float, default=90.0, help="no new size starts after this many seconds"
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        help="element type of the messages (default: bfloat16 on GPUs, float32 on CPU)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.smallest < 1 or args.largest < args.smallest:
        parser.error(
            f"need --repeats >= 1 and 1 <= --smallest <= --largest, got {args.repeats}, {args.smallest}, {args.largest}"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    require_launcher("deepspeed_ext.zero.probe", "--out profile.json")
    from deepspeed_ext.zero.tools.probe_run import run  # torch and the collectives: after the flags are read

    run(args)


if __name__ == "__main__":
    main()
    exit_without_teardown()
