"""The main job on the H100 stand-in beside its GPU record: the report's fields on a small model
(its figures are not checked, only that each is there and consistent)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.device import H100
from benchmarks.device.main_job import PREDICTION, TOLERANCE, markdown
from tests.helpers.main_job import ROOT, SMALL, job_env

RUN = f"""
import json
from benchmarks.device.main_job import measure
print("ROWS " + json.dumps(measure({[*SMALL, "--bf16"]!r}, ["no plugins"], iters=2, warmup=1)))
"""


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    """Two iterations of the small model, its own process (the job makes process-wide changes)."""
    proc = subprocess.run(
        [sys.executable, "-c", RUN], capture_output=True, text=True, cwd=ROOT, env=job_env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("ROWS "))
    return json.loads(line.removeprefix("ROWS "))


def test_the_stand_in_run_reports_its_rate_charges_and_the_record_beside_it(rows):
    (row,) = rows
    s = row["stand_in"]
    lo, med, hi = s["tokens_per_s"]
    assert 0 < lo <= med <= hi
    assert s["device_busy_s_by_kind"]["matmul"] > 0 and s["device_busy_s_by_kind"]["memory"] > 0
    assert s["device_busy_s"] == pytest.approx(sum(s["device_busy_s_by_kind"].values()))
    assert s["device_idle_s"] == pytest.approx(s["iteration_s"] - s["device_busy_s"])
    assert s["host_cpu_s"] > 0 and s["device_ops"] > 0
    assert s["skipped_steps"] == 0 and len(s["losses"]) == 2  # values read as zeros steered nothing
    assert row["device"]["device"] == "h100" and row["device"]["gemm_efficiency"] == H100.gemm_efficiency
    assert row["device"]["dilation"] == 1.0 and row["device"]["contention"] == 0.0


def test_the_record_is_the_median_of_the_measured_launches_and_the_error_is_against_it(rows):
    record, comparison = rows[0]["record"], rows[0]["comparison"]
    assert len(record["launch_medians"]) == 4  # two launches in each of the two GPU result files
    assert record["min"] <= record["median"] <= record["max"]
    error = rows[0]["stand_in"]["tokens_per_s"][1] / record["median"] - 1
    assert comparison["error"] == pytest.approx(error)
    assert comparison["within_tolerance"] == (abs(error) <= TOLERANCE)


def test_the_report_labels_the_prediction_as_computed(rows):
    meta = {
        "model": "small",
        "iters": 2,
        "warmup": 1,
        "command": "test",
        "prediction": PREDICTION,
        "load_avg": [],
    }
    text = markdown(meta, rows)
    assert "stand-in, computed from the device table" in text and "no plugins" in text
