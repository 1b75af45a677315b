"""``benchmarks.run_all``: every entry point under ``benchmarks/`` runs or is left out with a reason,
the committed summary is the one the committed result files give, and a quick loopback run completes.

A whole ``--network loopback --quick`` run takes many minutes on 2 cores (the ZeRO, Flash-Overlap and
data-loader steps launch 2-8 ranks several times), too long for the suite: the run here is limited
(``--only``) to the cheapest steps, one of which launches its ranks through the shared launcher, and
the summary step is covered on every committed result file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import run_all
from benchmarks.catalog import entry_points, left_out, steps
from benchmarks.summary_plot import ResultFormatError, plot_summary

# A hang guard, not a speed target: the run takes about 45 s on 2 idle cores.
RUN_GUARD_S = 480
CHEAPEST = ["studies.zero.project", "studies.flash_overlap.activation_memory", "data_loader.sampler_setup"]


@pytest.mark.parametrize("network", ["cluster", "loopback"])
@pytest.mark.parametrize("quick", [False, True])
def test_every_entry_point_runs_or_says_why(network: str, quick: bool) -> None:
    ran = {s.module for s in steps(network, quick)}
    why = left_out(network)
    assert not ran & set(why)
    assert sorted(ran | set(why)) == entry_points()
    assert all(why.values())


def _committed_results(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    shutil.copytree(run_all.RESULTS, results, ignore=shutil.ignore_patterns("raw"))
    return results


def test_committed_summary_matches_the_committed_results(tmp_path: Path) -> None:
    results = _committed_results(tmp_path)
    assert run_all.main(["--network", "cluster", "--summary-only", "--results", str(results)]) == 0
    text = (results / "summary.md").read_text()
    for step in steps("cluster", quick=False):
        assert f"## {step.title}" in text
    for module in left_out("cluster"):
        assert f"| `{module}` |" in text
    assert (results / "summary.png").stat().st_size > 10_000
    assert text == (run_all.RESULTS / "summary.md").read_text(), (
        "benchmarks/results/summary.md is stale: python -m benchmarks.run_all --network cluster --summary-only"
    )


def test_plot_names_the_file_and_key_of_an_old_format(tmp_path: Path) -> None:
    (tmp_path / "data_loader").mkdir()
    (tmp_path / "data_loader" / "node.json").write_text(json.dumps({"rows": [], "settings": {"ranks": 8}}))
    with pytest.raises(ResultFormatError, match=r"data_loader/node\.json: no key 'layouts'"):
        plot_summary(tmp_path, "loopback")


@pytest.mark.slow
def test_quick_loopback_run_of_the_cheapest_steps(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run_all", "--network", "loopback", "--quick"]
        + ["--only", *CHEAPEST, "--results", str(tmp_path)],
        cwd=run_all.REPO,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=RUN_GUARD_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The plan names every entry point it does not run, with the reason.
    assert "benchmarks.studies.cluster.calibrate: measures the emulated cluster's shaped links" in proc.stdout
    assert "benchmarks.zero.run: not in `--only`" in proc.stdout
    text = (tmp_path / "summary.md").read_text()
    assert text.count(": ran in ") == len(CHEAPEST)
    for name in ("zero/projection_tp4_ga1", "flash_overlap/activation_memory_tp2_h64_s64"):
        assert (tmp_path / f"{name}.md").read_text().strip() in text
    assert '"mode": "arrays"' in (tmp_path / "data_loader" / "sampler_setup.md").read_text()
    # None of these steps writes a file the plot reads; test_committed_summary_... draws every panel.
    assert "no result file to plot" in proc.stdout and not (tmp_path / "summary.png").exists()
