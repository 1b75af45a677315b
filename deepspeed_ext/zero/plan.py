"""``python -m deepspeed_ext.zero.plan``: recommends a configuration from the cost model.

The command users run; its code is :mod:`deepspeed_ext.zero.tools.recommend`."""

from deepspeed_ext.zero.tools.recommend import main
from mdsp_base.shutdown import exit_without_teardown

if __name__ == "__main__":
    main()
    exit_without_teardown()
