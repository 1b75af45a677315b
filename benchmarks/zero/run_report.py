"""The paired comparisons and the tables of ``benchmarks.zero.run``.

Every speed comparison is a paired ratio (``mdsp_base.paired``): the variants' steps interleave
within each launch, so step i of a variant and step i of its baseline ran side by side under the
same host load; a ratio counts only when its 95 % interval excludes 1.
"""

from __future__ import annotations

from typing import Any

from mdsp_base.comm import LINK_CLASSES
from mdsp_base.paired import MIN_PAIRS, PairedRatio, paired_ratio

MB = 1e6


def peer(name: str, names: list[str]) -> str | None:
    """The hpZ engine holding the same secondary copy as one of ours (package: hpZ(2), node: hpZ(4))."""
    hpzs = sorted((k for k in names if k.startswith("zero++ hpZ(")), key=lambda k: int(k[11:-1]))
    if not name.startswith("ours") or len(hpzs) < 2:
        return None
    return hpzs[1] if name == "ours (node)" else hpzs[0]


def paired(steps: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Each variant's step over ZeRO-3's and each of ours over the hpZ at its memory, from the
    paired steps (``steps``: every variant's, in the same launch and step order); none below
    ``MIN_PAIRS`` pairs."""
    names = list(steps)
    pairs = [(name, "zero3") for name in names if name != "zero3" and "zero3" in steps]
    pairs += [(name, p) for name in names if (p := peer(name, names)) is not None]
    out = []
    for variant, baseline in pairs:
        if len(steps[variant]) < MIN_PAIRS:
            continue
        out.append(paired_ratio(steps[variant], steps[baseline]).record(variant, baseline, "step"))
    return out


def _cell(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(summary: dict[str, Any], title: str) -> str:
    """One accumulation value's tables: steps, paired ratios, bytes and memory."""
    rows, device = summary["rows"], summary.get("device")
    loads = ", ".join(f"{x:.1f}" for x in summary["loadavg"])
    compute = (
        f"compute on a virtual {device['device']} (dilation {device['dilation']:g}, contention "
        f"{device['contention']:g}), bf16"
        if device
        else "compute on the host's CPU, fp32"
    )
    lines = [
        f"### {title}, gradient accumulation {summary['micro']}",
        "",
        f"{summary['params']:,} parameters, {compute}; {summary['launches']} launch(es) x "
        f"{summary['args']['steps']} timed steps, prefetch bucket {summary['args']['prefetch_bucket']:,}; "
        f"load average before each launch: {loads}",
        "",
        "| variant | step s, shaped: median (min-max) | launch medians | unshaped median | shaped - unshaped "
        "(measured) | comm s (computed) | computed / measured | device ms per step (charged) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        s, u = r.get("shaped"), r["unshaped"]
        exposed = s["median"] - u["median"] if s else None
        comm = (r.get("computed") or {}).get("comm_s")
        lines.append(
            f"| {name} | "
            + (f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})" if s else "-")
            + " | "
            + (", ".join(f"{t:.2f}" for t in s["launch_medians"]) if s else "-")
            + f" | {u['median']:.2f} | {_cell(exposed)} | {_cell(comm)} | "
            + (f"{comm / exposed:.2f}" if comm is not None and exposed else "-")
            + f" | {_cell(r['device_s'] * 1e3 if 'device_s' in r else None, 1)} |"
        )
    lines += ["", *comparison(summary), ""]
    lines += [
        "| variant | wire MB measured: package / node / inter-node (all) | ring wire MB computed | "
        "busiest NIC / package link MiB per step (computed) | engine MB: secondary / all | peak MB (measured) |",
        "|---|---|---|---|---:|---:|",
    ]
    for name, r in rows.items():
        w, held, nic = r.get("wire_bytes"), r.get("held_bytes"), r.get("nic")
        ring = (r.get("computed") or {}).get("ring_wire_bytes")
        lines.append(
            f"| {name} | "
            + (
                f"{w['package'] / MB:.2f} / {w['node'] / MB:.2f} / {w['inter_node'] / MB:.2f} ({w['total'] / MB:.2f})"
                if w
                else "-"
            )
            + " | "
            + (" / ".join(f"{ring[k] / MB:.2f}" for k in LINK_CLASSES) if ring else "-")
            + " | "
            + (f"{nic['nic_mib_per_step']:.2f} / {nic['package_link_mib_per_step']:.2f}" if nic else "-")
            + " | "
            + (f"{held['secondary'] / MB:.2f} / {sum(held.values()) / MB:.2f}" if held else "-")
            + f" | {_cell(r['peak_bytes'] / MB if r.get('peak_bytes') is not None else None)} |"
        )
    return "\n".join(lines)


def comparison(summary: dict[str, Any]) -> list[str]:
    """The paired ratios as a table, or why there are none."""
    if not summary["paired"]:
        return [f"No paired ratio: fewer than {MIN_PAIRS} pairs of steps."]
    key = "shaped" if any("shaped" in r for r in summary["rows"].values()) else "unshaped"
    lines = [
        f"Paired step ratios ({key} steps, measured; below 1: the variant is faster):",
        "",
        "| variant | baseline | step ratio [95 % interval] | pairs |",
        "|---|---|---|---:|",
    ]
    for p in summary["paired"]:
        verdict = PairedRatio(p["ratio"], (p["ci95"][0], p["ci95"][1]), p["pairs"]).verdict()
        lines.append(f"| {p['variant']} | {p['baseline']} | {verdict} | {p['pairs']} |")
    return lines


def notes(device: dict[str, Any] | None) -> str:
    """What the tables' columns are."""
    text = (
        "Bytes are per step. Wire bytes: what the ranks' interfaces sent per tc class, per rank (measured, "
        "mean over ranks of each rank's median step); ring wire bytes: computed per rank. Busiest NIC / "
        "package link: the most any one NIC sent (egress) or any one package link carried in the last "
        "timed step, computed from each collective's geometry over every rank's calls "
        "(mdsp_base.comm.nic_bytes_per_step). Engine MB: the engine's state tensors after the last "
        "backward (the largest rank's). Peak MB: the most bytes a rank held at once during a step, from "
        "the allocator (the largest of the ranks)."
    )
    if device:
        text += (
            f" On the {device['device']} stand-in every tensor op is charged to a virtual device and not "
            "computed (its outputs share one zero buffer): engine and peak bytes are not measured, and "
            "nothing reads values. Device ms per step: the charged device time of the median step (slowest rank) "
            f"({'; '.join(device['sources'])})."
        )
    return text + "\n"
