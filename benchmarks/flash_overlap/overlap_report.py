"""Tables and target checks of the same-transport benchmark (``benchmarks.flash_overlap.overlap``): the
overlap measured with every method on one transport, so the comparison is of schedules, not of links.

Per block (or UP size) and regime, per method: step, the compute-only run, exposed = step - compute-only
of the same repeat (interleaved), each median (min-max) over repeats with the slowest rank standing for
a repeat, and the host's load average before / after. TP bounds are computed (``report.py``'s models).
UP steps are compared with DistributedAttention's on P2P pair by pair (``paired.py``).
"""

from __future__ import annotations

from typing import Any

from benchmarks.flash_overlap.paired import compare, verdict
from benchmarks.flash_overlap.report import _ms, _optional_ms, _ratio, _slowest, _stats

MIN_RATIO = 0.3
"""Targets apply where T_comm >= MIN_RATIO T_comp (T_comm on the shared P2P transport)."""
LABELS = {
    "megatron_core_p2p": "megatron-core, P2P",
    "te_split_p2p": "TE split, P2P",
    "domino_p2p": "DeepSpeed Domino (half-batch split), P2P",
    "flash_overlap": "Flash-Overlap, P2P",
    "flash_overlap_merged": "Flash-Overlap, merged GEMMs (compute_slices), P2P",
    "megatron_core": "megatron-core, gloo collectives (reference)",
    "chunked_4": "4-chunk slicing, gloo collectives (reference)",
    "distributed_attention_p2p": "DistributedAttention, P2P",
    "distributed_attention_sp_stream_p2p": "DistributedAttention with sp_stream overlap, P2P",
    "ulysses_flash_overlap": "Flash-Overlap UP, [q, k, v] weight, P2P",
    "ulysses_group_major": "Flash-Overlap UP, group-major weight, P2P",
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
            "device_per_step": recs[0].get("device_per_step", {}).get(name),
            # none on a stand-in device, which computes no values
            "max_abs_diff_vs_distributed_attention": recs[0]["max_abs_diff_vs_distributed_attention"].get(
                name
            ),
        }
        for name in recs[0]["times"]
        if name in LABELS
    }
    return {
        "sp": per_rank[0]["world_size"],
        "regime": regime,
        "sizes": recs[0]["sizes"],
        "t_comp_s": t_comp,
        "compute_only_device_per_step": recs[0].get("device_per_step", {}).get("compute_only"),
        "repeats_s": times,
        "stand_in": per_rank[0].get("device"),
        "t_comm_s": t_comm,
        "comm_over_comp": {t: v["median"] / t_comp["median"] for t, v in t_comm.items()},
        "load": [max(r["load"][i] for r in recs) for i in range(2)],
        "methods": methods,
    }


def _exposed(m: dict[str, Any]) -> str:
    return _ms(m["exposed_per_repeat_s"])


def _charged(device: dict[str, float] | None) -> str:
    """Device kernels | busy ms per step on a stand-in; n/a on the host."""
    return "n/a | n/a" if not device else f"{device['kernels']:.0f} | {device['busy_s'] * 1e3:.1f}"


def _diff(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1e}"


def markdown(title: str, tp: list[dict[str, Any]], up: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """One table per TP block / UP size and regime, of one launch."""
    lines = [f"### {title}", "", meta["note"], ""]
    lines += ["ms, median (min-max) over repeats; a repeat's figure is its slowest rank.", ""]
    for s in tp:
        lines += [
            f"**TP={s['tp']} {s['block']}, {s['regime']}** (ffn={s['ffn']}; load average before / after "
            f"{_load(s['load'])}): compute-only {_ms(s['t_comp_s'])}; T_comm {_ms(s['t_comm_s']['p2p'])} on P2P, "
            f"{_ms(s['t_comm_s']['collectives'])} on gloo's collectives; T_comm/T_comp "
            f"{s['comm_over_comp']['p2p']:.2f} (P2P), {s['comm_over_comp']['collectives']:.2f} (gloo); the "
            f"schedule's own bound, max(compute, communication) + one slice: "
            f"{s['schedule_bound_s'] * 1e3:.1f} (computed).",
            "",
            "| method | step | compute-only | exposed (step - compute-only) | bound (computed) | step / bound "
            "| device kernels / step | device busy / step | max abs diff vs megatron-core |",
            "|---|---|---|---|---:|---:|---:|---:|---:|",
        ]
        for name, m in s["methods"].items():
            diff = s["max_abs_diff_vs_megatron_core"].get(name)
            lines.append(
                f"| {LABELS.get(name, name)} | {_ms(m['step_s'])} | {_ms(s['t_comp_s'])} | {_exposed(m)} "
                f"| {_optional_ms(m['bound_s'])} | {_ratio(m['step_over_bound'])} "
                f"| {_charged(m['device_per_step'])} | {_diff(diff)} |"
            )
        lines.append(f"| compute-only twin | | | | | | {_charged(s['compute_only_device_per_step'])} | |")
        lines.append("")
    for s in up:
        z = s["sizes"]
        lines += [
            f"**UP SP={s['sp']}, {s['regime']}** (tokens {z['seq_per_rank']} per rank, batch {z['batch']}, "
            f"hidden {z['hidden']}, {z['heads']} heads x {z['head_dim']}, {z['kv_heads']} key/value heads; load average before / after "
            f"{_load(s['load'])}): compute-only {_ms(s['t_comp_s'])}; T_comm {_ms(s['t_comm_s']['p2p'])} on P2P, "
            f"{_ms(s['t_comm_s']['collectives'])} on gloo's all-to-all; T_comm/T_comp "
            f"{s['comm_over_comp']['p2p']:.2f} (P2P), {s['comm_over_comp']['collectives']:.2f} (gloo).",
            "",
            "| method | step | compute-only | exposed (step - compute-only) "
            "| step / DistributedAttention's (P2P), paired | device kernels / step | device busy / step "
            "| max abs diff vs DistributedAttention (gloo) |",
            "|---|---|---|---|---|---:|---:|---:|",
        ]
        reference = "distributed_attention_p2p"
        for name, m in s["methods"].items():
            ratio = (
                "baseline"
                if name == reference
                else verdict(compare("", s["repeats_s"], name, reference, "step"))
            )
            lines.append(
                f"| {LABELS[name]} | {_ms(m['step_s'])} | {_ms(s['t_comp_s'])} | {_exposed(m)} "
                f"| {ratio} | {_charged(m['device_per_step'])} | {_diff(m['max_abs_diff_vs_distributed_attention'])} |"
            )
        lines.append(f"| compute-only twin | | | | | {_charged(s['compute_only_device_per_step'])} | |")
        lines.append("")
    return "\n".join(lines)
