"""``python -m deepspeed_ext.zero.plan``: recommends a configuration from the cost model.

The command users run; its code is :mod:`deepspeed_ext.zero.tools.recommend`."""

import os

from deepspeed_ext.zero.tools.recommend import main
from mdsp_base.shutdown import exit_without_teardown

if __name__ == "__main__":
    # No device is used: DeepSpeed, imported to check the JSON, would warn that it found none.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
    exit_without_teardown()
