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
    """The run's table, one line per variant.

    Args:
        rows: the variants' rows (:func:`.run.variant_row`, or not run with a reason).
        header: the line above the table.

    Returns:
        Step time and TFLOPS as median (min-max), MiB per step through the busiest NIC and package
        link (each collective's geometry, :mod:`mdsp_base.links`), peak memory, and the share of the
        step waited in parameter fetches (in brackets: the forward passes'); a variant not run says why.
    """
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
    """The criterion for runs that were not paired.

    Args:
        a: one variant's repeats.
        b: the other's.

    Returns:
        Whether their min-max ranges do not overlap.
    """
    return max(a) < min(b) or max(b) < min(a)


def paired(rows: Sequence[dict]) -> list[dict[str, Any]]:
    """The paired ratios of the run's steps.

    Args:
        rows: the variants' rows.

    Returns:
        Each variant's step over stock ZeRO-3's, and each of ours over every DeepSpeed variant's, each
        with its 95 % interval and pairs (:meth:`mdsp_base.paired.PairedRatio.record`).
    """
    ran = {row["variant"]: row["step_s"] for row in rows if row["ran"]}
    ours = [name for name in ran if name.startswith("ours")]
    pairs = [(name, "zero3") for name in ran if name != "zero3" and "zero3" in ran]
    pairs += [(o, name) for o in ours for name in ran if name != "zero3" and not name.startswith("ours")]
    return [paired_ratio(ran[v], ran[b]).record(v, b, "step") for v, b in pairs]


def comparison(rows: Sequence[dict]) -> list[str]:
    """The paired ratios (:func:`paired`) in words.

    Args:
        rows: the variants' rows.

    Returns:
        One line per ratio with its 95 % interval; "not separated" where the interval holds 1.
    """
    lines = []
    for p in paired(rows):
        r = PairedRatio(p["ratio"], tuple(p["ci95"]), p["pairs"])
        lines.append(f"{p['variant']} against {p['baseline']}: step {r.verdict()}")
    return lines


def prediction_error(row: dict) -> float | None:
    """A variant's prediction error.

    Args:
        row: the variant's row.

    Returns:
        (predicted - measured median) / measured median; None where it was not predicted.
    """
    if not row.get("ran") or row.get("predicted_step_s") is None:
        return None
    measured = statistics.median(row["step_s"])
    return (row["predicted_step_s"] - measured) / measured


def predictions(rows: Sequence[dict], tolerance: float = 0.25) -> list[str]:
    """The predictions in words.

    Args:
        rows: the variants' rows.
        tolerance: the relative error a prediction is judged within.

    Returns:
        One line per predicted variant: the prediction and its parts against the measured median.
    """
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
    """A bar plot of the median step time per variant, with min-max bars (needs matplotlib).

    Args:
        rows: the variants' rows; those not run are left out.
        path: the PNG to write.
        title: the plot's title.
    """
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
    """The run's JSON: one object per variant.

    Args:
        rows: the variants' rows.
        path: the file to write.
        run: the run's facts (topology, device, load), put under "run" in each object.
    """
    Path(path).write_text(json.dumps([{**row, "run": run} for row in rows], indent=1) + "\n")
