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
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCAL_SBATCH = ROOT / "scripts" / "slurm" / "local.sbatch"
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "REVOKED",
    "SPECIAL_EXIT",
}
LAUNCHER_PARAMS = {
    "NODES",
    "TASKS_PER_NODE",
    "MODEL",
    "CONFIG",
    "DATA_PATH",
    "CHECKPOINT_DIR",
    "EXTRA_ARGS",
    "DRY_RUN",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SRUN_ARGS",
    "TRAIN_SCRIPT",
    "TRAIN_PYTHON",
    "ENV_SCRIPT",
    "REPO_DIR",
    "UPSTREAM_DIR",
}
ITERATION_RE = re.compile(r"iteration\s+(\d+)\s*/\s*\d+\s*\|\s*loss\s+([0-9.eE+-]+|nan|inf)")

pytestmark = pytest.mark.slurm


def _run(cmd: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def _responding_nodes() -> list[str]:
    """Nodes ``sinfo -r`` lists (responding), whatever their state."""
    try:
        out = _run(["sinfo", "-h", "-r", "-N", "-o", "%N"], timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.split() if out.returncode == 0 else []


@pytest.fixture(scope="module")
def slurm() -> None:
    if shutil.which("sbatch") is None:
        pytest.skip("sbatch not on PATH (start a test cluster with: .ci/slurm_cluster.sh start)")
    if not _responding_nodes():
        pytest.skip(
            "sinfo shows no responding Slurm node (start a test cluster with: .ci/slurm_cluster.sh start)"
        )


def _job_state(job_id: str) -> tuple[str, str, str]:
    """(state, exit code 'rc:signal', reason) from scontrol, else sacct; empty strings if unknown."""
    try:
        out = _run(["scontrol", "show", "job", "-o", job_id])
        if out.returncode == 0 and out.stdout.strip():
            fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
            return fields.get("JobState", ""), fields.get("ExitCode", ""), fields.get("Reason", "")
        out = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"])
    except (OSError, subprocess.TimeoutExpired):
        return "", "", ""
    if out.returncode == 0 and out.stdout.strip():
        state, _, code = out.stdout.splitlines()[0].partition("|")
        return (state.split() or [""])[0], code, ""
    return "", "", ""


def _wait(job_id: str, timeout: float, pending_timeout: float) -> tuple[str, str, str]:
    """Poll until the job ends: (state, exit code, problem). On a time limit the job is cancelled
    and problem says why; it is empty when the job reached a final state."""
    start = time.monotonic()
    unknown_since = pending_since = None
    state = code = reason = ""
    while time.monotonic() - start < timeout:
        state, code, reason = _job_state(job_id)
        now = time.monotonic()
        if state in TERMINAL_STATES:
            return state, code, ""
        unknown_since = (unknown_since or now) if not state else None
        pending_since = (pending_since or now) if state == "PENDING" else None
        if unknown_since is not None and now - unknown_since > 60:
            return state, code, "neither scontrol nor sacct knows the job any more"
        if pending_since is not None and now - pending_since > pending_timeout:
            _run(["scancel", job_id])
            return (
                state,
                code,
                (
                    f"still PENDING after {pending_timeout:.0f}s (Reason={reason}), cancelled; check `sinfo` and "
                    "`scontrol show node` (a drained or too small node?)"
                ),
            )
        time.sleep(0.5)  # squeue/sacct are cheap; a job's end is seen within half a second
    _run(["scancel", job_id])
    return state, code, f"not finished after {timeout:.0f}s (last state {state or 'unknown'}), cancelled"


def _losses(log: str) -> list[tuple[int, float]]:
    """(iteration, loss) in iteration order; the first report of each iteration wins."""
    seen: dict[int, float] = {}
    for m in ITERATION_RE.finditer(log):
        seen.setdefault(int(m.group(1)), float(m.group(2)))
    return sorted(seen.items())


def test_parse_losses() -> None:
    log = (
        "iteration 1/20 | loss 9.1234 | lr 1.000e-04 | tokens/s 1234.5\n"
        "0: iteration 2/20 | loss 8.5 | lr 1.000e-04 | tokens/s 1300.0\n"
        "iteration 2/20 | loss 7.0 | duplicate from another rank\n"
        "iteration 3/20 | loss 6.25e+00 | lr 1.000e-04\n"
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
    env.update(MODEL="tiny-cpu", CONFIG="ds_cpu_local.json", DRY_RUN="0", TRAIN_PYTHON=sys.executable)
    sub = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert sub.returncode == 0, f"sbatch failed ({sub.returncode}): {sub.stderr.strip()}"
    job_id = sub.stdout.strip().split(";")[0]
    assert job_id.isdigit(), f"unexpected sbatch output: {sub.stdout!r}"

    state, code, problem = _wait(job_id, timeout, float(os.environ.get("SLURM_TEST_PENDING_TIMEOUT", "300")))
    log = log_file.read_text(errors="replace") if log_file.exists() else "<no log file>"
    tail = "\n".join(log.splitlines()[-60:])
    assert not problem, f"job {job_id}: {problem}; log {log_file} ends with:\n{tail}"
    assert state == "COMPLETED" and code.startswith("0:"), (
        f"job {job_id} ended {state} with exit code {code}; log {log_file} ends with:\n{tail}"
    )

    losses = _losses(log)
    assert len(losses) >= 2, f"fewer than 2 'iteration N/M | loss X' lines in {log_file}:\n{tail}"
    (first_it, first), (last_it, last) = losses[0], losses[-1]
    assert last < first, (
        f"loss did not fall: iteration {first_it} loss {first}, iteration {last_it} loss {last}"
    )
