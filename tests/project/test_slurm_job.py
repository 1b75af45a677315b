"""End to end through a real Slurm: submit scripts/slurm/local.sbatch, wait, check the training log.

Needs a running Slurm with at least one responding node (CI: ``.ci/slurm_cluster.sh start``);
skipped when ``sbatch`` is missing or ``sinfo`` lists no responding node.

Knobs (environment): SLURM_TEST_NTASKS (ranks, default 4), SLURM_TEST_TIMEOUT (seconds to wait for
the job, default 1200), SLURM_TEST_PENDING_TIMEOUT (seconds it may stay queued, default 300),
SLURM_TEST_PARTITION (default: the cluster's default partition).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.slurm import LAUNCHER_PARAMS, LOCAL_SBATCH, wait_for_job

ROOT = Path(__file__).resolve().parents[2]
# Megatron's iteration line, as the job prints it: the loss is the line's "lm loss" field
ITERATION_RE = re.compile(r"iteration\s+(\d+)\s*/\s*\d+\s*\|.*? lm loss: ([0-9.eE+-]+|nan|inf) \|")
pytestmark = pytest.mark.slurm


def _losses(log: str) -> list[tuple[int, float]]:
    """(iteration, loss) in iteration order; the first report of each iteration wins."""
    seen: dict[int, float] = {}
    for m in ITERATION_RE.finditer(log):
        seen.setdefault(int(m.group(1)), float(m.group(2)))
    return sorted(seen.items())


def test_parse_losses() -> None:
    log = (
        " [2026-01-01 00:00:00.000000] iteration        1/      20 | consumed samples:            4 | "
        "learning rate: 1.000000E-04 | global batch size:     4 | lm loss: 9.123400E+00 | tokens/s: 1234.5 |\n"
        "0:  [2026-01-01 00:00:01.000000] iteration        2/      20 | consumed samples:            8 | "
        "lm loss: 8.500000E+00 |\n"
        " [2026-01-01 00:00:01.000000] iteration        2/      20 | consumed samples:            8 | "
        "lm loss: 7.000000E+00 | duplicate from another rank |\n"
        " [2026-01-01 00:00:02.000000] iteration        3/      20 | lm loss: 6.250000E+00 |\n"
    )
    assert _losses(log) == [(1, 9.1234), (2, 8.5), (3, 6.25)]


def test_local_sbatch_trains(slurm: None, tmp_path: Path) -> None:
    ntasks = int(os.environ.get("SLURM_TEST_NTASKS", "4"))
    timeout = float(os.environ.get("SLURM_TEST_TIMEOUT", "1200"))
    log_file = tmp_path / "local-job.out"
    cmd = [
        "sbatch",
        "--parsable",
        f"--ntasks={ntasks}",
        "--nodes=1",
        f"--output={log_file}",
        f"--chdir={ROOT}",
        "--job-name=test-slurm-local",
        # The job's own limit, a little above ours, so a hung job cannot outlive the test by much.
        f"--time={int(timeout // 60) + 2}",
    ]
    if os.environ.get("SLURM_TEST_PARTITION"):
        cmd.append(f"--partition={os.environ['SLURM_TEST_PARTITION']}")
    cmd.append(str(LOCAL_SBATCH))
    # The caller's launcher parameters must not leak into the job (sbatch exports the environment).
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_PARAMS}
    # 5 of the preset's 20 iterations: enough for the loss to fall, and a quarter of the job's training
    env.update(
        MODEL="tiny-cpu",
        CONFIG="ds_cpu_local.json",
        EXTRA_ARGS="--train-iters 5",
        DRY_RUN="0",
        TRAIN_PYTHON=sys.executable,
    )
    sub = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert sub.returncode == 0, f"sbatch failed ({sub.returncode}): {sub.stderr.strip()}"
    job_id = sub.stdout.strip().split(";")[0]
    assert job_id.isdigit(), f"unexpected sbatch output: {sub.stdout!r}"

    state, code, problem = wait_for_job(
        job_id, timeout, float(os.environ.get("SLURM_TEST_PENDING_TIMEOUT", "300"))
    )
    log = log_file.read_text(errors="replace") if log_file.exists() else "<no log file>"
    tail = "\n".join(log.splitlines()[-60:])
    assert not problem, f"job {job_id}: {problem}; log {log_file} ends with:\n{tail}"
    assert state == "COMPLETED" and code.startswith("0:"), (
        f"job {job_id} ended {state} with exit code {code}; log {log_file} ends with:\n{tail}"
    )

    losses = _losses(log)
    assert len(losses) >= 2, f"fewer than 2 'iteration N/M | ... | lm loss: X |' lines in {log_file}:\n{tail}"
    (first_it, first), (last_it, last) = losses[0], losses[-1]
    assert last < first, (
        f"loss did not fall: iteration {first_it} loss {first}, iteration {last_it} loss {last}"
    )
