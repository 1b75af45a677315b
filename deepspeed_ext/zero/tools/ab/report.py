"""The A/B command's results as a table, a plot and JSON."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from mdsp_base.volume import LINK_CLASSES


def _spread(values: Sequence[float], scale: float, digits: int) -> str:
    """min / median / max of ``values`` times ``scale``."""
    low, mid, high = min(values) * scale, statistics.median(values) * scale, max(values) * scale
    return f"{mid:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def _size(nbytes: float | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def table(rows: Sequence[dict], header: str) -> str:
    """One line per variant: step time and TFLOPS as median (min-max), bytes per link class per
    step, peak memory, the share of the step the mean rank waited in parameter fetches (in brackets:
    before forward passes); variants not run with their reason."""
    links = " ".join(f"{link + ' /step':>16}" for link in LINK_CLASSES)
    lines = [
        header,
        f"{'variant':28} {'step ms, median (min-max)':30} {'TFLOPS/rank':22} {links} {'peak/rank':>10} {'gather wait (fwd)':>18}",
    ]
    for row in rows:
        if not row["ran"]:
            lines.append(f"{row['variant']:28} not run: {row['reason']}")
            continue
        sent = " ".join(f"{_size(row['bytes_per_step'][link]):>16}" for link in LINK_CLASSES)
        lines.append(
            f"{row['variant']:28} {_spread(row['step_s'], 1e3, 1):30} {_spread(row['tflops'], 1, 4):22} "
            f"{sent} {_size(row['peak_bytes']):>10} {_wait(row):>18}"
        )
    return "\n".join(lines)


def _wait(row: dict) -> str:
    """The step's share spent waiting for parameters, and the forward passes' part of it."""
    forward = row["forward_gather_wait_s"] / statistics.median(row["step_s"])
    return f"{row['gather_wait_share']:.1%} ({forward:.1%})"


def separated(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two sets of repeats do not overlap (min-max), so their ratio may be claimed."""
    return max(a) < min(b) or max(b) < min(a)


def comparison(rows: Sequence[dict], ours: str = "ours") -> list[str]:
    """Ours against each other variant: the median ratio where the ranges are separated."""
    by_name = {row["variant"]: row for row in rows if row["ran"]}
    if ours not in by_name:
        return []
    mine = by_name[ours]["step_s"]
    lines = []
    for name, row in by_name.items():
        if name == ours:
            continue
        ratio = statistics.median(row["step_s"]) / statistics.median(mine)
        verdict = f"{ratio:.2f}x its step time" if separated(mine, row["step_s"]) else "not separated"
        lines.append(f"ours against {name}: {verdict}")
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
            f"{parts['compute_s'] * 1e3:.1f} + communication {parts['comm_s'] * 1e3:.1f} - hidden "
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
