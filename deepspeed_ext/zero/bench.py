"""``python -m deepspeed_ext.zero.bench``: the A/B command (stock ZeRO-3, hpZ, ZeRO++ and ours, side by side).

The command users run; its code is :mod:`deepspeed_ext.zero.tools.ab.cli`."""

from deepspeed_ext.zero.tools.ab.cli import main
from mdsp_base.shutdown import exit_without_teardown

if __name__ == "__main__":
    main()
    exit_without_teardown()
