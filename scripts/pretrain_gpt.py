"""Pretrain a megatron-core GPT under the DeepSpeed engine, with the suite's plugins when enabled.

One process per rank (torchrun, srun, or the scripts in scripts/); ``--help`` lists the flags. The
job itself is the ``trainer`` package.
"""

import sys

from trainer.cli import parse_args

if __name__ == "__main__":
    args = parse_args()  # --help and flag errors answer here, before torch, megatron-core and DeepSpeed load
    from trainer.main import run

    sys.exit(run(args))
