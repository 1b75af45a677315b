"""Run every plugin's benchmark against its baseline and collect the results in one place.

    sudo .venv/bin/python -m benchmarks.run_all            # emulated cluster (needs root, ip, tc)
    .venv/bin/python -m benchmarks.run_all --network loopback --quick

Each step is one benchmark module run as a subprocess (each prints its own progress); this script
prints which step runs and how long the earlier ones took, then writes
``benchmarks/results/summary.md`` (every step's markdown table, in order) and
``benchmarks/results/summary.png`` (a panel per benchmark; Flash-Overlap draws its own timelines). A step that fails is reported and
the others still run; the exit code is non-zero if any failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.summary_plot import plot_summary

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


@dataclass(frozen=True)
class Step:
    """One benchmark run and the markdown table it leaves behind."""

    title: str
    """Heading of the step in the summary."""
    argv: list[str]
    """Arguments after ``python``."""
    table: Path
    """The markdown file the step writes."""


def steps(network: str, quick: bool) -> list[Step]:
    cluster = network == "cluster"
    loader_args = ["--steps", "20", "--repeats", "2", "--tokens", "8000000"] if quick else []
    flash_tp = ["--tp", "2"] if quick else ["--tp", "2", "4"]
    out = [
        Step(
            "Frontier projection of hierarchical ZeRO (computed, 20B preset at TP=4)",
            ["-m", "benchmarks.zero.project", "--tp", "4", "--name", "projection_tp4_ga1"],
            RESULTS / "zero" / "projection_tp4_ga1.md",
        ),
        Step(
            f"Hierarchical ZeRO vs ZeRO-3 and ZeRO++ hpZ ({network})",
            ["-m", "benchmarks.zero.run", "--network", network, "--launches", "1" if quick else "3"],
            RESULTS / "zero" / f"{network}.md",
        ),
        Step(
            f"Flash-Overlap MLP and layer, forward + backward, vs megatron-core and 4-chunk slicing ({network})",
            ["-m", "benchmarks.flash_overlap.run", "--network", network, *flash_tp],
            RESULTS
            / "flash_overlap"
            / (f"cluster400_tp{flash_tp[-1]}.md" if cluster else f"loopback_tp{flash_tp[-1]}.md"),
        ),
        Step(
            "Shared-memory node loader vs Megatron's DataLoader path with 0/1/2 workers (one node, 4 ranks)",
            ["-m", "benchmarks.data_loader.run", *loader_args],
            RESULTS / "data_loader" / "results.md",
        ),
    ]
    if cluster:
        calibration = RESULTS / "cluster" / "calibration.json"
        out.insert(
            0,
            Step(
                "Emulated cluster calibration (frontier profile)",
                ["-m", "benchmarks.cluster.calibrate", "--profile", "frontier", "--json", str(calibration)],
                calibration,
            ),
        )
    return out


def run(step: Step, index: int, total: int, started: float) -> bool:
    print(f"[{index}/{total}] {step.title}  (elapsed {time.monotonic() - started:.0f} s)", flush=True)
    step.table.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, *step.argv], cwd=REPO)
    if proc.returncode != 0:
        print(f"[{index}/{total}] FAILED with exit code {proc.returncode}: {' '.join(step.argv)}", flush=True)
    return proc.returncode == 0


def _table_text(step: Step) -> str:
    if not step.table.exists():
        return "_no result: the step failed or wrote nothing_"
    if step.table.suffix == ".json":
        rows = json.loads(step.table.read_text())
        rows = rows.get("links", rows) if isinstance(rows, dict) else rows
        lines = ["| link class | configured Mbit/s | measured Mbit/s | ratio |", "|---|---:|---:|---:|"]
        for r in rows:
            lines.append(
                f"| {r['link']} | {r['configured_mbit']:.0f} | {r['measured_mbit']:.1f} | "
                f"{r['measured_mbit'] / r['configured_mbit']:.3f} |"
            )
        return "\n".join(lines)
    return step.table.read_text().strip()


def write_summary(done: list[tuple[Step, bool]], command: str) -> Path:
    parts = ["# Benchmark results", "", f"Command: `{command}`", ""]
    for step, ok in done:
        parts += [f"## {step.title}", "" if ok else "**this step failed**", _table_text(step), ""]
    path = RESULTS / "summary.md"
    path.write_text("\n".join(parts))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--network",
        choices=("cluster", "loopback"),
        default="cluster",
        help="emulated cluster with shaped links (root), or plain loopback",
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer steps and sizes (minutes instead of ~half an hour)"
    )
    args = parser.parse_args()
    todo = steps(args.network, args.quick)
    started = time.monotonic()
    done = [(step, run(step, i + 1, len(todo), started)) for i, step in enumerate(todo)]
    command = "python -m benchmarks.run_all " + " ".join(sys.argv[1:])
    summary = write_summary(done, command.strip())
    plot_summary(RESULTS, args.network)
    print(f"wrote {summary} after {time.monotonic() - started:.0f} s", flush=True)
    return 0 if all(ok for _, ok in done) else 1


if __name__ == "__main__":
    sys.exit(main())
