"""The A/B command's results as a table, a plot and JSON."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mdsp_base.paired import PairedRatio, paired_ratio


def _spread(values: Sequence[float], scale: float, digits: int) -> str:
    """min / median / max of ``values`` times ``scale``."""
    low, mid, high = min(values) * scale, statistics.median(values) * scale, max(values) * scale
    return f"{mid:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def _size(nbytes: float | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def table(rows: Sequence[dict], header: str) -> str:
    """One line per variant: step time and TFLOPS as median (min-max), the MiB per step through the
    busiest NIC and the busiest package link (from each collective's geometry, :mod:`mdsp_base.links`),
    peak memory, the share of the step the mean rank waited in parameter fetches (in brackets: before
    forward passes); variants not run with their reason."""
    lines = [
        header,
        f"{'variant':28} {'step ms, median (min-max)':30} {'TFLOPS/rank':22} {'NIC MiB/step':>13} "
        f"{'pkg link MiB/step':>18} {'peak/rank':>10} {'gather wait (fwd)':>18}",
    ]
    for row in rows:
        if not row["ran"]:
            lines.append(f"{row['variant']:28} not run: {row['reason']}")
            continue
        lines.append(
            f"{row['variant']:28} {_spread(row['step_s'], 1e3, 1):30} {_spread(row['tflops'], 1, 4):22} "
            f"{row['nic_mib_per_step']:>13.2f} {row['package_link_mib_per_step']:>18.2f} "
            f"{_size(row['peak_bytes']):>10} {_wait(row):>18}"
        )
    return "\n".join(lines)


def _wait(row: dict) -> str:
    """The step's share spent waiting for parameters, and the forward passes' part of it."""
    forward = row["forward_gather_wait_s"] / statistics.median(row["step_s"])
    return f"{row['gather_wait_share']:.1%} ({forward:.1%})"


def separated(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two sets of repeats do not overlap (min-max): the studies' criterion for runs that
    were not paired."""
    return max(a) < min(b) or max(b) < min(a)


def paired(rows: Sequence[dict]) -> list[dict[str, Any]]:
    """Each variant's step over stock ZeRO-3's, and ours over every other, from the paired rounds."""
    ran = {row["variant"]: row["step_s"] for row in rows if row["ran"]}
    pairs = [(name, "zero3") for name in ran if name != "zero3" and "zero3" in ran]
    pairs += [("ours", name) for name in ran if name not in ("ours", "zero3") and "ours" in ran]
    return [paired_ratio(ran[v], ran[b]).record(v, b, "step") for v, b in pairs]


def comparison(rows: Sequence[dict]) -> list[str]:
    """Each paired ratio of the run (:func:`paired`): steps timed in alternating rounds, with its
    95 % interval; "not separated" where the interval holds 1."""
    lines = []
    for p in paired(rows):
        r = PairedRatio(p["ratio"], tuple(p["ci95"]), p["pairs"])
        lines.append(f"{p['variant']} against {p['baseline']}: step {r.verdict()}")
    return lines


def prediction_error(row: dict) -> float | None:
    """(predicted - measured median) / measured median of a variant, or None without a prediction."""
    if not row.get("ran") or row.get("predicted_step_s") is None:
        return None
    measured = statistics.median(row["step_s"])
    return (row["predicted_step_s"] - measured) / measured


def predictions(rows: Sequence[dict], tolerance: float = 0.25) -> list[str]:
    """Each predicted variant: its prediction and parts against the measured median."""
    lines = []
    for row in rows:
        error = prediction_error(row)
        if error is None:
            continue
        parts = row["predicted"]
        verdict = "within" if abs(error) <= tolerance else "outside"
        lines.append(
            f"{row['variant']}: predicted {row['predicted_step_s'] * 1e3:.1f} ms (compute "
            f"{parts['compute_s'] * 1e3:.1f} + engine host {parts['host_s'] * 1e3:.1f} + communication "
            f"{parts['comm_s'] * 1e3:.1f} - hidden "
            f"{parts['hidden_s'] * 1e3:.1f}), measured median {statistics.median(row['step_s']) * 1e3:.1f} ms: "
            f"{error:+.1%}, {verdict} {tolerance:.0%}"
            + (
                f" ({parts['unmeasured']:g} launches per step beyond what the profile measured)"
                if parts.get("unmeasured")
                else ""
            )
        )
    return lines


def plot(rows: Sequence[dict], path: str | Path, title: str) -> None:
    """Median step time per variant with min-max bars (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib ({exc}): pip install matplotlib, or drop --plot") from exc
    ran = [row for row in rows if row["ran"]]
    medians = [statistics.median(r["step_s"]) * 1e3 for r in ran]
    low = [m - min(r["step_s"]) * 1e3 for m, r in zip(medians, ran)]
    high = [max(r["step_s"]) * 1e3 - m for m, r in zip(medians, ran)]
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(ran)), 3.5))
    ax.bar([r["variant"] for r in ran], medians, yerr=[low, high], capsize=4, color="#4477aa")
    ax.set_ylabel("step time (ms), median, min-max")
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(rows: Sequence[dict], path: str | Path, run: dict) -> None:
    """One object per variant, each with the run's facts (topology, device, load) under "run"."""
    Path(path).write_text(json.dumps([{**row, "run": run} for row in rows], indent=1) + "\n")
