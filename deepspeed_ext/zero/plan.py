"""``python -m deepspeed_ext.zero.plan``: recommends a configuration from the cost model (:mod:`deepspeed_ext.zero.tools.recommend`). Kept at this path because it is the command users run."""

from deepspeed_ext.zero.tools.recommend import main

if __name__ == "__main__":
    main()
