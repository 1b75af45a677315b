"""``benchmarks.zero.run`` on the compute stand-in: the fields of its result, not its speed.

A tiny model over loopback (no root needed) with ``--device mi250x`` and no dilation, so that the
run stays short; the emulated cluster's links play no part in which fields are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.zero.run import REPO_ROOT
from mdsp_base.paired import MIN_PAIRS

# A hang guard, not a speed target: the run takes about 50 s on 2 busy cores.
GUARD_S = 300


@pytest.mark.slow
def test_a_stand_in_run_writes_the_device_paired_ratios_and_nic_bytes(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "benchmarks.zero.run", "--network", "loopback", "--device", "mi250x",
        "--dilation", "1", "--micro", "1", "--out", str(tmp_path), "--timeout", str(GUARD_S),
        "--hidden", "64", "--layers", "1", "--warmup", "0", "--steps", str(MIN_PAIRS),
    ]  # fmt: skip
    subprocess.run(command, cwd=REPO_ROOT, check=True, timeout=GUARD_S, capture_output=True)
    summary = json.loads((tmp_path / "loopback_mi250x.json").read_text())["summary"]["1"]
    assert summary["device"]["device"] == "mi250x" and summary["device"]["dilation"] == 1.0
    assert summary["args"]["device"] == "mi250x"
    rows = summary["rows"]
    for row in rows.values():
        # memory is not read on a stand-in; the bytes per NIC are computed from the geometry
        assert row["held_bytes"] is None and row["peak_bytes"] is None
        assert row["nic"]["nic_mib_per_step"] > 0 and row["nic"]["package_link_mib_per_step"] > 0
        assert row["device_s"] > 0
    pairs = {(p["variant"], p["baseline"]): p for p in summary["paired"]}
    assert ("ours (package)", "zero++ hpZ(2)") in pairs and ("ours (node)", "zero++ hpZ(4)") in pairs
    assert {v for v, b in pairs if b == "zero3"} == set(rows) - {"zero3"}
    for p in pairs.values():
        assert p["metric"] == "step" and p["pairs"] == MIN_PAIRS
        assert p["ci95"][0] <= p["ratio"] <= p["ci95"][1]
    text = (tmp_path / "loopback_mi250x.md").read_text()
    assert "step ratio [95 % interval]" in text and "not measured" in text
