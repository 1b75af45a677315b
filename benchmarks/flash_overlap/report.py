"""Figures from the ranks' records: per block and regime, every method's step, exposed communication,
bound and timeline.

Method in full: benchmarks/results/methods.md, `benchmarks.flash_overlap.report`.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.flash_overlap.chunked import CHUNKS
from benchmarks.flash_overlap.paired import compare_all, verdict
from benchmarks.flash_overlap.probes import TRANSFERS_PER_PAIR

TRANSPORT = {
    "megatron_core": "collectives",
    f"chunked_{CHUNKS}": "collectives",
    "flash_overlap": "p2p",
    "flash_overlap_merged": "p2p",
    "megatron_core_p2p": "p2p",
    "te_split_p2p": "p2p",
    "domino_p2p": "p2p",
}
"""Each method's transport: gloo's collectives or the P2P exchange."""
SCHEDULE = {
    "flash_overlap": ("sliced", "sliced", "sliced"),
    "te_split_p2p": ("sliced", "pipelined", "sliced"),
    "megatron_core": ("whole", "whole", "whole"),
    "megatron_core_p2p": ("whole", "whole", "whole"),
    f"chunked_{CHUNKS}": ("pipelined", "pipelined", "pipelined"),
}
"""(column fwd, row fwd, row dgrad) schedule per method; every column backward is megatron-core's bulk.
Domino's half-batch schedule has no model here: it has no computed bound."""


def _slowest(per_rank: list[list[float]]) -> list[float]:
    return [max(column) for column in zip(*per_rank)]


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _extra(method: str, gemms: dict[str, dict], P: float, n: int) -> float:
    """What the method's schedule leaves exposed beyond T_comp, from its model (module docstring)."""
    p, k, total = P / (n - 1), CHUNKS, 0.0
    exposed = {
        "sliced": lambda gemm: (n - 1) * max(0.0, p - gemm / n),
        "pipelined": lambda gemm: P / k + (k - 1) * max(0.0, (P - gemm) / k),
        "whole": lambda gemm: P,
    }
    column_fwd, row_fwd, row_dgrad = SCHEDULE[method]
    for g in gemms.values():
        if g["column"]:  # every method hides the column backward's transfers behind its two GEMMs
            total += exposed[column_fwd](g["fwd"]) + max(0.0, P - g["dgrad"]) + max(0.0, P - g["wgrad"])
        else:
            total += exposed[row_fwd](g["fwd"]) + exposed[row_dgrad](g["dgrad"])
    return total


def schedule_bound(t_comp: float, t_comm: float, gemms: dict[str, dict], p: float, n: int) -> float:
    """What a perfect slicing schedule takes: the longer of compute and communication, plus the one
    slice that cannot overlap (the first transfer or the last GEMM slice, whichever is longer)."""
    largest_slice = max(max(g["fwd"], g["dgrad"], g["wgrad"]) / n for g in gemms.values())
    return max(t_comp, t_comm) + max(p, largest_slice)


def summarize(per_rank: list[dict[str, Any]], regime: str, block: str) -> dict[str, Any]:
    """One block in one regime: T_comp, T_comm per transport, and every method's figures."""
    n = per_rank[0]["world_size"]
    recs = [r["regimes"][regime]["blocks"][block] for r in per_rank]
    times = {name: _slowest([rec["times"][name] for rec in recs]) for name in recs[0]["times"]}
    t_comp = statistics.median(times["compute_only"])
    transfers = recs[0]["pairs"] * len(TRANSFERS_PER_PAIR)
    t_comm = {t: statistics.median(times[f"comm_only_{t}"]) for t in ("p2p", "collectives")}
    gemms = recs[0]["gemms"]
    layers = recs[0].get("layers", 1)
    P = t_comm["p2p"] / transfers  # one transfer of the block on P2P
    methods = {}
    for name, transport in TRANSPORT.items():
        if name not in times:
            continue
        step = _stats(times[name])
        profiled = [rec["profiled"][name] for rec in recs if name in rec["profiled"]]
        slow = max(profiled, key=lambda p: p["step_s"], default=None)
        extra = _extra(name, gemms, t_comm[transport] / transfers, n) if name in SCHEDULE else None
        bound = None if extra is None else t_comp + layers * extra
        methods[name] = {
            "transport": transport,
            "step_s": step,
            "exposed_s": step["median"] - t_comp,
            # Per repeat: the step minus the compute-only run of the same repeat (interleaved).
            "exposed_per_repeat_s": _stats([a - b for a, b in zip(times[name], times["compute_only"])]),
            "exposed_pct_of_t_comm": 100 * (step["median"] - t_comp) / t_comm[transport],
            "in_step_exposed_s": None if slow is None else slow["step_s"] - slow["compute_s"],
            "profiled_step_s": None if slow is None else slow["step_s"],
            "bound_s": bound,
            "step_over_bound": None if bound is None else step["median"] / bound,
            "timeline": [p["spans"] for p in profiled],
            # on a stand-in: device kernels and busy seconds per step (rank 0's median), else None
            "device_per_step": recs[0].get("device_per_step", {}).get(name),
        }
    return {
        "block": block,
        "regime": regime,
        "tp": n,
        "ffn": per_rank[0]["regimes"][regime]["ffn"],
        "t_comp_s": _stats(times["compute_only"]),
        "compute_only_device_per_step": recs[0].get("device_per_step", {}).get("compute_only"),
        "repeats_s": times,
        "stand_in": per_rank[0].get("device"),
        "t_comm_s": {t: _stats(times[f"comm_only_{t}"]) for t in t_comm},
        "comm_over_comp": {t: v / t_comp for t, v in t_comm.items()},
        "schedule_bound_s": schedule_bound(t_comp, t_comm["p2p"], gemms, P / (n - 1), n),
        "gemms": gemms,
        "methods": methods,
        "max_abs_diff_vs_megatron_core": recs[0].get("max_abs_diff_vs_megatron_core", {}),
        "load": [max(r["load"][i] for r in recs) for i in range(2)] if "load" in recs[0] else None,
    }


def _ms(s: dict[str, float]) -> str:
    return f"{s['median'] * 1e3:.1f} ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f})"


def case_name(s: dict[str, Any]) -> str:
    """A summary's case in the paired list: ``tp2-mlp-balanced``."""
    return f"tp{s['tp']}-{s['block']}-{s['regime']}"


def paired_vs_megatron_core(s: dict[str, Any]) -> list[dict[str, Any]]:
    """Every other method against megatron-core's linears (gloo's collectives), step and exposed."""
    pairs = [(name, "megatron_core") for name in s["methods"] if name != "megatron_core"]
    return compare_all(case_name(s), s["repeats_s"], pairs)


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _optional_ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f}"


def markdown(title: str, summaries: list[dict[str, Any]], args: dict[str, Any]) -> str:
    """One table per block and regime."""
    lines = [
        f"### {title}",
        "",
        f"Sizes: sequence {args['seq_per_rank']} per rank, batch {args['batch']}, hidden {args['hidden']}, "
        f"{args['heads']} heads; {args['steps']} timed steps after {args['warmup']} warm-up; ms, median "
        "(min-max) of the slowest rank per step.",
        "",
    ]
    for s in summaries:
        ratio = s["comm_over_comp"]
        lines += [
            f"**{s['block']}, {s['regime']}** (TP={s['tp']}, ffn={s['ffn']}): T_comp {_ms(s['t_comp_s'])} "
            f"(compute only); T_comm {_ms(s['t_comm_s']['p2p'])} on P2P, {_ms(s['t_comm_s']['collectives'])} "
            f"on gloo's collectives (transfers only); T_comm/T_comp {ratio['p2p']:.2f} (P2P), "
            f"{ratio['collectives']:.2f} (collectives).",
            "",
            "| method | step | exposed (step - T_comp) | % of own T_comm | in-step exposed (profiled step) "
            "| own bound | step / bound | step / megatron-core's (paired) | exposed / megatron-core's (paired) |",
            "|---|---|---:|---:|---:|---:|---:|---|---|",
        ]
        paired = {(e["variant"], e["metric"]): verdict(e) for e in paired_vs_megatron_core(s)}
        for name, m in s["methods"].items():
            lines.append(
                f"| {name} | {_ms(m['step_s'])} | {m['exposed_s'] * 1e3:.1f} | {m['exposed_pct_of_t_comm']:.0f} "
                f"| {_optional_ms(m['in_step_exposed_s'])} | {_optional_ms(m['bound_s'])} | {_ratio(m['step_over_bound'])} "
                f"| {paired.get((name, 'step'), 'baseline')} | {paired.get((name, 'exposed'), 'baseline')} |"
            )
        lines.append("")
    return "\n".join(lines)


def timeline_png(path: Path, title: str, timeline: list[list[tuple]]) -> None:
    """The profiled step's compute ops per rank (GEMMs blue, the rest grey); gaps are waits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.7 * len(timeline)))
    for rank, spans in enumerate(timeline):
        for name, start, end in spans:
            gemm = name in ("mm", "addmm", "bmm", "baddbmm")
            ax.barh(rank, end - start, left=start, height=0.6, color="#1f77b4" if gemm else "#7f7f7f")
    ax.set_yticks(range(len(timeline)), [f"rank {r}" for r in range(len(timeline))])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the profiled step's start (blue GEMMs, grey other compute, gaps waits)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
