"""One PNG with a panel per plugin benchmark, drawn from the JSON the benchmarks wrote."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

LINKS = ("package", "node", "inter_node")


def _zero(ax, path: Path) -> None:
    by_micro = json.loads(path.read_text())["summary"]
    micro = max(by_micro, key=int)  # the largest gradient accumulation run
    rows = by_micro[micro]["rows"]
    names = list(rows)
    ax.bar(
        [i - 0.2 for i in range(len(names))],
        [rows[n].get("shaped", rows[n]["unshaped"])["median"] for n in names],
        width=0.4,
        color="tab:blue",
    )
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("step time, s (median)")
    twin = ax.twinx()
    bottom = [0.0] * len(names)
    for link, colour in zip(LINKS, ("tab:green", "tab:orange", "tab:red")):
        # Measured wire bytes on the emulated cluster; over loopback only the computed counter bytes exist.
        mb = [rows[n].get("wire_bytes", rows[n]["counter_bytes"])[link] / 1e6 for n in names]
        twin.bar(
            [i + 0.2 for i in range(len(names))],
            mb,
            width=0.4,
            bottom=bottom,
            color=colour,
            label=f"{link} MB",
        )
        bottom = [b + m for b, m in zip(bottom, mb)]
    twin.set_ylabel("MB sent per rank and step")
    twin.legend(fontsize=7, loc="upper right")
    ax.set_title(f"hierarchical ZeRO ({path.stem}, accumulation {micro})", fontsize=9)


def _loader(ax, path: Path) -> None:
    results = json.loads(path.read_text())["results"]
    labels = [f"TP{r['tp']} {r['scheme']}" for r in results]
    ax.bar(labels, [r["summary"]["logical_bytes_per_node"] / 2**20 for r in results], color="tab:blue")
    ax.set_ylabel("storage MiB asked per node")
    ax.tick_params(axis="x", rotation=45, labelsize=7)
    twin = ax.twinx()
    twin.plot(labels, [r["summary"]["p99_ms_worst_rank"] for r in results], "o", color="tab:red")
    twin.set_ylabel("p99 batch latency, ms (worst rank)")
    twin.set_yscale("log")
    ax.set_title("shared-memory node loader", fontsize=9)


def _calibration(ax, path: Path) -> None:
    links = json.loads(path.read_text())["links"]
    names = [r["link"] for r in links]
    ax.bar(
        [i - 0.2 for i in range(len(names))],
        [r["configured_mbit"] for r in links],
        width=0.4,
        label="configured",
    )
    ax.bar(
        [i + 0.2 for i in range(len(names))], [r["measured_mbit"] for r in links], width=0.4, label="measured"
    )
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("Mbit/s")
    ax.legend(fontsize=7)
    ax.set_title("emulated cluster calibration", fontsize=9)


def plot_summary(results: Path, network: str) -> Path | None:
    """Draw the panels whose JSON exists; returns the PNG path, or None when there is nothing to draw."""
    panels = [
        (p, fn)
        for p, fn in (
            (results / "zero" / f"{network}.json", _zero),
            (results / "data_loader" / "results.json", _loader),
            (results / "cluster" / "calibration.json", _calibration),
        )
        if p.exists()
    ]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (path, draw) in zip(axes[0], panels):
        draw(ax, path)
    fig.tight_layout()
    out = results / "summary.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
