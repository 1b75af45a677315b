"""The main job as the tests launch it: its small model as flags (its dropout is 0: runs are
deterministic), the environment its ranks start from, and the ``main_job_warm`` fixture."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from multirank.warm import WarmLauncher

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "pretrain_gpt.py")
SMALL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--lr",
    "3e-3",
]
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def job_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's rank variables, one thread per rank, the tests' tree
    first on the path, and ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in RANK_VARIABLES and not k.startswith(("SLURM_", "TORCHELASTIC_", "GROUP_"))
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


@pytest.fixture(scope="session")
def main_job_warm() -> Iterator[WarmLauncher]:
    """Ranks of the main job forked from one interpreter that has imported it (the script imports it
    first thing), for every test that needs the job's losses rather than its start."""
    with WarmLauncher(job_env(), preload=["megatron_ext.trainer.main"]) as launcher:
        yield launcher
