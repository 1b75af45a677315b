"""The main job as the tests launch it: its small model as flags (its dropout is 0: runs are
deterministic), the environment its ranks start from, and the ``main_job_warm`` fixture (its server
started as the session starts: :mod:`tests.helpers.early`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from multirank.warm import WarmLauncher
from tests.helpers.early import start_early, take

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
# The module megatron_ext.trainer.data.build_tokenizer imports its tokenizer from
NULL_TOKENIZER = "megatron.core.tokenizers.text.libraries.null_tokenizer"
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


def _main_job_launcher() -> WarmLauncher:
    """Ranks of the main job forked from one interpreter that has imported it (the script imports it
    first thing), and Megatron's NullTokenizer: a rank imports it when it builds its tokenizer, and
    its package imports Hugging Face's transformers, 1.0 s of CPU per rank."""
    return WarmLauncher(job_env(), preload=["megatron_ext.trainer.main", NULL_TOKENIZER])


def pytest_sessionstart(session: pytest.Session) -> None:
    start_early(session.config, "main_job_warm", _main_job_launcher)


@pytest.fixture(scope="session")
def main_job_warm(request: pytest.FixtureRequest) -> Iterator[WarmLauncher]:
    """The main job's ranks forked warm, for every test that needs the job's losses rather than
    its start."""
    with take(request.config, "main_job_warm", _main_job_launcher) as launcher:
        yield launcher


@pytest.fixture
def pretrain_main(lone_rank: Path) -> Callable[..., int]:
    """The main job's ``main(argv)`` in this process, as a lone rank with a clean environment, on
    the small model and ``flags``."""
    from scripts.pretrain_gpt import main

    return lambda *flags: main([*SMALL, "--data-cache-path", str(lone_rank / "data"), *flags])
