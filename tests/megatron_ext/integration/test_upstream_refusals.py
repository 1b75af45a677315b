"""Upstream runs refused at start-up end as the main job's refusals do: one ``error:`` line from the
first rank of each node, exit status 2 on every rank, no traceback, before the process group (so
before the dataset helper, the model and DeepSpeed).

The patched trees' ``pretrain_gpt.py`` run through ``python -m megatron_ext.launch`` with flags the
hooks refuse: Megatron-DeepSpeed at TP=2 with ``--flash-overlap`` but not ``--sequence-parallel`` (2
ranks), Megatron-LM with ``--flash-overlap`` but not the Flash-Overlap ``--spec`` (1 rank). Each rank
is its own process with torchrun's variables and its own output, so that every rank's exit status
and what each printed are seen (torchrun and the warm launcher end the other ranks at the first
exit). Both jobs start at once: the imports are most of their time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from multirank import free_port
from multirank.warm import torchrun_env
from tests.helpers.upstream import SetupError, Tree, prepare
from tests.helpers.upstream_warm import rank_env
from tests.megatron_ext.integration.test_upstream_training import (
    COMMON,
    DEEPSPEED,
    DS_CONFIG,
    MEGATRON_LM,
    RUN_TIMEOUT_S,
    TP2,
)

pytestmark = pytest.mark.upstream

# job -> (ranks, the flags the hooks refuse, the one line the job prints)
REFUSED = {
    "megatron-deepspeed": (
        2,
        [*TP2, "--flash-overlap"],
        "error: flash_overlap on Megatron-DeepSpeed: its TP linears overlap the sequence-parallel "
        "all-gather/reduce-scatter: pass --sequence-parallel (TP=2) (or drop --flash-overlap)",
    ),
    "megatron-lm": (
        1,
        ["--flash-overlap"],
        "error: flash_overlap is enabled but --spec is None: pass --spec "
        "megatron_ext.integration.upstream.megatron_lm flash_overlap_layer_spec so that Megatron-LM "
        "builds the Flash-Overlap layers",
    ),
}
# printed once the process group exists: the refusal must come before
AFTER_THE_GROUP = "> compiling dataset index builder"


@pytest.fixture(scope="module")
def trees() -> dict[str, Tree]:
    try:
        return prepare()
    except SetupError as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"upstream refusal tests cannot run in CI: {exc}")
        pytest.skip(f"upstream refusal tests need: {exc}")


def _argv(kind: str, tree: Tree, work: Path, flags: list[str]) -> list[str]:
    """The launcher, the patched tree's pretrain_gpt.py, the training tests' flags and ``flags``."""
    argv = [sys.executable, "-m", "megatron_ext.launch", str(tree.patched / "pretrain_gpt.py"), *COMMON]
    argv += ["--data-path", tree.data, "--data-cache-path", str(work / f"index-{kind}")]
    if kind == "megatron-lm":
        return argv + MEGATRON_LM + flags
    config = work / "ds_config.json"
    config.write_text(json.dumps({**DS_CONFIG, "zero_optimization": {"stage": 1}}))
    return argv + DEEPSPEED + ["--micro-batch-size", "1", "--deepspeed_config", str(config)] + flags


def test_upstream_refusals_are_one_line_and_exit_2(trees: dict[str, Tree], tmp_path: Path) -> None:
    ranks = {}
    for kind, (world, flags, _) in REFUSED.items():
        argv, port = _argv(kind, trees[kind], tmp_path, flags), free_port()
        ranks[kind] = [
            subprocess.Popen(
                argv,
                cwd=tmp_path,
                env={**rank_env(), **torchrun_env(rank, 1, world, port)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(world)
        ]
    try:
        ends = {
            kind: [(*rank.communicate(timeout=RUN_TIMEOUT_S), rank.returncode) for rank in procs]
            for kind, procs in ranks.items()
        }
    finally:
        for procs in ranks.values():
            for rank in procs:
                rank.kill()
    for kind, (_, _, line) in REFUSED.items():
        stdout = "".join(out for out, _, _ in ends[kind])
        stderr = "".join(err for _, err, _ in ends[kind])
        assert [code for _, _, code in ends[kind]] == [2] * len(ends[kind]), f"{kind}:\n{stderr[-4000:]}"
        assert [found for found in stderr.splitlines() if found.startswith("error:")] == [line], stderr
        assert "Traceback" not in stderr and AFTER_THE_GROUP not in stdout, (stdout[-2000:], stderr)
        assert line in ends[kind][0][1].splitlines(), "the node's first rank prints it"
