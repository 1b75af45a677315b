"""``python -m megatron_ext.launch``: runs an upstream Megatron-LM or Megatron-DeepSpeed script with the plugins.

The command users run; its code is :mod:`megatron_ext.integration.launch`."""

import sys

from megatron_ext.integration.launch import main

if __name__ == "__main__":
    sys.exit(main())
