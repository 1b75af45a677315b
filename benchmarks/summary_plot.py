"""One PNG with a panel per plugin benchmark, drawn from the JSON the benchmarks wrote.

Each panel reads one result file in the format its benchmark writes today; a file in another format
(an older run, a benchmark changed without this plot) raises :class:`ResultFormatError` naming the
file and the key, instead of a bare ``KeyError`` at the end of a long run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

LINKS = ("package", "node", "inter_node")


class ResultFormatError(ValueError):
    """A result file lacks a key (or holds another type) where its panel reads it."""


def _zero(ax: Axes, data: dict[str, Any], name: str) -> None:
    by_micro = data["summary"]
    micro = max(by_micro, key=int)  # the largest gradient accumulation run
    rows = by_micro[micro]["rows"]
    names = list(rows)
    ax.bar(
        [i - 0.2 for i in range(len(names))],
        [rows[n].get("shaped", rows[n]["unshaped"])["median"] for n in names],
        width=0.4,
        color="tab:blue",
        label="step time",
    )
    ax.legend(fontsize=7, loc="upper left")
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=7)
    ax.set_ylabel("step time, s (median)")
    twin = ax.twinx()
    if any("wire_bytes" not in rows[n] for n in names):
        # over loopback nothing is measured at the interfaces: the busiest NIC's computed bytes
        mib = [rows[n]["nic"]["nic_mib_per_step"] for n in names]
        twin.bar([i + 0.2 for i in range(len(names))], mib, width=0.4, color="tab:red", label="busiest NIC")
        twin.set_ylabel("MiB per step on the busiest NIC (computed)")
    else:
        bottom = [0.0] * len(names)
        for link, colour in zip(LINKS, ("tab:green", "tab:orange", "tab:red")):
            mb = [rows[n]["wire_bytes"][link] / 1e6 for n in names]
            twin.bar(
                [i + 0.2 for i in range(len(names))], mb, width=0.4, bottom=bottom, color=colour, label=link
            )
            bottom = [b + m for b, m in zip(bottom, mb)]
        twin.set_ylabel("MB sent per rank and step (measured)")
    twin.legend(fontsize=7, loc="upper right")
    ax.set_title(f"hierarchical ZeRO ({name}, accumulation {micro})", fontsize=9)


def _node_loader(ax: Axes, data: dict[str, Any], name: str) -> None:
    rows, ranks = data["layouts"]["rows"], data["settings"]["ranks"]
    tps = sorted({r["tp"] for r in rows if r["scheme"] != "none"})

    def median(scheme: str, tp: int, key: str) -> float:
        runs = [r for r in rows if r["scheme"] == scheme and r["tp"] == tp]
        values = sorted(x["figures"][key] for x in runs[0]["runs"]) if runs else [float("nan")]
        return values[len(values) // 2]

    for shift, scheme, colour in ((-0.2, "megatron", "tab:orange"), (0.2, "shm", "tab:blue")):
        label = "Megatron" if scheme == "megatron" else "node loader"
        cpu = [median(scheme, tp, "data_cpu_us_per_step") / 1e3 for tp in tps]
        ax.bar([i + shift for i in range(len(tps))], cpu, width=0.4, color=colour, label=f"{label}: CPU")
    ax.set_xticks(range(len(tps)), [f"TP{tp} x DP{ranks // tp}" for tp in tps], fontsize=7)
    ax.set_ylabel("data-path CPU ms per step, node (median)")
    ax.legend(fontsize=7, loc="upper right")
    twin = ax.twinx()
    for scheme, marker in (("megatron", "o"), ("shm", "s")):
        waits = [median(scheme, tp, "wait_ms") for tp in tps]
        twin.plot(range(len(tps)), waits, marker, color="tab:red")
    twin.set_ylabel("data wait ms per rank and step (o Megatron, s ours)", color="tab:red")
    ax.set_title("node loader vs Megatron's path at 8 ranks, cold reads", fontsize=9)


def _calibration(ax: Axes, data: dict[str, Any], name: str) -> None:
    links = data["links"]
    names = [r["link"] for r in links]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [r["configured_mbit"] for r in links], width=0.4, label="configured")
    ax.bar([i + 0.2 for i in x], [r["measured_mbit"] for r in links], width=0.4, label="measured")
    ax.set_xticks(x, names)
    ax.set_ylabel("Mbit/s")
    ax.legend(fontsize=7)
    ax.set_title("emulated cluster calibration", fontsize=9)


def _flash_overlap(ax: Axes, data: dict[str, Any], name: str) -> None:
    summaries = data["summaries"]
    methods = list(dict.fromkeys(m for s in summaries for m in s["methods"]))
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        ax.bar(
            [i - 0.4 + width * (j + 0.5) for i in range(len(summaries))],
            # A method left out of one block or regime (--methods) has no bar there.
            [
                s["methods"][method]["step_s"]["median"] * 1e3 if method in s["methods"] else 0.0
                for s in summaries
            ],
            width=width,
            label=method,
        )
    ax.set_xticks(range(len(summaries)), [f"{s['block']}\n{s['regime']}" for s in summaries], fontsize=7)
    ax.set_ylabel("forward + backward, ms (median)")
    ax.legend(fontsize=6)
    ax.set_title(f"Flash-Overlap ({name})", fontsize=9)


Panel = Callable[[Axes, dict[str, Any], str], None]


def panels(results: Path, network: str) -> list[tuple[Path, Panel]]:
    """The result files the summary draws for ``network``, each with its panel."""
    fo = "cluster400" if network == "cluster" else "loopback"
    return [
        (results / "cluster" / "calibration.json", _calibration),
        (results / "zero" / f"{network}.json", _zero),
        (results / "flash_overlap" / f"{fo}_tp2.json", _flash_overlap),
        (results / "data_loader" / "node.json", _node_loader),
    ]


def _draw(ax: Axes, path: Path, panel: Panel) -> None:
    try:
        panel(ax, json.loads(path.read_text()), path.stem)
    except KeyError as e:
        raise ResultFormatError(
            f"{path}: no key {e.args[0]!r} where {panel.__name__.lstrip('_')}'s panel reads it; "
            "the file is not in the format its benchmark writes now (rerun the benchmark)"
        ) from e
    except (TypeError, IndexError, AttributeError, ValueError) as e:
        raise ResultFormatError(
            f"{path}: unexpected format for {panel.__name__.lstrip('_')}'s panel ({type(e).__name__}: {e})"
        ) from e


def plot_summary(results: Path, network: str) -> Path | None:
    """Draw the panels whose JSON exists into ``results/summary.png``; returns its path, or None when
    there is nothing to draw. Raises :class:`ResultFormatError` for a file it cannot read."""
    found = [(p, fn) for p, fn in panels(results, network) if p.exists()]
    if not found:
        return None
    cols = min(3, len(found))
    rows = -(-len(found) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 5 * rows), squeeze=False)
    try:
        for ax, (path, draw) in zip(axes.flat, found):
            _draw(ax, path, draw)
        for ax in list(axes.flat)[len(found) :]:
            ax.set_visible(False)
        fig.tight_layout()
        out = results / "summary.png"
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
    return out
