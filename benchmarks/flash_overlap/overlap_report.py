"""Tables and target checks of the same-transport benchmark (``benchmarks.flash_overlap.overlap``): the
overlap measured with every method on one transport, so the comparison is of schedules, not of links.

Per block (or UP size) and regime, per method: step, the compute-only run, exposed = step - compute-only
of the same repeat (interleaved), each median (min-max) over repeats with the slowest rank standing for
a repeat, and the host's load average before / after. TP bounds are computed (``report.py``'s models).
"""

from __future__ import annotations

from typing import Any

from benchmarks.flash_overlap.report import _ms, _slowest, _stats

TP_TARGETS = (("megatron_core_p2p", 0.5), ("te_split_p2p", 0.7))
"""Flash-Overlap's exposed communication <= this fraction of each baseline's (same transport)."""
UP_TARGET = 0.85
"""UP step <= this fraction of DistributedAttention's (same transport)."""
MIN_RATIO = 0.3
"""Targets apply where T_comm >= MIN_RATIO T_comp (T_comm on the shared P2P transport)."""
LABELS = {
    "megatron_core_p2p": "megatron-core, P2P",
    "te_split_p2p": "TE split, P2P",
    "flash_overlap": "Flash-Overlap, P2P",
    "megatron_core": "megatron-core, gloo collectives (reference)",
    "chunked_4": "4-chunk slicing, gloo collectives (reference)",
    "distributed_attention_p2p": "DistributedAttention, P2P",
    "ulysses_flash_overlap": "Flash-Overlap UP, P2P",
    "distributed_attention_gloo": "DistributedAttention, gloo all-to-all (reference)",
}


def _load(load: list[float] | None) -> str:
    return "n/a" if not load else f"{load[0]:.1f} / {load[1]:.1f}"


def up_summary(per_rank: list[dict[str, Any]], regime: str) -> dict[str, Any]:
    """One UP size and regime: T_comp, T_comm per transport, every method's step and exposed time."""
    recs = [r["regimes"][regime] for r in per_rank]
    times = {name: _slowest([rec["times"][name] for rec in recs]) for name in recs[0]["times"]}
    comp = times["compute_only"]
    t_comp = _stats(comp)
    t_comm = {t: _stats(times[f"comm_only_{t}"]) for t in ("p2p", "collectives")}
    methods = {
        name: {
            "step_s": _stats(times[name]),
            "exposed_per_repeat_s": _stats([a - b for a, b in zip(times[name], comp)]),
            "max_abs_diff_vs_distributed_attention": recs[0]["max_abs_diff_vs_distributed_attention"][name],
        }
        for name in ("distributed_attention_p2p", "ulysses_flash_overlap", "distributed_attention_gloo")
    }
    return {
        "sp": per_rank[0]["world_size"],
        "regime": regime,
        "sizes": recs[0]["sizes"],
        "t_comp_s": t_comp,
        "t_comm_s": t_comm,
        "comm_over_comp": {t: v["median"] / t_comp["median"] for t, v in t_comm.items()},
        "load": [max(r["load"][i] for r in recs) for i in range(2)],
        "methods": methods,
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def targets(tp: list[dict[str, Any]], up: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every target in every case where it applies, with its figures and hit / missed."""
    rows = []
    for s in tp:
        ratio = s["comm_over_comp"]["p2p"]
        ours = s["methods"]["flash_overlap"]["exposed_per_repeat_s"]["median"]
        for base, limit in TP_TARGETS:
            theirs = s["methods"][base]["exposed_per_repeat_s"]["median"]
            value = _ratio(ours, theirs)
            rows.append({
                "case": f"TP={s['tp']} {s['block']} {s['regime']}", "comm_over_comp": ratio,
                "target": f"exposed <= {limit}x {LABELS[base]}", "ours_s": ours, "baseline_s": theirs,
                "value": value, "applies": ratio >= MIN_RATIO,
                "hit": value is not None and value <= limit,
            })  # fmt: skip
    for s in up:
        ratio = s["comm_over_comp"]["p2p"]
        ours = s["methods"]["ulysses_flash_overlap"]["step_s"]["median"]
        theirs = s["methods"]["distributed_attention_p2p"]["step_s"]["median"]
        rows.append({
            "case": f"UP SP={s['sp']} {s['regime']}", "comm_over_comp": ratio,
            "target": f"step <= {UP_TARGET}x {LABELS['distributed_attention_p2p']}", "ours_s": ours,
            "baseline_s": theirs, "value": ours / theirs, "applies": ratio >= MIN_RATIO,
            "hit": ours / theirs <= UP_TARGET,
        })  # fmt: skip
    return rows


def _exposed(m: dict[str, Any]) -> str:
    return _ms(m["exposed_per_repeat_s"])


def markdown(title: str, tp: list[dict[str, Any]], up: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The targets first, then one table per TP block / UP size and regime."""
    lines = [f"### {title}", "", meta["note"], "", "**Targets** (where T_comm >= 0.3 T_comp on P2P):", ""]
    lines += ["| case | T_comm/T_comp (P2P) | target | ours ms | baseline ms | ratio | result |",
              "|---|---:|---|---:|---:|---:|---|"]  # fmt: skip
    for t in targets(tp, up):
        value = "n/a (baseline exposed <= 0)" if t["value"] is None else f"{t['value']:.2f}"
        result = ("hit" if t["hit"] else "missed") if t["applies"] else "n/a (T_comm < 0.3 T_comp)"
        lines.append(
            f"| {t['case']} | {t['comm_over_comp']:.2f} | {t['target']} | {t['ours_s'] * 1e3:.1f} "
            f"| {t['baseline_s'] * 1e3:.1f} | {value} | {result} |"
        )
    lines += ["", "ms, median (min-max) over repeats; a repeat's figure is its slowest rank.", ""]
    for s in tp:
        lines += [
            f"**TP={s['tp']} {s['block']}, {s['regime']}** (ffn={s['ffn']}; load average before / after "
            f"{_load(s['load'])}): compute-only {_ms(s['t_comp_s'])}; T_comm {_ms(s['t_comm_s']['p2p'])} on P2P, "
            f"{_ms(s['t_comm_s']['collectives'])} on gloo's collectives; T_comm/T_comp "
            f"{s['comm_over_comp']['p2p']:.2f} (P2P), {s['comm_over_comp']['collectives']:.2f} (gloo).",
            "",
            "| method | step | compute-only | exposed (step - compute-only) | bound (computed) | step / bound "
            "| max abs diff vs megatron-core |",
            "|---|---|---|---|---:|---:|---:|",
        ]
        for name, m in s["methods"].items():
            diff = s["max_abs_diff_vs_megatron_core"].get(name)
            lines.append(
                f"| {LABELS.get(name, name)} | {_ms(m['step_s'])} | {_ms(s['t_comp_s'])} | {_exposed(m)} "
                f"| {m['bound_s'] * 1e3:.1f} | {m['step_over_bound']:.2f} | {'n/a' if diff is None else f'{diff:.1e}'} |"
            )
        lines.append("")
    for s in up:
        z = s["sizes"]
        lines += [
            f"**UP SP={s['sp']}, {s['regime']}** (tokens {z['seq_per_rank']} per rank, batch {z['batch']}, "
            f"hidden {z['hidden']}, {z['heads']} heads x {z['head_dim']}; load average before / after "
            f"{_load(s['load'])}): compute-only {_ms(s['t_comp_s'])}; T_comm {_ms(s['t_comm_s']['p2p'])} on P2P, "
            f"{_ms(s['t_comm_s']['collectives'])} on gloo's all-to-all; T_comm/T_comp "
            f"{s['comm_over_comp']['p2p']:.2f} (P2P), {s['comm_over_comp']['collectives']:.2f} (gloo).",
            "",
            "| method | step | compute-only | exposed (step - compute-only) | step / DistributedAttention (P2P) "
            "| max abs diff vs DistributedAttention (gloo) |",
            "|---|---|---|---|---:|---:|",
        ]
        reference = s["methods"]["distributed_attention_p2p"]["step_s"]["median"]
        for name, m in s["methods"].items():
            lines.append(
                f"| {LABELS[name]} | {_ms(m['step_s'])} | {_ms(s['t_comp_s'])} | {_exposed(m)} "
                f"| {m['step_s']['median'] / reference:.2f} | {m['max_abs_diff_vs_distributed_attention']:.1e} |"
            )
        lines.append("")
    return "\n".join(lines)
