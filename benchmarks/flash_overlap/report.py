"""Figures from the ranks' records: per-method summary, model bounds, markdown table, timelines.

Per step, the slowest rank stands for the step (its step time, and the compute recorded inside
that same step on that rank); a method's figure is the median over steps (min/max for the step).

Bounds, with N ranks and per GEMM i: c_i = T_comp,i / N (one sequence slice), p_i = one slice's
transfer (measured comm-only, T_comm,i / (N-1)), plus the unsliced gelu g:
  flash_overlap      sum_i c_i + (N-1) max(c_i, p_i)                 + g
  chunked_k          sum_i c'_i + p'_i + (k-1) max(c'_i, p'_i)       + g,  c' = T_comp,i/k, p' = T_comm,i/k
  no overlap         T_comp + T_comm
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.flash_overlap.schedules import CHUNKS

GEMMS = ("fc1", "fc2")
_COLLECTIVE = {"fc1": "all-gather", "fc2": "reduce-scatter"}


def _slowest(per_rank_runs: list[list[dict]]) -> list[tuple[int, dict]]:
    steps = len(per_rank_runs[0])
    return [
        max(((r, runs[i]) for r, runs in enumerate(per_rank_runs)), key=lambda rs: rs[1]["step"])
        for i in range(steps)
    ]


def _median_event_time(per_rank_runs: list[list[dict]], kind: str, prefix: str) -> float:
    """Median over steps of the slowest rank's summed duration of events whose label starts with prefix."""
    return statistics.median(
        sum(b - a for k, label, a, b in run["events"] if k == kind and label.startswith(prefix))
        for _, run in _slowest(per_rank_runs)
    )


def summarize(per_rank: list[dict[str, Any]], regime: str) -> dict[str, Any]:
    """Summary of one regime: sizes, T_comp, T_comm, c/p per GEMM, and every method's figures."""
    n = per_rank[0]["world_size"]
    runs = {
        name: [r["regimes"][regime]["runs"][name] for r in per_rank]
        for name in per_rank[0]["regimes"][regime]["runs"]
    }
    t_comp = statistics.median(run["step"] for _, run in _slowest(runs["compute_only"]))
    t_comm = statistics.median(run["step"] for _, run in _slowest(runs["comm_only"]))
    gelu = _median_event_time(runs["compute_only"], "compute", "gelu")
    c = {g: _median_event_time(runs["compute_only"], "compute", g) / n for g in GEMMS}
    p = {g: _median_event_time(runs["comm_only"], "wait", _COLLECTIVE[g]) / (n - 1) for g in GEMMS}
    k = CHUNKS
    bounds = {
        "flash_overlap": gelu + sum(c[g] + (n - 1) * max(c[g], p[g]) for g in GEMMS),
        f"chunked_{k}": gelu
        + sum((n * c[g] + (n - 1) * p[g]) / k + (k - 1) * max(n * c[g], (n - 1) * p[g]) / k for g in GEMMS),
        "p2p_sequential": t_comp + t_comm,
        "gloo_collectives": t_comp + t_comm,
    }
    methods = {}
    for name, bound in bounds.items():
        picked = _slowest(runs[name])
        steps = [run["step"] for _, run in picked]
        exposed = [run["step"] - run["compute"] for _, run in picked]
        median_index = sorted(range(len(steps)), key=steps.__getitem__)[len(steps) // 2]
        step = statistics.median(steps)
        methods[name] = {
            "step_s": step,
            "step_min_s": min(steps),
            "step_max_s": max(steps),
            "compute_in_step_s": statistics.median(run["compute"] for _, run in picked),
            "exposed_comm_s": statistics.median(exposed),
            "exposed_pct_of_t_comm": 100 * statistics.median(exposed) / t_comm,
            "step_over_max_comp_comm": step / max(t_comp, t_comm),
            "bound_s": bound,
            "step_over_bound": step / bound,
            "timeline": [per_rank_run[median_index]["events"] for per_rank_run in runs[name]],
        }
    info = per_rank[0]["regimes"][regime]
    return {
        "regime": regime,
        "tp": n,
        "ffn": info["ffn"],
        "t_comp_s": t_comp,
        "t_comm_s": t_comm,
        "gelu_s": gelu,
        "c_s": c,
        "p_s": p,
        "methods": methods,
        "probe": {k: v for k, v in info.items() if k.startswith("probe")},
    }


def markdown(title: str, summaries: list[dict[str, Any]], args: dict[str, Any]) -> str:
    """One table per regime."""
    ms = 1e3
    lines = [
        f"### {title}",
        "",
        f"Sizes: sequence {args['seq_per_rank']} per rank, batch {args['batch']}, hidden {args['hidden']}; "
        f"{args['steps']} timed steps after {args['warmup']} warm-up, median (min-max) of the slowest rank per step.",
        "",
    ]
    for s in summaries:
        c, p = s["c_s"], s["p_s"]
        lines += [
            f"**{s['regime']}** (TP={s['tp']}, ffn={s['ffn']}): T_comp {s['t_comp_s'] * ms:.1f} ms (compute only), "
            f"T_comm {s['t_comm_s'] * ms:.1f} ms (P2P exchanges only); per slice c = {c['fc1'] * ms:.1f} / "
            f"{c['fc2'] * ms:.1f} ms, p = {p['fc1'] * ms:.1f} / {p['fc2'] * ms:.1f} ms, c/p = {c['fc1'] / p['fc1']:.2f} / "
            f"{c['fc2'] / p['fc2']:.2f} (fc1 / fc2); gelu {s['gelu_s'] * ms:.1f} ms.",
            "",
            "| method | step ms (min-max) | compute in step ms | exposed comm ms | exposed % of T_comm "
            "| step / max(T_comp, T_comm) | own bound ms | step / own bound |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, m in s["methods"].items():
            lines.append(
                f"| {name} | {m['step_s'] * ms:.1f} ({m['step_min_s'] * ms:.1f}-{m['step_max_s'] * ms:.1f}) "
                f"| {m['compute_in_step_s'] * ms:.1f} | {m['exposed_comm_s'] * ms:.1f} | {m['exposed_pct_of_t_comm']:.1f} "
                f"| {m['step_over_max_comp_comm']:.2f} | {m['bound_s'] * ms:.1f} | {m['step_over_bound']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def timeline_png(path: Path, title: str, timeline: list[list[tuple]]) -> None:
    """Compute slices (blue shades per GEMM, grey gelu) and waits (red) per rank, for the median step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"fc1": "#1f77b4", "fc2": "#2ca02c", "gelu": "#7f7f7f"}
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.7 * len(timeline)))
    for rank, events in enumerate(timeline):
        for kind, label, start, end in events:
            if kind == "wait":
                colour = "#d62728"
            else:
                colour = next(v for key, v in colours.items() if label.startswith(key))
            ax.barh(
                rank,
                (end - start) * 1e3,
                left=start * 1e3,
                height=0.6,
                color=colour,
                edgecolor="black",
                linewidth=0.3,
            )
    ax.set_yticks(range(len(timeline)), [f"rank {r}" for r in range(len(timeline))])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's start (after a barrier)")
    ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=v) for v in (*colours.values(), "#d62728")]
    ax.legend(handles, [*colours, "wait"], fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
