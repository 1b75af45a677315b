"""``python -m megatron_ext.launch``: runs an upstream Megatron-LM or Megatron-DeepSpeed script with the plugins.

The command users run; its code is :mod:`megatron_ext.integration.launch`."""

import sys

from mdsp_base.shutdown import exit_without_teardown
from megatron_ext.integration.launch import main
from megatron_ext.integration.refusal import EXIT_REFUSED

if __name__ == "__main__":
    code = main()
    if code == EXIT_REFUSED:
        # A refused rank leaves at once: torchrun and srun end a job's other ranks when the first one
        # exits, and a rank still tearing its modules down would then report their signal, not 2.
        # The script was stopped at start-up, before it wrote anything a teardown would flush.
        exit_without_teardown(code)
    sys.exit(code)
