"""ZeRO-3, ZeRO++ hpZ and hierarchical ZeRO-3 measured side by side in one run.

  python -m benchmarks.zero.run --network cluster      (root: emulated Frontier-like cluster, 8 ranks)
  python -m benchmarks.zero.run --network loopback     (unshaped 127.0.0.1: only the bytes mean much)

The cluster is 2 nodes x 2 packages x 2 ranks with links shaped 400 / 200 / 50 Mbit/s (package /
node / inter-node, Frontier's ratios; see docs/emulated_cluster.md). Prints and writes
benchmarks/results/zero/<network>.{json,md}: step time (median, min, max over the timed steps,
each the slowest rank's), bytes per link class per step and rank, and the cost model's bytes and
communication time for the same links. Remaining arguments go to ``benchmarks.zero.rank``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

from benchmarks.cluster.loopback import launch_loopback
from deepspeed_ext.comm import LINK_CLASSES
from deepspeed_ext.zero import cost_model as cm

REPO_ROOT = Path(__file__).resolve().parents[2]
RANK_MODULE = ["-m", "benchmarks.zero.rank"]
OUT = REPO_ROOT / "benchmarks" / "results" / "zero"


def run_loopback(rank_args: list[str], timeout: float) -> list[dict[str, Any]]:
    """8 local ranks over 127.0.0.1 laid out as 2 nodes x 2 packages x 2."""
    return launch_loopback([*RANK_MODULE, *rank_args], world_size=8, timeout=timeout,
                           env={"BENCH_RANKS_PER_PACKAGE": "2"}, ranks_per_node=4)


def run_cluster(rank_args: list[str], timeout: float, launches: int) -> tuple[list[list[dict[str, Any]]], dict[str, float]]:
    from benchmarks.cluster import EmulatedCluster, frontier

    spec = frontier()
    with EmulatedCluster(spec, prefix="emzr") as cluster:
        results = [cluster.launch([*RANK_MODULE, *rank_args], timeout=timeout, echo=False) for _ in range(launches)]
    rates = {"package": spec.package_mbit, "node": spec.node_mbit, "inter_node": spec.inter_node_mbit}
    return results, rates


def summarize(runs: list[list[dict[str, Any]]], rates: dict[str, float] | None) -> dict[str, Any]:
    """Step times pooled over launches (each step: the slowest rank), bytes from rank 0 of the first."""
    first = runs[0][0]
    world, per_node, per_package = first["topology"]
    shape = cm.DPShape(nodes=world // per_node, packages_per_node=per_node // per_package, per_package=per_package)
    args = first["args"]
    numels = tuple([args["hidden"] * args["hidden"], args["hidden"]] * args["layers"])
    model = cm.ModelSpec(param_numels=numels, weight_bytes=4, grad_bytes=4, gathers_per_pass=args["layers"])
    variants = {"zero3": cm.ZERO3, f"zero++ hpZ({per_node})": cm.hpz(per_node, "node"),
                "ours": cm.hierarchical(first["level"])}
    # The emulator shapes each rank's port per link class, so no NIC is shared: ranks_per_nic=1.
    links = cm.Links(bandwidth_gbps={k: v / 8 / 1000 for k, v in rates.items()},
                     latency_us=dict.fromkeys(LINK_CLASSES, 0.0), ranks_per_nic=1) if rates else None
    rows = {}
    for name, variant in variants.items():
        per_launch = [[max(r["times"][name][i] for r in per_rank) for i in range(len(per_rank[0]["times"][name]))]
                      for per_rank in runs]
        steps = [t for launch in per_launch for t in launch]
        measured = {link: sum(kinds.get(link, 0) for phase in first["counts"][name].values()
                              for kind, kinds in phase.items() if kind != "other") for link in LINK_CLASSES}
        hops = cm.step_hops(model, shape, variant, args["micro"])
        rows[name] = {"step_s": {"median": statistics.median(steps), "min": min(steps), "max": max(steps),
                                 "launch_medians": [statistics.median(launch) for launch in per_launch]},
                      "bytes_measured": measured, "bytes_model": cm.bytes_per_link(hops),
                      "comm_s_model": cm.comm_time(hops, links) if links else None}
    return {"rows": rows, "level": first["level"], "params": first["params"], "rates_mbit": rates, "args": args,
            "shape": [shape.nodes, shape.packages_per_node, shape.per_package], "launches": len(runs)}


def markdown(summary: dict[str, Any], title: str) -> str:
    rows = summary["rows"]
    base = rows["zero3"]["step_s"]["median"]
    hpz = next(v for k, v in rows.items() if k.startswith("zero++"))["step_s"]["median"]
    lines = [f"### {title}", "", f"{summary['params']:,} fp32 parameters, secondary level of ours: {summary['level']}, "
             f"{summary['launches']} launch(es) x {summary['args']['steps']} timed steps", "",
             "| variant | step s median (min-max) | launch medians | vs ZeRO-3 | vs hpZ | package MB | node MB | inter-node MB | model MB (pkg/node/inter) | model comm s |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for name, r in rows.items():
        s, b, m = r["step_s"], r["bytes_measured"], r["bytes_model"]
        model_s = f"{r['comm_s_model']:.2f}" if r["comm_s_model"] is not None else "-"
        launches = ", ".join(f"{t:.2f}" for t in s["launch_medians"])
        lines.append(f"| {name} | {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) | {launches} | {base / s['median']:.2f}x | "
                     f"{hpz / s['median']:.2f}x | {b['package'] / 1e6:.2f} | {b['node'] / 1e6:.2f} | {b['inter_node'] / 1e6:.2f} | "
                     f"{m['package'] / 1e6:.2f}/{m['node'] / 1e6:.2f}/{m['inter_node'] / 1e6:.2f} | {model_s} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--network", choices=("loopback", "cluster"), default="cluster")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per launch")
    parser.add_argument("--launches", type=int, default=1, help="launches of all ranks, pooled")
    args, rank_args = parser.parse_known_args()
    load = os.getloadavg()[0]
    if args.network == "cluster":
        runs, rates = run_cluster(rank_args, args.timeout, args.launches)
        title = "Emulated cluster 2 nodes x 2 packages x 2, links 400 / 200 / 50 Mbit/s"
    else:
        runs, rates = [run_loopback(rank_args, args.timeout) for _ in range(args.launches)], None
        title = "Loopback (127.0.0.1, unshaped), 8 ranks as 2 nodes x 2 packages x 2"
    summary = summarize(runs, rates)
    summary["load_average_before"] = load
    table = markdown(summary, title) + f"\n\nHost load average before the run: {load:.1f}; bytes are per rank and step.\n"
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.network}.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    (args.out / f"{args.network}.md").write_text(table)


if __name__ == "__main__":
    main()
