"""One page from several runs of ``benchmarks.flash_overlap.overlap --preset``: per TP degree and per
SP degree, what the schedule buys on the same transport, what the transport alone buys, and what the
slicing costs the device, each paired comparison with its 95 % interval.

    python -m benchmarks.flash_overlap.summary --tp RUN.json ... --up RUN.json ... --out PAGE.md

``--tp`` files give their TP cases, ``--up`` files their UP cases (a run of both sizes may be given
to either or both). Method in full: benchmarks/results/methods.md, `benchmarks.flash_overlap.summary`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.flash_overlap.paired import compare, verdict

TP_ROWS = (
    ("flash_overlap", "megatron_core_p2p", "exposed"),
    ("flash_overlap", "megatron_core_p2p", "step"),
    ("flash_overlap", "te_split_p2p", "step"),
    ("flash_overlap", "domino_p2p", "step"),
    ("megatron_core_p2p", "megatron_core", "step"),
)
"""(variant, baseline, metric) of the TP table, in its column order; the last is the transport alone."""
UP_ROWS = (
    ("ulysses_group_major", "distributed_attention_p2p", "step"),
    ("ulysses_group_major", "distributed_attention_sp_stream_p2p", "step"),
    ("ulysses_flash_overlap", "distributed_attention_p2p", "step"),
    ("distributed_attention_p2p", "distributed_attention_gloo", "step"),
)
"""(variant, baseline, metric) of the UP table; the last is the transport alone."""


def _cell(case: str, repeats: dict[str, list[float]], row: tuple[str, str, str]) -> str:
    variant, baseline, metric = row
    if variant not in repeats or baseline not in repeats:
        return "not run"
    return verdict(compare(case, repeats, variant, baseline, metric))


def _charged(summary: dict[str, Any], method: str) -> str:
    """Device kernels and busy ms per step of ``method`` over the compute-only twin's."""
    ours, twin = summary["methods"][method].get("device_per_step"), summary["compute_only_device_per_step"]
    if not ours or not twin:
        return "n/a"
    return f"{ours['kernels']:.0f} / {twin['kernels']:.0f}, +{(ours['busy_s'] - twin['busy_s']) * 1e3:.1f} ms"


def _merged(run: dict[str, Any], s: dict[str, Any], case: str) -> str:
    """Ours with fewer, larger GEMMs (``--compute-slices``) over ours' default, where it ran."""
    gemms = run.get("compute_slices", {}).get(f"tp{s['tp']}", {}).get("gemms", 0)
    if not gemms:
        return "not run"
    return f"{gemms} GEMMs: " + _cell(case, s["repeats_s"], ("flash_overlap_merged", "flash_overlap", "step"))


def _contention(s: dict[str, Any]) -> float:
    """The case's contention factor (0 off the stand-in)."""
    return (s.get("stand_in") or {}).get("contention", 0.0)


def _device(run: dict[str, Any], s: dict[str, Any], case: str) -> str:
    contention = _contention(s)
    return f"{run['device']} (dilation {run['dilation'][case]:g}" + (
        f", contention {contention:g})" if contention else ")"
    )


def _row(
    run: dict[str, Any], s: dict[str, Any], case: str, before: list[str], rows: tuple, after: list[str]
) -> str:
    """One case's row: case, device, ``before``, the paired comparisons of ``rows``, ``after``."""
    cells = [case, _device(run, s, case.split("-")[0]), *before]
    cells += [_cell(case, s["repeats_s"], row) for row in rows]
    return "| " + " | ".join([*cells, *after]) + " |"


def _by_degree(runs: list[dict[str, Any]], kind: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Every (run, case) of ``kind`` ("tp" or "up"), by TP or SP degree, then contention."""
    degree = "tp" if kind == "tp" else "sp"
    return sorted(
        ((run, s) for run in runs for s in run[kind]),
        key=lambda pair: (pair[1][degree], _contention(pair[1])),
    )


def tp_table(runs: list[dict[str, Any]]) -> list[str]:
    """One row per TP case: the paired comparisons of ``TP_ROWS``, the bound and the device's cost."""
    lines = [
        "| case | device | T_comm / T_comp (P2P) | exposed / megatron-core's (P2P) | step / megatron-core's (P2P) "
        "| step / TE split's (P2P) | step / Domino's (P2P) | transport alone: megatron-core P2P / gloo, step "
        "| ours / its bound | ours' kernels / twin's, device busy beyond the twin "
        "| fewer GEMMs per collective: step / ours' default |",
        "|---|---|---:|---|---|---|---|---|---:|---|---|",
    ]
    for run, s in _by_degree(runs, "tp"):
        bound = s["methods"]["flash_overlap"]["step_s"]["median"] / s["schedule_bound_s"]
        before = [f"{s['comm_over_comp']['p2p']:.2f}"]
        case = f"tp{s['tp']}-{s['block']}"
        after = [f"{bound:.2f}", _charged(s, "flash_overlap"), _merged(run, s, case)]
        lines.append(_row(run, s, case, before, TP_ROWS, after))
    return lines


def up_table(runs: list[dict[str, Any]]) -> list[str]:
    """One row per UP case: the paired comparisons of ``UP_ROWS`` and the device's cost."""
    lines = [
        "| case | device | tokens per rank | T_comm / T_comp (P2P) | group-major step / DistributedAttention's (P2P) "
        "| same / with sp_stream (P2P) | [q, k, v] weight step / DistributedAttention's (P2P) "
        "| transport alone: DistributedAttention P2P / gloo, step | group-major kernels / twin's, device busy beyond the twin |",
        "|---|---|---:|---:|---|---|---|---|---|",
    ]
    for run, s in _by_degree(runs, "up"):
        before = [
            f"{s['sizes']['seq_per_rank']} x {s['sizes']['batch']}",
            f"{s['comm_over_comp']['p2p']:.2f}",
        ]
        after = [_charged(s, "ulysses_group_major")]
        lines.append(_row(run, s, f"sp{s['sp']}-ulysses", before, UP_ROWS, after))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp", type=Path, nargs="*", default=[], help="runs whose TP cases to tabulate")
    parser.add_argument("--up", type=Path, nargs="*", default=[], help="runs whose UP cases to tabulate")
    parser.add_argument("--out", type=Path, required=True, help="the markdown page to write")
    args = parser.parse_args(argv)
    if not args.tp and not args.up:
        parser.error("give at least one run: --tp RUN.json and/or --up RUN.json")
    tp = [json.loads(p.read_text()) for p in args.tp]
    up = [json.loads(p.read_text()) for p in args.up]
    sources = ", ".join(dict.fromkeys(p.name for p in [*args.tp, *args.up]))  # each file once
    page = [
        "Flash-Overlap on the compute stand-in, from the preset runs (measured; this page: "
        f"`python -m benchmarks.flash_overlap.summary`, from {sources}). Every ratio is ours (or the "
        "row's variant) over the baseline, the median of paired repeats with its 95 % interval; "
        '"not separated" where the interval holds 1. Exposed = step - the compute-only twin of the same repeat.',
        "",
        *(["**TP/SP linears**, a stack of the preset's layers:", "", *tp_table(tp), ""] if tp else []),
        *(
            ["**Ulysses attention** (UP), 32 heads x 128, 8 key/value heads:", "", *up_table(up), ""]
            if up
            else []
        ),
    ]
    args.out.write_text("\n".join(page))
    print("\n".join(page))


if __name__ == "__main__":
    main()
