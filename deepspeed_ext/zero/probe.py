"""``python -m deepspeed_ext.zero.probe``: measures the collectives of every level and writes a profile (:mod:`deepspeed_ext.zero.tools.probe`). Kept at this path because it is the command users run."""

from deepspeed_ext.zero.tools.probe import main

if __name__ == "__main__":
    main()
