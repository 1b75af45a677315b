"""``python -m deepspeed_ext.zero.probe``: measures the collectives of every level and writes a profile.

The command users run; its code is :mod:`deepspeed_ext.zero.tools.probe`."""

from deepspeed_ext.zero.tools.probe import main
from mdsp_base.shutdown import exit_without_teardown

if __name__ == "__main__":
    main()
    exit_without_teardown()
