"""Run benchmark ranks as plain local processes over 127.0.0.1: the unshaped twin of
:class:`benchmarks.cluster.launch.EmulatedCluster`, with the same result protocol (each rank calls
``write_result``; its value comes back in rank order)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def launch_loopback(
    argv: list[str],
    world_size: int,
    timeout: float,
    env: dict[str, str] | None = None,
    ranks_per_node: int | None = None,
) -> list[Any]:
    """Start ``python argv`` once per rank with torch.distributed's variables set; every rank gets
    ``timeout`` seconds, then all are killed and the call raises."""
    per_node = ranks_per_node or world_size
    with tempfile.TemporaryDirectory(prefix="bench-loopback-") as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        base = {
            **os.environ,
            **(env or {}),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(per_node),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH")))),
        }
        procs = [
            subprocess.Popen(
                [sys.executable, *argv],
                env={
                    **base,
                    "RANK": str(r),
                    "LOCAL_RANK": str(r % per_node),
                    "EMU_RESULT_FILE": f"{tmp}/{r}.json",
                },
            )
            for r in range(world_size)
        ]
        try:
            codes = [p.wait(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(codes):
            raise RuntimeError(f"benchmark ranks exited with {codes}: see their output above")
        return [json.loads(Path(f"{tmp}/{r}.json").read_text()) for r in range(world_size)]
