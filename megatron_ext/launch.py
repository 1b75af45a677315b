"""``python -m megatron_ext.launch``: runs an upstream Megatron-LM or Megatron-DeepSpeed script with the plugins (:mod:`megatron_ext.integration.launch`). Kept at this path because it is the command users run."""

import sys

from megatron_ext.integration.launch import main

if __name__ == "__main__":
    sys.exit(main())
