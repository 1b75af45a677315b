"""Slurm for the tests that submit real jobs: the ``slurm`` fixture (skips without a responding
cluster), the launcher's documented parameters and a bounded wait on a job."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def wait_for_job(job_id: str, timeout: float, pending_timeout: float) -> tuple[str, str, str]:
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
