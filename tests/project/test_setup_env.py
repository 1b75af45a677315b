"""scripts/setup_env.sh: a build lock left by a killed DeepSpeed op build is removed, so no later
process waits on it forever; a lock a build may still hold is kept."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept() -> None:
    extensions = ROOT / ".venv" / "torch_extensions"
    stale, fresh = extensions / "stale-lock-probe" / "lock", extensions / "fresh-lock-probe" / "lock"
    try:
        for lock in (stale, fresh):
            lock.parent.mkdir(parents=True, exist_ok=True)
            lock.touch()
        eleven_minutes_ago = time.time() - 11 * 60
        os.utime(stale, (eleven_minutes_ago, eleven_minutes_ago))
        proc = subprocess.run(
            ["bash", "scripts/setup_env.sh"], cwd=ROOT, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr
        assert not stale.exists() and f"removing a stale build lock: {stale}" in proc.stdout
        assert fresh.exists()
    finally:
        for lock in (stale, fresh):
            lock.unlink(missing_ok=True)
            lock.parent.rmdir()
