"""Run every plugin's benchmark against its baseline and collect the results in one place.

    sudo .venv/bin/python -m benchmarks.run_all            # emulated cluster (needs root, ip, tc)
    .venv/bin/python -m benchmarks.run_all --network loopback --quick
    .venv/bin/python -m benchmarks.run_all --summary-only  # the summary of the result files as they are

Method in full: benchmarks/results/methods.md, `benchmarks.run_all`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.catalog import REPO, Step, entry_points, left_out, steps
from benchmarks.summary_plot import ResultFormatError, plot_summary
from mdsp_base.shutdown import exit_without_teardown

RESULTS = REPO / "benchmarks" / "results"
STANDING = "# Standing benchmarks\n\nThe comparisons the suite reruns."
STUDIES = "# Studies\n\nOne-off studies (`benchmarks/studies/`), each answering one question; their commands reproduce their tables."
UNCLASSIFIED = "**not classified in benchmarks/catalog.py**: add a step or a reason to leave it out"


def _shown(step: Step) -> str:
    # With the default results folder, whatever --results was: a summary of the same files reads the same.
    return " ".join(["python", *step.argv(RESULTS.relative_to(REPO))])


def run(step: Step, results: Path, index: int, total: int, started: float) -> str:
    """Run one step; returns its status line for the summary."""
    print(f"[{index}/{total}] {step.title}  (elapsed {time.monotonic() - started:.0f} s)", flush=True)
    print(f"    python {' '.join(step.argv(results))}", flush=True)
    begun = time.monotonic()
    stdout = None
    if step.stdout is not None:
        (results / step.stdout).parent.mkdir(parents=True, exist_ok=True)
        stdout = subprocess.PIPE
    proc = subprocess.run([sys.executable, *step.argv(results)], cwd=REPO, stdout=stdout, text=True)
    if step.stdout is not None:
        print(proc.stdout, end="", flush=True)
        if proc.returncode == 0:
            (results / step.stdout).write_text(f"`{_shown(step)}`\n\n```\n{proc.stdout.strip()}\n```\n")
    took = time.monotonic() - begun
    if proc.returncode != 0:
        print(f"[{index}/{total}] FAILED with exit code {proc.returncode} after {took:.0f} s", flush=True)
        return f"**failed** (exit code {proc.returncode} after {took:.0f} s); tables below are older, if any"
    return f"ran in {took:.0f} s"


def _tables(step: Step, results: Path) -> str:
    parts = []
    for name in step.tables:
        path = results / name
        text = path.read_text().strip() if path.exists() else "_no result file_"
        parts.append(f"`{name}`:\n\n{text}")
    return "\n\n".join(parts)


def write_summary(results: Path, done: list[tuple[Step, str]], skipped: dict[str, str], command: str) -> Path:
    """``summary.md``: each step's status and tables, then every entry point left out and why."""
    parts = ["# Benchmark results", "", f"Written by `{command}`.", ""]
    for index, (step, status) in enumerate(done):
        if index == 0 or step.study != done[index - 1][0].study:
            parts += [STUDIES if step.study else STANDING, ""]
        parts += [f"## {step.title}", "", f"`{_shown(step)}`: {status}", "", _tables(step, results), ""]
    parts += ["## Entry points not run", "", "| module | why |", "|---|---|"]
    parts += [f"| `{module}` | {why} |" for module, why in sorted(skipped.items())]
    path = results / "summary.md"
    path.write_text("\n".join(parts) + "\n")
    return path


def not_run(todo: list[Step], args: argparse.Namespace) -> dict[str, str]:
    """Every entry point under ``benchmarks/`` that this invocation does not run, with the reason."""
    skipped = left_out(args.network)
    for module in set(entry_points()) - {s.module for s in todo} - set(skipped):
        skipped[module] = UNCLASSIFIED  # a new entry point: said, never dropped silently
    for step in todo:
        if step.needs_gpu and not args.summary_only and not _has_gpu():
            skipped[step.module] = "needs a CUDA GPU (NCCL, bf16); its last result file is shown above"
        elif args.only and step.module.removeprefix("benchmarks.") not in args.only:
            skipped[step.module] = "not in `--only`; its last result file is shown above"
    return skipped


def main(argv: list[str] | None = None) -> int:
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
        "--quick",
        action="store_true",
        help="fewer repetitions and sizes (about half an hour on 2 busy cores)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="MODULE",
        help="run these entry points only (e.g. zero.run, studies.zero.project)",
    )
    parser.add_argument(
        "--summary-only",
        action="store_true",
        help="run nothing: write summary.md / summary.png from the result files already there",
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="where every step writes")
    args = parser.parse_args(argv)
    started = time.monotonic()
    todo = steps(args.network, args.quick)
    unknown = sorted(set(args.only or ()) - {s.module.removeprefix("benchmarks.") for s in todo})
    if unknown:
        parser.error(f"--only: no step runs {unknown} with --network {args.network}")
    skipped = not_run(todo, args)
    runnable = [s for s in todo if s.module not in skipped and not args.summary_only]
    print(f"{len(runnable)} steps to run; entry points not run:", flush=True)
    for module, why in sorted(skipped.items()):
        print(f"    {module}: {why}", flush=True)

    done = []
    for step in todo:
        if step in runnable:
            status = run(step, args.results, runnable.index(step) + 1, len(runnable), started)
        elif args.summary_only:
            status = "not run (`--summary-only`); the result file as it is"
        else:
            status = f"not run: {skipped[step.module]}"
        done.append((step, status))
    # The command without --results: the summary of the same files reads the same wherever it was written.
    only = ["--only", *args.only] if args.only else []
    flags = ["--quick"] * args.quick + ["--summary-only"] * args.summary_only + only
    command = " ".join(["python -m benchmarks.run_all --network", args.network, *flags])
    summary = write_summary(args.results, done, skipped, command)
    print(f"wrote {summary} after {time.monotonic() - started:.0f} s", flush=True)
    try:
        png = plot_summary(args.results, args.network)
    except ResultFormatError as e:
        print(f"summary plot failed: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"wrote {png}" if png else "no result file to plot", flush=True)
    failed = [step for step, status in done if status.startswith("**failed")]
    return 1 if failed or any(why.startswith(UNCLASSIFIED) for why in skipped.values()) else 0


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    exit_without_teardown(main())
