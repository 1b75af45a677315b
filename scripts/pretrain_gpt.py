"""Pretrain a megatron-core GPT under the DeepSpeed engine, with the suite's plugins when enabled.

One process per rank (torchrun, srun, or the scripts in scripts/); ``--help`` lists the flags. The
job itself is the ``megatron_ext.trainer`` package.
"""

from mdsp_base.installer import Installer
from mdsp_base.shutdown import exit_without_teardown
from megatron_ext.trainer.cli import parse_args


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, then run the job: ``--help`` and flag errors answer before torch,
    megatron-core and DeepSpeed load, and the job's warnings are collected from their first import
    on (:mod:`megatron_ext.trainer.notices`)."""
    args = parse_args(argv)
    with Installer() as installer:
        from megatron_ext.trainer.notices import quiet

        notices = quiet(installer)
        from megatron_ext.trainer.main import run

        return run(args, installer, notices)


if __name__ == "__main__":
    exit_without_teardown(main())
