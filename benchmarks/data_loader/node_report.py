"""Figures and markdown tables of the node benchmark (``benchmarks.data_loader.node``), from the
output of its ranks."""

from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.data_loader.run import spread

MIB = 1024  # KiB per MiB


def throughput_rows(out: dict, args: argparse.Namespace) -> list[dict]:
    """Part A: one row per producer worker count, one run per repetition."""
    per_rank = [r["result"] for r in out["ranks"]]
    rows: dict[int, dict] = {}
    for i, first in enumerate(per_rank[0]):
        row = rows.setdefault(first["workers"], {"workers": first["workers"], "notes": set(), "runs": []})
        if "window_s" not in first:
            continue
        if first.get("tree_changed"):
            row["notes"].add("the producer's process tree changed inside a window")
        runs = [ranks[i] for ranks in per_rank]
        published = first["published_steps"]
        row["runs"].append(
            {
                "producer_steps_per_s": published / first["window_s"],
                "vs_demand": published / first["window_s"] / args.demand,
                "ranks_steps_per_s": statistics.median(r["steps"] / r["window_s"] for r in runs),
                "producer_cores": first["producer_cpu_s"] / first["window_s"],
                "producer_lifetime_cpu_s": first["producer_lifetime_cpu_s"],
                "producer_cpu_s_per_step": first["producer_cpu_s"] / published if published else float("nan"),
                "producer_processes": first["producer_processes"],
                "published_steps": published,
            }
        )
    for row in rows.values():
        row["notes"] = sorted(row["notes"])
    return [{**row, "load_average": out["load_average"]} for row in rows.values()]


def footprint_run(out: dict) -> dict:
    """Parts B and C: one launch's node totals and per-rank times."""
    ranks = [r["result"] for r in sorted(out["ranks"], key=lambda r: r["rank"])]
    steps = len(ranks[0]["step_s"])
    summary = {
        "cpu_s_per_step": sum(r["cpu_s"] for r in ranks) / steps,
        "lifetime_cpu_s": sum(r["lifetime_cpu_s"] for r in ranks),
        "processes": sum(r["during"]["processes"] for r in ranks),
        "rss_mib": sum(r["during"]["rss_kib"] for r in ranks) / MIB,
        "pss_mib": sum(r["during"]["pss_kib"] for r in ranks) / MIB,
        "rss_added_mib": sum(r["during"]["rss_kib"] - r["before"]["rss_kib"] for r in ranks) / MIB,
        "pss_added_mib": sum(r["during"]["pss_kib"] - r["before"]["pss_kib"] for r in ranks) / MIB,
        "step_ms": statistics.median(statistics.median(r["step_s"]) for r in ranks) * 1e3,
    }
    flags = [
        text
        for key, text in (
            ("tree_changed", "a rank's process tree changed inside the window"),
            ("unreaped", "loader processes were not reaped yet when the lifetime CPU was read"),
        )
        if any(r[key] for r in ranks)
    ]
    return {
        "summary": summary,
        "wait_ms_per_rank": [statistics.median(r["wait_s"]) * 1e3 for r in ranks],
        "step_ms_per_rank": [statistics.median(r["step_s"]) * 1e3 for r in ranks],
        "notes": flags,
        "load_average": out["load_average"],
        "launch_s": out["wall_s"],
        "rank_times_s": [r["times"] for r in sorted(out["ranks"], key=lambda r: r["rank"])],
    }


def _cells(runs: list[dict], columns: tuple) -> list[str]:
    return [spread([run[key] for run in runs], digits) if runs else "-" for key, _, digits in columns]


def _loads(pairs: list) -> str:
    flat = [x for pair in pairs for x in pair]
    return f"{min(flat):.2f}-{max(flat):.2f}" if flat else "-"


THROUGHPUT = (
    ("producer_steps_per_s", "producer steps/s (published)", 1),
    ("vs_demand", "/ demand", 1),
    ("ranks_steps_per_s", "ranks' steps/s (median rank)", 1),
    ("producer_cpu_s_per_step", "producer CPU s per step", 4),
    ("producer_cores", "producer CPU s per s (cores busy)", 2),
    ("producer_lifetime_cpu_s", "producer CPU s, whole life (getrusage)", 2),
)
FOOTPRINT = (
    ("processes", "processes", 0),
    ("cpu_s_per_step", "CPU s per step, steady", 4),
    ("lifetime_cpu_s", "CPU s, loader's life", 2),
    ("rss_mib", "RSS MiB", 0),
    ("pss_mib", "PSS MiB", 0),
    ("rss_added_mib", "RSS MiB added by the loader", 0),
    ("pss_added_mib", "PSS MiB added by the loader", 0),
)
LABELS = {
    "megatron": "Megatron (DataLoader on every rank, TP rank 0's used)",
    "shm": "node loader",
    "none": "baseline: ranks only sleep, no loader",
}


def _throughput_md(rows: list[dict], args: argparse.Namespace) -> list[str]:
    lines = [
        f"## A. Producer throughput, {args.ranks} ranks TP=1 x DP={args.ranks}, {args.ranks} streams x "
        f"{args.mbs} x {args.seq_length} tokens per step, no compute",
        "",
        f"Demand: {args.demand:g} step/s; target: throughput / demand >= 3. "
        f"{args.throughput_steps} steps after {args.warmup} of warm-up, "
        f"load average {_loads([r['load_average'] for r in rows])}.",
        "",
        "| workers | processes | " + " | ".join(name for _, name, _ in THROUGHPUT) + " | note |",
        "|---" * (len(THROUGHPUT) + 3) + "|",
    ]
    for row in rows:
        procs = sorted({run["producer_processes"] for run in row["runs"]})
        lines.append(
            f"| {row['workers']} | {'/'.join(map(str, procs)) or '-'} | "
            + " | ".join(_cells(row["runs"], THROUGHPUT))
            + f" | {'; '.join(row['notes'])} |"
        )
    return lines


def _footprint_md(rows: dict, args: argparse.Namespace) -> list[str]:
    loads = _loads([pair for row in rows.values() for pair in row["load_average"]])
    lines = [
        f"## B. Data-path CPU and memory per node, {args.ranks} ranks TP={args.ranks} x DP=1, "
        f"{args.mbs} x {args.seq_length}, {args.step_ms:g} ms sleep per step",
        "",
        f"Megatron: {args.num_workers} DataLoader workers per rank; ours: {args.node_workers} producer "
        f"worker(s). {args.steps} steps after {args.warmup} of warm-up; load average {loads}.",
        "",
        "| path | " + " | ".join(name for _, name, _ in FOOTPRINT) + " |",
        "|---" * (len(FOOTPRINT) + 1) + "|",
    ]
    summaries = {k: [run["summary"] for run in row["runs"]] for k, row in rows.items()}
    for scheme, runs in summaries.items():
        lines.append(f"| {LABELS[scheme]} | " + " | ".join(_cells(runs, FOOTPRINT)) + " |")
    med = {
        k: {key: statistics.median(r[key] for r in runs) for key, _, _ in FOOTPRINT}
        for k, runs in summaries.items()
        if runs
    }
    if "shm" in med and "megatron" in med:
        ratios = [f"{med['shm'][k] / med['megatron'][k]:.2f}" for k, _, _ in FOOTPRINT]
        lines.append("| ours / Megatron (medians; target <= 0.5) | " + " | ".join(ratios) + " |")
        if "none" in med:
            net = [
                _ratio(med["shm"][k] - med["none"][k], med["megatron"][k] - med["none"][k])
                if k in ("cpu_s_per_step", "lifetime_cpu_s")
                else "-"  # memory: the "added" columns hold each launch's own baseline
                for k, _, _ in FOOTPRINT
            ]
            lines.append("| ours / Megatron, CPU less the baseline's | " + " | ".join(net) + " |")
    for scheme, row in rows.items():
        notes = sorted({n for run in row["runs"] for n in run["notes"]})
        if notes:
            lines += ["", f"{LABELS[scheme]}: {'; '.join(notes)}"]
    lines += [
        "",
        f"## C. Step time, same runs ({args.step_ms:g} ms of sleep standing in for compute)",
        "",
        "| path | step ms (median rank) | "
        + " | ".join(f"wait ms rank {r}" for r in range(args.ranks))
        + " |",
        "|---" * (args.ranks + 2) + "|",
    ]
    for scheme, row in rows.items():
        if not row["runs"] or scheme == "none":
            continue
        waits = [spread([run["wait_ms_per_rank"][r] for run in row["runs"]], 2) for r in range(args.ranks)]
        lines.append(
            f"| {LABELS[scheme]} | {_cells(summaries[scheme], (('step_ms', '', 1),))[0]} | "
            + " | ".join(waits)
            + " |"
        )
    return lines


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


def _mask_md(mask: dict, args: argparse.Namespace) -> list[str]:
    mib = mask["mask_bytes"] / 2**20
    peaks = [h["peak_kib"] / MIB for h in mask["hwm"]]
    kept = [h["kept_kib"] / MIB for h in mask["hwm"]]
    torch_peaks = [b / 2**20 for b in mask["torch_peak_bytes"]]
    ms = [h["s"] * 1e3 for h in mask["hwm"]]
    return [
        f"## D. Rank peak memory in next(), node loader, {args.mbs} x {args.seq_length}, "
        "create_attention_mask + reset_attention_mask",
        "",
        f"Mask {mask['mask_shape']} bool = {mib:.1f} MiB; target: peak <= 1.10 x mask. "
        f"{len(peaks)} calls per method; load average {_loads([mask['load_average']])}.",
        "",
        "| method | peak MiB | peak / mask | RSS MiB kept (the batch) | next() ms |",
        "|---|---:|---:|---:|---:|",
        f"| VmHWM rise above VmRSS before the call (all pages) | {spread(peaks, 1)} | "
        f"{spread([p / mib for p in peaks], 3)} | {spread(kept, 1)} | {spread(ms, 0)} |",
        f"| torch CPU allocator peak (tensors only) | {spread(torch_peaks, 1)} | "
        f"{spread([p / mib for p in torch_peaks], 3)} | - | - |",
    ]


def markdown(results: dict, args: argparse.Namespace) -> str:
    s = results["settings"]
    lines = [
        "# Node loader benchmark",
        "",
        f"`{s['command']}`: {s['cpus']} CPUs, corpus {s['corpus_bytes'] / 2**20:.0f} MiB "
        f"({'dropped from the page cache before each loader' if args.cold else 'page cache kept'}), "
        f"{args.repeats} repetition(s), median (min-max), {s['wall_s']:.0f} s in all.",
        "",
    ]
    sections = (
        ("throughput", _throughput_md),
        ("footprint", _footprint_md),
        ("mask", _mask_md),
    )
    for key, fn in sections:
        if key in results:
            lines += fn(results[key], args) + [""]
    for part, error in results["errors"].items():
        lines += [f"**{part} failed**: {error}", ""]
    lines += ["Settings: " + json.dumps({k: v for k, v in s.items() if k != "command"}), ""]
    return "\n".join(lines)
