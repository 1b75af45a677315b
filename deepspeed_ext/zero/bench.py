"""``python -m deepspeed_ext.zero.bench``: the A/B command (stock ZeRO-3, hpZ, ZeRO++ and ours, side by side) (:mod:`deepspeed_ext.zero.tools.ab.cli`). Kept at this path because it is the command users run."""

from deepspeed_ext.zero.tools.ab.cli import main

if __name__ == "__main__":
    main()
