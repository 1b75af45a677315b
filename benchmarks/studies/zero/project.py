"""Projection to Frontier: the 20B GPT preset on 1..48 nodes (8..384 GCDs), every collective charged
through the cost model (deepspeed_ext/zero/cost/).

Method in full: benchmarks/results/methods.md, `benchmarks.studies.zero.project`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.studies.zero import calibration
from benchmarks.studies.zero.project_tables import PAPER_TOLERANCE, markdown
from deepspeed_ext.zero.cost.projection import Candidate, Scheme, project
from deepspeed_ext.zero.cost.search import BASELINES, Rules, evaluate, own_best
from deepspeed_ext.zero.cost.uncertainty import systems
from deepspeed_ext.zero.cost.verified import Backend
from deepspeed_ext.zero.cost.workload import Buckets, System
from deepspeed_ext.zero.tools import recommend
from deepspeed_ext.zero.tools.recommend_inputs import measured_costs
from mdsp_base.shutdown import exit_without_teardown

OUT = Path(__file__).resolve().parents[2] / "results" / "zero"
TARGET_VS_HPZ, TARGET_VS_ZEROPP = 1.5, 1.2
PAPER = {"zeropp_vs_zero3": 1.405, "ours_vs_zeropp": 1.71, "ours_scaling_efficiency": 0.94}
"""arXiv 2501.04266's abstract: ZeRO++ +40.5 % TFLOPS per GPU over ZeRO-3, 1.71x its 3-level scheme
over ZeRO++ (20B, 384 GCDs), and that scheme's 0.94 scaling efficiency to 384 GCDs."""
PCCL_ZERO3 = 4.9
"""PCCL (arXiv 2504.18658): up to 4.9x over RCCL in DeepSpeed ZeRO-3 training."""
COLUMNS = {
    "zero3": Candidate(Scheme.ZERO3),
    "hpz (DeepSpeed)": Candidate(Scheme.HPZ),
    "hpz (ideal)": Candidate(Scheme.HPZ_IDEAL),
    "zero++ (hpZ+qwZ+qgZ)": Candidate(Scheme.ZEROPP),
    "ours (preset: node copy, auto)": Candidate(Scheme.OURS),
    "ours (node, int8/int4, 4 chunks)": Candidate(
        Scheme.OURS, quantized_weights=True, quantized_gradients=True, pipeline_chunks=4
    ),
}
"""Columns of the scaling table, at the preset's TP, micro-batch and buckets."""


def hit(value: float, target: float) -> dict:
    return {
        "model": value,
        "published": target,
        "error": value / target - 1,
        "hit": abs(value / target - 1) <= PAPER_TOLERANCE,
    }


FORECAST = Rules(Backend.RCCL, allow_lossy=True, allow_unverified=True, headroom=0.0, build_bytes_per_param=0)
"""The forecast's design space: every setting, lossy and unverified included, the whole 64 GB, the
batch free, the build not counted (as under zero.Init). The planner CLI proposes from a narrower one."""


def ranges(base: System, measured: bool, nodes: int, ds: dict, grad_accum: int) -> dict:
    """Each headline ratio of :func:`best_vs_targets` at every combination of the uncertain inputs:
    its least and greatest value and the inputs that give them."""
    values: dict[str, list[tuple[float, dict]]] = {}
    for inputs, system in systems(base, sweep_collectives=not measured):
        best = best_vs_targets(system, nodes, ds, grad_accum)
        for kind in ("same_setting", "vs_own_best"):
            for baseline in ("hpz", "zeropp"):
                values.setdefault(f"{kind} {baseline}", []).append((best[kind][baseline], inputs))
    out = {}
    for key, v in values.items():
        (low, low_at), (high, high_at) = min(v, key=lambda x: x[0]), max(v, key=lambda x: x[0])
        out[key] = {"min": low, "min_at": low_at, "max": high, "max_at": high_at, "combinations": len(v)}
    return out


def scaling(system: System, nodes: list[int], tp: int, grad_accum: int, buckets: Buckets) -> dict:
    """TFLOPS per GCD of each column at each size (computed)."""
    rows = {}
    for n in nodes:
        rows[str(n * 8)] = {
            name: project(
                system,
                calibration.GPT_20B,
                n,
                replace(p, tp=tp, grad_accum=grad_accum, buckets=buckets),
            ).tflops_per_gcd
            for name, p in COLUMNS.items()
        }
    return rows


def best_vs_targets(system: System, nodes: int, ds: dict, grad_accum: int) -> dict:
    """The planner's best plan that fits 64 GB and its ratios (same TP, micro-batch and
    recomputation; baselines with the JSON's buckets), and the baselines' own best plans."""
    rows = evaluate(system, calibration.GPT_20B, nodes, ds, grad_accum, FORECAST)
    best = rows[0]
    baseline = Candidate(Scheme.ZERO3, grad_accum=grad_accum, buckets=Buckets.from_json(ds))
    own = {
        scheme.value: own_best(system, calibration.GPT_20B, nodes, scheme, baseline, FORECAST)
        for scheme in BASELINES
    }
    mine = best.projection.tflops_per_gcd
    return {
        "plan": recommend.label(best),
        "tflops_per_gcd": mine,
        "memory_gb": best.projection.memory["total"] / 1e9,
        "same_setting": best.ratios,
        "vs_own_best": {k: mine / v for k, v in own.items()},
        "targets": {"hpz": TARGET_VS_HPZ, "zeropp": TARGET_VS_ZEROPP},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp", type=int, default=4, help="TP of the scaling table (the 20B preset: 4)")
    parser.add_argument("--grad-accum", type=int, help="micro-batches per step (default: the JSON's)")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 6, 12, 24, 48])
    parser.add_argument("--ds-config", type=Path, default=recommend.PRESETS / "ds_frontier_20b.json")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--name", default="projection")
    parser.add_argument("--profile", type=Path, help="a probe profile: its measured costs and topology")
    args = parser.parse_args(argv)

    ds = json.loads(args.ds_config.read_text())
    buckets = Buckets.from_json(ds)
    grad_accum = args.grad_accum or int(ds.get("gradient_accumulation_steps", 1))
    pccl, where = calibration.pccl_zero3_speedup()
    nodes = max(args.nodes)
    system = calibration.FRONTIER
    if args.profile:
        measured = measured_costs(args.profile, system, Backend.RCCL, nodes)
        system = measured.system
        for note in measured.notes:
            print(f"warning: {note}", file=sys.stderr)
    results = {
        "command": " ".join(
            ["python -m benchmarks.studies.zero.project", *(sys.argv[1:] if argv is None else argv)]
        ),
        "calibration": [asdict(p) | {"error": p.error} for p in calibration.points()],
        "papers": {
            setting: {k: hit(v, PAPER[k]) for k, v in calibration.frontier_relations(p).items()}
            for setting, p in calibration.FRONTIER_SETTINGS.items()
        },
        "pccl_zero3": hit(pccl, PCCL_ZERO3) | {"where": where},
        "tp": args.tp,
        "grad_accum": grad_accum,
        "costs": system.costs.system,
        "scaling": scaling(system, args.nodes, args.tp, grad_accum, buckets),
        "best": best_vs_targets(system, nodes, ds, grad_accum),
        "ranges": ranges(system, args.profile is not None, nodes, ds, grad_accum),
        "buckets": asdict(buckets),
    }
    table = markdown(results)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / f"{args.name}.md").write_text(table + "\n")
    return results


if __name__ == "__main__":
    main()
    exit_without_teardown()
