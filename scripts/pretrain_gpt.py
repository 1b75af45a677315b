"""Pretrain a megatron-core GPT under the DeepSpeed engine, with the suite's plugins when enabled.

One process per rank (torchrun, srun, or the scripts in scripts/); ``--help`` lists the flags. The
job itself is the ``trainer`` package.
"""

import sys

from trainer.main import main

if __name__ == "__main__":
    sys.exit(main())
