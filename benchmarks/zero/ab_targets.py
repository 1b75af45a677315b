"""Hierarchical ZeRO's targets, judged on the emulated cluster's A/B runs on a device stand-in, and
where each step's time went by its traced step.

  python -m benchmarks.zero.ab_targets                 (every ab_*_mi250x*.json in the results)
  python -m benchmarks.zero.ab_targets A.json B.json   (these runs)

Reads what ``python -m benchmarks.zero.ab --device ...`` recorded; measures nothing itself. Targets:

- ours faster than hpZ at its best size, and than full ZeRO++, each paired 95 % interval below 1;
- ours' step within 1.10x of the compute-only step (the ceiling) wherever hpZ's exposed time
  (its step less the compute-only step) is at least 20 % of its step;
- the cost model predicts every variant within 15 %.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.zero.run import OUT

CEILING = 1.10
EXPOSED_SHARE = 0.20
MODEL_TOLERANCE = 0.15
ZEROPP = "zero++ (hpZ + qwZ + qgZ)"
QUANTIZED = "ours, quantized hops"


def _median(row: dict[str, Any]) -> float:
    return statistics.median(row["step_s"])


def _pair(result: dict[str, Any], variant: str, baseline: str) -> dict[str, Any] | None:
    return next((p for p in result["paired"] if (p["variant"], p["baseline"]) == (variant, baseline)), None)


def _ratio(pair: dict[str, Any] | None) -> str:
    if pair is None:
        return "not run"
    lo, hi = pair["ci95"]
    verdict = "met" if hi < 1 else "missed" if lo > 1 else "not separated"
    return f"{pair['ratio']:.3f} [{lo:.3f}, {hi:.3f}] {verdict}"


def judge(result: dict[str, Any]) -> dict[str, Any]:
    """One run's figures against the targets (see the module docstring)."""
    rows = {row["variant"]: row for row in result["variants"] if row["ran"]}
    compute = result["compute_only_step_s"]
    hpz = min((name for name in rows if name.startswith("hpZ")), key=lambda name: _median(rows[name]))
    exposed = (_median(rows[hpz]) - compute) / _median(rows[hpz])
    errors = {
        name: row["predicted_step_s"] / _median(row) - 1
        for name, row in rows.items()
        if "predicted_step_s" in row
    }
    worst = max(errors, key=lambda name: abs(errors[name]))
    return {
        "regime": result.get("regime", "frontier"),
        "nodes": result["spec"]["nodes"],
        "ranks": result["spec"]["nodes"]
        * result["spec"]["packages_per_node"]
        * result["spec"]["ranks_per_package"],
        "contention": result["contention"],
        "compute_only_s": compute,
        "hpz_best": hpz,
        "ours_over_hpz": _pair(result, "ours", hpz),
        "ours_over_zeropp": _pair(result, "ours", ZEROPP),
        "quantized_over_zeropp": _pair(result, QUANTIZED, ZEROPP),
        "hpz_exposed_share": exposed,
        "ours_over_compute": _median(rows["ours"]) / compute,
        "ceiling_applies": exposed >= EXPOSED_SHARE,
        "worst_model_error": (worst, errors[worst]),
        "nic_mib_per_step": {name: row["nic_mib_per_step"] for name, row in rows.items()},
        "steps_s": {name: _median(row) for name, row in rows.items()},
        "trace": result.get("trace", {}),
    }


def uniformly_slowed(run: dict[str, Any], judged: list[dict[str, Any]]) -> bool | None:
    """Whether a run at contention c > 0 slowed every device op by (1 + c): each variant's traced
    device time exactly (1 + c) times its time in the 0 % run of the same regime and nodes, as the
    stand-in gave when it counted a blocking collective as in flight for the rest of the run. None:
    no traced variant to tell by."""
    base = next(
        (
            j
            for j in judged
            if j["contention"] == 0 and (j["regime"], j["nodes"]) == (run["regime"], run["nodes"])
        ),
        None,
    )
    if not run["contention"] or base is None:
        return False
    shared = [v for v in run["trace"] if v in base["trace"]]
    if not shared:
        return None
    return all(
        abs(run["trace"][v]["device_busy_s"] / base["trace"][v]["device_busy_s"] - (1 + run["contention"]))
        < 1e-3
        for v in shared
    )


def _targets_table(judged: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| regime | nodes (ranks) | contention | ours / hpZ at its best | ours / full ZeRO++ | ours quantized / full ZeRO++ "
        "| hpZ exposed | ours / compute-only (target <= 1.10 where hpZ exposed >= 20 %) | worst model error (target 15 %) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for j in judged:
        ceiling = j["ours_over_compute"]
        verdict = ("met" if ceiling <= CEILING else "missed") if j["ceiling_applies"] else "does not apply"
        name, error = j["worst_model_error"]
        uniform = uniformly_slowed(j, judged)
        contention = f"{j['contention']:g}" + {True: " (every op slowed)", None: " (untraced)"}.get(
            uniform, ""
        )
        lines.append(
            f"| {j['regime']} | {j['nodes']} ({j['ranks']}) | {contention} | {j['hpz_best']}: {_ratio(j['ours_over_hpz'])} "
            f"| {_ratio(j['ours_over_zeropp'])} | {_ratio(j['quantized_over_zeropp'])} | {j['hpz_exposed_share']:.0%} "
            f"| {ceiling:.3f} {verdict} | {name} {error:+.1%} {'met' if abs(error) <= MODEL_TOLERANCE else 'missed'} |"
        )
    return lines


def _where_table(judged: list[dict[str, Any]]) -> list[str]:
    """Per run and variant: the step less the compute-only step, split by the traced step."""
    lines = [
        "| regime | nodes | contention | variant | step (s) | NIC MiB/step | device ops | device busy beyond compute-only (s) "
        "| device idle (s) | gather wait on the wire, by link (s) | reduce-scatters on the wire (s) | hooks' host time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for j in judged:
        for name, step in j["steps_s"].items():
            t = j["trace"].get(name)
            if t is None:
                continue
            wire = {k: v for k, v in t["gather_wait_by_level"].items() if k not in ("none", "device")}
            lines.append(
                f"| {j['regime']} | {j['nodes']} | {j['contention']:g} | {name} | {step:.2f} | {j['nic_mib_per_step'][name]:.2f} "
                f"| {t.get('device_ops', 0):.0f} | {t['device_busy_s'] - j['compute_only_s']:+.2f} | {t['step_s'] - t['device_busy_s']:.2f} "
                f"| {', '.join(f'{k} {v:.2f}' for k, v in sorted(wire.items())) or '-'} "
                f"| {sum(t['reduce_busy_by_level'].values()):.2f} | {t['hooks_host_s']:.2f} |"
            )
    return lines


def markdown(judged: list[dict[str, Any]], sources: list[Path]) -> str:
    lines = [
        "Hierarchical ZeRO's targets on the emulated cluster, compute on the MI250X stand-in (measured: "
        "paired steps of `python -m benchmarks.zero.ab --device mi250x`; this page: "
        f"`python -m benchmarks.zero.ab_targets`, from {', '.join(p.name for p in sources)}).",
        "",
        "Ratios are the variant's step over the baseline's, median of paired steps, with the paired 95 % interval.",
        "",
        *_targets_table(judged),
        "",
        "Every op slowed: a run whose variants' device time is exactly (1 + c) times the 0 % run's, a "
        "uniformly slower device rather than contention (a stand-in that counted gloo's blocking "
        "reduce-scatter as in flight for the rest of the run; the stand-in counts no blocking call). "
        "Untraced: no traced step to tell by.",
        "",
        "Where each step went, from one traced step per variant after the paired ones (the mean rank; columns "
        "defined in `deepspeed_ext/zero/tools/ab/trace_report.py`):",
        "",
        *_where_table(judged),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "results", nargs="*", type=Path, help="A/B result JSONs (default: every device run's)"
    )
    parser.add_argument("--out", type=Path, default=OUT / "targets.md")
    args = parser.parse_args(argv)
    sources = args.results or sorted(p for p in OUT.glob("ab_*_mi250x*.json") if _is_run(p))
    if not sources:
        parser.error(
            f"no A/B results of a device run in {OUT}: run python -m benchmarks.zero.ab --device mi250x"
        )
    judged = [judge(json.loads(p.read_text())) for p in sources]
    judged.sort(key=lambda j: (j["regime"], j["nodes"], j["contention"]))
    args.out.write_text(markdown(judged, sources))
    print(args.out.read_text())


def _is_run(path: Path) -> bool:
    """A finished A/B result (not its profile, config or bench file), not a --quick one."""
    return not any(part in path.stem for part in ("_profile", "_ds_config", "_bench", "_quick"))


if __name__ == "__main__":
    main()
