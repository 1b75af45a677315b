"""Figures, comparisons and markdown tables of the node benchmark (``benchmarks.data_loader.node``),
from the output of its ranks.

Every figure is given as min / median / max over the launches. A ratio ours / Megatron is stated
only where the two sides' min-max ranges do not overlap ("separated"); otherwise the table says
"not separated" and gives no ratio.
"""

from __future__ import annotations

import statistics
from typing import Any

MIB = 1024  # KiB per MiB
SCHEMES = ("megatron", "shm")
LABELS = {
    "megatron": "Megatron (TP rank 0's DataLoader + broadcast)",
    "shm": "node loader",
    "none": "ranks only (sleep, no loader)",
}
FIGURES = (
    # key, column, digits
    ("processes", "processes", 0),
    ("step_ms", "step ms", 1),
    ("wait_ms", "data wait ms per rank", 2),
    ("wait_ms_worst_rank", "data wait ms, worst rank", 2),
    ("data_cpu_us_per_step", "data-path CPU us per step", 0),
    ("cpu_us_per_step", "CPU us per step, all (ranks incl.)", 0),
    ("rss_mib", "RSS MiB", 0),
    ("pss_mib", "PSS MiB", 0),
    ("rss_added_mib", "RSS MiB added", 0),
    ("pss_added_mib", "PSS MiB added", 0),
    ("device_read_mib", "device MiB read", 1),
)
COMPARED = (
    "wait_ms",
    "data_cpu_us_per_step",
    "step_ms",
    "rss_mib",
    "pss_mib",
    "rss_added_mib",
    "pss_added_mib",
    "device_read_mib",
)
TARGETS = (("wait_ms", "data wait per rank"), ("data_cpu_us_per_step", "host CPU of the data path"))
TARGET_RATIO = 0.5
TARGET_TP = 1


def launch_figures(ranks: list[dict], device: dict[str, int], ranks_per_node: int) -> dict[str, Any]:
    """One launch of the layouts part: node totals (processes, CPU, memory) and per-rank times."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    res = [r["result"] for r in ranks]
    steps = len(res[0]["step_s"])
    rank_wait = [statistics.fmean(r["wait_s"]) * 1e3 for r in res]
    windows = [r["window_s"] for r in res]
    figures = {
        "processes": sum(r["processes"] for r in res),
        "step_ms": statistics.fmean(statistics.fmean(r["step_s"]) for r in res) * 1e3,
        "wait_ms": statistics.fmean(rank_wait),
        "wait_ms_worst_rank": max(rank_wait),
        "cpu_us_per_step": sum(r["cpu_ns"] for r in res) / 1e3 / steps,
        "cpu_us_per_s": sum(r["cpu_ns"] / 1e3 / r["window_s"] for r in res),
        "window_s": statistics.fmean(windows),
        "steps": steps,
        "rss_mib": sum(r["during"]["rss_kib"] for r in res) / MIB,
        "pss_mib": sum(r["during"]["pss_kib"] for r in res) / MIB,
        "rss_added_mib": sum(r["during"]["rss_kib"] - r["before"]["rss_kib"] for r in res) / MIB,
        "pss_added_mib": sum(r["during"]["pss_kib"] - r["before"]["pss_kib"] for r in res) / MIB,
        "device_read_mib": device["bytes"] / 2**20,
        "device_reads": device["ios"],
        # Processes under the TP ranks other than 0: upstream starts no DataLoader (no worker) there.
        "processes_off_tp0": sum(x["result"]["processes"] - 1 for x in ranks if x["tp_rank"]),
    }
    notes = []
    if any(r["processes_born"] or r["processes_gone"] for r in res):
        notes.append("a rank's process tree changed inside the window")
    if any(r["lost_threads"] for r in res):
        notes.append(f"{sum(r['lost_threads'] for r in res)} thread(s) ended inside the window (CPU lost)")
    return {
        "figures": figures,
        "wait_ms_per_rank": rank_wait,
        "notes": notes,
        "ranks_per_node": ranks_per_node,
    }


def subtract_baseline(launches: list[dict]) -> float | None:
    """Set each launch's ``data_cpu_us_per_step``: its CPU per step less what the ranks-only
    launches spend per second over as long a window (median rate of those launches). Returns that
    rate (us of CPU per second, node total), or None without baseline launches."""
    base = [x["figures"]["cpu_us_per_s"] for x in launches if x["scheme"] == "none"]
    rate = statistics.median(base) if base else None
    for x in launches:
        f = x["figures"]
        if rate is None:
            f["data_cpu_us_per_step"] = f["cpu_us_per_step"]
        else:
            f["data_cpu_us_per_step"] = f["cpu_us_per_step"] - rate * f["window_s"] / f["steps"]
    return rate


def three(values: list[float], digits: int) -> str:
    """min / median / max."""
    if not values:
        return "-"
    return " / ".join(f"{v:.{digits}f}" for v in (min(values), statistics.median(values), max(values)))


MIN_LAUNCHES = 2  # a single launch per side has no range to separate


def separated(ours: list[float], theirs: list[float]) -> bool:
    """The two min-max ranges do not overlap, each over at least :data:`MIN_LAUNCHES` launches."""
    if min(len(ours), len(theirs)) < MIN_LAUNCHES:
        return False
    return max(ours) < min(theirs) or min(ours) > max(theirs)


def compare(ours: list[float], theirs: list[float]) -> dict[str, Any]:
    med_theirs = statistics.median(theirs) if theirs else 0.0
    ratio = statistics.median(ours) / med_theirs if ours and med_theirs > 0 else None
    return {"separated": separated(ours, theirs), "ratio_of_medians": ratio}


def ratio_cell(c: dict[str, Any]) -> str:
    if not c["separated"]:
        return "not separated"
    return f"{c['ratio_of_medians']:.2f}x" if c["ratio_of_medians"] is not None else "-"


def rows(launches: list[dict], tps: list[int]) -> list[dict]:
    """One row per (TP, path) with every launch's figures, then the ranks-only baseline."""
    out = []
    for tp in tps:
        for scheme in SCHEMES:
            runs = [x for x in launches if x["tp"] == tp and x["scheme"] == scheme]
            if runs:
                out.append({"tp": tp, "scheme": scheme, "runs": runs})
    base = [x for x in launches if x["scheme"] == "none"]
    if base:
        out.append({"tp": base[0]["tp"], "scheme": "none", "runs": base})
    return out


def comparisons(table: list[dict]) -> list[dict]:
    by = {(r["tp"], r["scheme"]): [x["figures"] for x in r["runs"]] for r in table}
    out = []
    for tp in sorted({tp for tp, scheme in by if scheme != "none"}):
        if (tp, "shm") in by and (tp, "megatron") in by:
            ours, theirs = by[(tp, "shm")], by[(tp, "megatron")]
            out.append(
                {
                    "tp": tp,
                    **{k: compare([f[k] for f in ours], [f[k] for f in theirs]) for k in COMPARED},
                }
            )
    return out


def targets(table: list[dict], cold: bool, throttled: bool) -> list[dict]:
    """The issue's targets at TP=1 with cold reads: ours <= 0.5x Megatron's, ranges separated."""
    by = {(r["tp"], r["scheme"]): [x["figures"] for x in r["runs"]] for r in table}
    if (TARGET_TP, "shm") not in by or (TARGET_TP, "megatron") not in by:
        return []
    out = []
    for key, name in TARGETS:
        ours = [f[key] for f in by[(TARGET_TP, "shm")]]
        theirs = [f[key] for f in by[(TARGET_TP, "megatron")]]
        c = compare(ours, theirs)
        met = c["separated"] and c["ratio_of_medians"] is not None and c["ratio_of_medians"] <= TARGET_RATIO
        out.append(
            {
                "target": f"{name} <= {TARGET_RATIO}x Megatron's at TP={TARGET_TP}, ranges separated",
                "key": key,
                "ours": ours,
                "megatron": theirs,
                **c,
                # The most favourable to Megatron of the measured pairs: our worst over its best.
                "ratio_worst_case": max(ours) / min(theirs) if min(theirs) > 0 else None,
                "met": met,
                "condition_met": cold and throttled,
            }
        )
    return out


def _loads(launches: list[dict]) -> str:
    flat = [v for x in launches for v in (x["load_before"][0], x["load_after"][0])]
    return f"{min(flat):.2f}-{max(flat):.2f}" if flat else "-"


def layouts_md(part: dict, settings: dict) -> list[str]:
    table, s = part["rows"], settings
    lines = [
        f"## Layouts at {s['ranks']} ranks on one node: node loader vs Megatron's path",
        "",
        f"Storage: {part['storage']}. Corpus dropped from the page cache before each launch "
        f"({'cold' if s['cold'] else 'page cache kept: warm'} reads). "
        f"Micro-batch {s['mbs']} x {s['seq_length']} tokens per DP rank, {s['step_ms']:g} ms sleep per step "
        f"(no compute), {s['steps']} steps measured after {s['warmup']} of warm-up, "
        f"{s['repeats']} launch(es) per row; Megatron: {s['num_workers']} DataLoader workers on TP rank 0 "
        f"of each TP group; node loader: {s['node_workers']} producer worker(s), {s['slots']} slots. "
        f"Load average (1 min) {_loads([x for r in table for x in r['runs']])}.",
        "",
        "Each cell: min / median / max over the launches. Data wait: mean time in `next()` per rank "
        "and step. CPU: schedstat ns of every thread of the 8 rank process trees (DataLoader workers, "
        "producer and its workers included) over the measured steps, in microseconds per step; "
        "data-path CPU = that less the ranks-only launches' CPU over as long a window"
        + (
            f" ({part['baseline_cpu_us_per_s']:.0f} us of CPU per second, median)."
            if part.get("baseline_cpu_us_per_s") is not None
            else " (no baseline launch: not subtracted)."
        )
        + " RSS / PSS: smaps_rollup summed over the trees at the end of the window; 'added': less the "
        "same trees just before the loader was built. Device MiB: read from the slowed device by the "
        "launch's processes (blkio counters; 0 when unthrottled): a page fault on the memory-mapped .bin "
        "reads up to read_ahead_kb around the page; the producer advises each sample's exact byte ranges first.",
        "",
        "| TP x DP | path | " + " | ".join(name for _, name, _ in FIGURES) + " |",
        "|---" * (len(FIGURES) + 2) + "|",
    ]
    for row in table:
        figs = [x["figures"] for x in row["runs"]]
        cells = [three([f[k] for f in figs], d) for k, _, d in FIGURES]
        if row["scheme"] == "none":
            cells[FIGURES.index(("data_cpu_us_per_step", "data-path CPU us per step", 0))] = "(baseline)"
        dp = s["ranks"] // row["tp"]
        lines.append(f"| {row['tp']} x {dp} | {LABELS[row['scheme']]} | " + " | ".join(cells) + " |")
    comp = part["comparisons"]
    if comp:
        lines += [
            "",
            "Ours / Megatron (ratio of medians, stated only where the min-max ranges do not overlap):",
            "",
            "| TP | " + " | ".join(dict((k, n) for k, n, _ in FIGURES)[k] for k in COMPARED) + " |",
            "|---" * (len(COMPARED) + 1) + "|",
        ]
        for c in comp:
            lines.append(f"| {c['tp']} | " + " | ".join(ratio_cell(c[k]) for k in COMPARED) + " |")
    checks = [r for r in table if r["scheme"] == "megatron"]
    if checks:
        off = sorted({x["figures"]["processes_off_tp0"] for r in checks for x in r["runs"]})
        lines += [
            "",
            f"Megatron's path: processes under TP ranks other than 0 (upstream starts no DataLoader "
            f"there): {'/'.join(map(str, off))}.",
        ]
    if part["targets"]:
        lines += ["", "Targets (TP=1, cold reads from the slowed filesystem):", ""]
        for t in part["targets"]:
            verdict = ("met" if t["met"] else "missed") if t["condition_met"] else "not evaluated"
            if t["separated"] and t["ratio_of_medians"] is not None:
                worst = f"{t['ratio_worst_case']:.2f}x" if t["ratio_worst_case"] is not None else "-"
                how = f"separated, ratio of medians {t['ratio_of_medians']:.2f}x (ours' worst over Megatron's best {worst})"
            else:
                how = "not separated" + (
                    f" (fewer than {MIN_LAUNCHES} launches a side)"
                    if min(len(t["ours"]), len(t["megatron"])) < MIN_LAUNCHES
                    else ""
                )
            cond = (
                ""
                if t["condition_met"]
                else " (this run does not read cold from a slowed filesystem; figures only)"
            )
            lines.append(
                f"- {t['target']}: **{verdict}**{cond}: ours {three(t['ours'], 2)}, Megatron "
                f"{three(t['megatron'], 2)}; {how}."
            )
    for f in part.get("failures", []):
        lines += [
            "",
            f"**Launch failed** (repetition {f['repeat']}, TP={f['tp']}, {LABELS[f['scheme']]}, attempt "
            f"{f['attempt'] + 1}; run again, its figures are not in the table): {f['error']}",
            "",
        ] + [f"- {c}" for c in f["causes"]]
    notes = sorted(
        {f"{LABELS[r['scheme']]} TP={r['tp']}: {n}" for r in table for x in r["runs"] for n in x["notes"]}
    )
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    lines += [
        "",
        "<details><summary>Every launch, in the order run: load average (1, 5, 15 min) before and after</summary>",
        "",
        "| # | TP | path | load before | load after | launch s | wait ms per rank (rank 0..7) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, x in enumerate(sorted((x for r in table for x in r["runs"]), key=lambda x: x["index"])):
        waits = " ".join(f"{w:.1f}" for w in x["wait_ms_per_rank"])
        lines.append(
            f"| {i} | {x['tp']} | {LABELS[x['scheme']]} | {' '.join(f'{v:.2f}' for v in x['load_before'])} | "
            f"{' '.join(f'{v:.2f}' for v in x['load_after'])} | {x['launch_s']:.1f} | {waits} |"
        )
    lines += ["", "</details>"]
    return lines


def mask_md(mask: dict, settings: dict) -> list[str]:
    mib = mask["mask_bytes"] / 2**20
    peaks = [h["peak_kib"] / MIB for h in mask["hwm"]]
    kept = [h["kept_kib"] / MIB for h in mask["hwm"]]
    torch_peaks = [b / 2**20 for b in mask["torch_peak_bytes"]]
    ms = [h["s"] * 1e3 for h in mask["hwm"]]
    return [
        f"## Rank peak memory in next(), node loader, {settings['mbs']} x {settings['seq_length']}, "
        "create_attention_mask + reset_attention_mask",
        "",
        f"Mask {mask['mask_shape']} bool = {mib:.1f} MiB; target: peak <= 1.10 x mask. "
        f"{len(peaks)} calls per method, min / median / max; load average "
        f"{mask['load_average'][0]:.2f} before, {mask['load_average'][1]:.2f} after.",
        "",
        "| method | peak MiB | peak / mask | RSS MiB kept (the batch) | next() ms |",
        "|---|---:|---:|---:|---:|",
        f"| VmHWM rise above VmRSS before the call (all pages) | {three(peaks, 1)} | "
        f"{three([p / mib for p in peaks], 3)} | {three(kept, 1)} | {three(ms, 0)} |",
        f"| torch CPU allocator peak (tensors only) | {three(torch_peaks, 1)} | "
        f"{three([p / mib for p in torch_peaks], 3)} | - | - |",
    ]


def markdown(results: dict) -> str:
    s = results["settings"]
    lines = [
        "# Node loader benchmark",
        "",
        f"`{s['command']}` at {s.get('revision', 'an unrecorded revision')}: {s['cpus']} CPUs, corpus {s['corpus_bytes'] / 2**20:.0f} MiB, "
        f"{s['wall_s']:.0f} s in all. Method and caveats: the docstring of `benchmarks/data_loader/node.py`.",
        "",
    ]
    if "layouts" in results:
        lines += layouts_md(results["layouts"], s) + [""]
    if "mask" in results:
        lines += mask_md(results["mask"], s) + [""]
    for part, error in results["errors"].items():
        lines += [f"**{part} failed**: {error}", ""]
    return "\n".join(lines)
