"""ZeRO-3, ZeRO++ hpZ and hierarchical ZeRO-3 measured side by side, on the emulated cluster and unshaped.

  python -m benchmarks.zero.run --network cluster --launches 3 --micro 1 4   (root: emulated cluster)
  python -m benchmarks.zero.run --network loopback                          (unshaped 127.0.0.1 only)
  python -m benchmarks.zero.run --device mi250x --micro 1 4                  (root: compute on a stand-in)

Method in full: benchmarks/results/methods.md, `benchmarks.zero.run`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.cluster.spec import dilation_of, frontier
from benchmarks.device import add_device_flags, device_flags
from benchmarks.zero.run_report import markdown, notes, paired
from deepspeed_ext.zero.config import HierarchicalZeroConfig
from deepspeed_ext.zero.cost import collectives
from deepspeed_ext.zero.cost import volume as cm
from deepspeed_ext.zero.cost.collectives import Algorithm, AlgorithmFit, CollectiveCosts, Operation
from deepspeed_ext.zero.cost.secondary_level import placement_for
from mdsp_base.comm import LINK_CLASSES
from mdsp_base.paired import MIN_PAIRS
from mdsp_base.shutdown import exit_without_teardown
from mdsp_base.topology import Level, LinkClass
from multirank import launch_ranks

REPO_ROOT = Path(__file__).resolve().parents[2]
RANK_MODULE = ["-m", "benchmarks.zero.rank"]
OUT = REPO_ROOT / "benchmarks" / "results" / "zero"


def loopback(rank_args: list[str], timeout: float) -> list[dict[str, Any]]:
    """8 local ranks over 127.0.0.1 laid out as 2 nodes x 2 packages x 2."""
    return launch_ranks(
        [*RANK_MODULE, *rank_args],
        world_size=8,
        timeout=timeout,
        env={"BENCH_RANKS_PER_PACKAGE": "2"},
        ranks_per_node=4,
    )


def run_all(args: argparse.Namespace, rank_args: list[str]) -> tuple[dict[str, list], dict | None]:
    """Rounds of (cluster, loopback) launches per accumulation value; returns the runs by key."""
    runs: dict[str, list] = {}

    def launch(key: str, start: Callable[[], list]) -> None:
        load = os.getloadavg()
        result = [per_rank[0] for per_rank in start()]  # one accumulation value per launch
        runs.setdefault(key, []).append(
            {"loadavg_before": load, "loadavg_after": os.getloadavg(), "ranks": result}
        )
        print(f"{key}: launch done, load average {load[0]:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)

    if args.network == "loopback":
        for _ in range(args.launches):
            for micro in args.micro:
                launch(
                    f"loopback micro {micro}",
                    lambda m=micro: loopback([*rank_args, "--micro", str(m)], args.timeout),
                )
        return runs, None
    from benchmarks.cluster import EmulatedCluster

    spec = frontier(shared_nic=not args.own_nic)
    with EmulatedCluster(spec, prefix="emzr") as cluster:
        for _ in range(args.launches):
            for micro in args.micro:
                argv = [*RANK_MODULE, *rank_args, "--micro", str(micro)]
                launch(f"cluster micro {micro}", lambda a=argv: cluster.launch(a, timeout=args.timeout))
                launch(f"loopback micro {micro}", lambda a=argv: loopback(a[2:], args.timeout))
    return runs, spec.to_dict() | {"ranks_per_nic": spec.ranks_per_nic}


def check_pairs(parser: argparse.ArgumentParser, args: argparse.Namespace, rank_args: list[str]) -> None:
    """Refuse a run that gives fewer than ``MIN_PAIRS`` paired steps per variant."""
    steps = argparse.ArgumentParser(add_help=False)
    steps.add_argument("--steps", type=int, default=MIN_PAIRS)
    pairs = steps.parse_known_args(rank_args)[0].steps * args.launches
    if pairs < MIN_PAIRS:
        parser.error(f"--steps x --launches = {pairs} paired steps; a ratio needs at least {MIN_PAIRS}")


def check_keys(rank_args: list[str]) -> None:
    """Refuse, before any launch, hierarchical_zero keys the config does not have (quantized hops
    and boundary sync come with the engine that implements them)."""
    known = set(HierarchicalZeroConfig.model_fields)
    for flag, value in zip(rank_args, rank_args[1:]):
        if flag in ("--quantized-hops", "--ours-variant"):
            keys = json.loads(value.partition("=")[2] if flag == "--ours-variant" else value)
            unknown = sorted(set(keys) - known)
            if unknown:
                raise SystemExit(f"{flag}: hierarchical_zero has no key(s) {unknown}; it has {sorted(known)}")


def model_for(first: dict[str, Any]) -> tuple[cm.DPShape, cm.ShardSpec, dict[str, cm.Placement]]:
    world, per_node, per_package = first["topology"]
    shape = cm.DPShape(
        nodes=world // per_node, packages_per_node=per_node // per_package, per_package=per_package
    )
    a = first["args"]
    numels = tuple([a["hidden"] * a["hidden"], a["hidden"]] * a["layers"])
    width = 4 if a.get("device", "host") == "host" else 2  # a stand-in's job runs in bf16
    model = cm.ShardSpec(
        param_numels=numels, weight_bytes=width, grad_bytes=width, gathers_per_pass=a["layers"]
    )
    variants = {
        "zero3": cm.ZERO3,
        f"zero++ hpZ({per_package})": cm.hpz(per_package, Level.PACKAGE),
        "ours (package)": cm.hierarchical(Level.PACKAGE),
        f"zero++ hpZ({per_node})": cm.hpz(per_node, Level.NODE),
        "ours (node)": cm.hierarchical(Level.NODE),
    }
    for item in a.get("ours_variant", []):
        name, _, keys = item.partition("=")
        config = HierarchicalZeroConfig(**{"secondary_level": Level.PACKAGE.value, **json.loads(keys)})
        variants[f"ours ({name})"] = placement_for(config, Level(config.secondary_level), model)
    return shape, model, variants


def step_times(launches: list[dict[str, Any]], name: str) -> tuple[list[float], list[float]]:
    """Pooled step times (each the slowest rank's) and each launch's median."""
    per_launch = []
    for launch in launches:
        ranks = launch["ranks"]
        n = len(ranks[0]["record"][name]["times"])
        per_launch.append([max(r["record"][name]["times"][i] for r in ranks) for i in range(n)])
    return [t for steps in per_launch for t in steps], [statistics.median(s) for s in per_launch]


def emulated_costs(spec: dict[str, Any]) -> CollectiveCosts:
    """The emulated cluster's shaped rates as collective costs, with no latency (these links have
    none): one gloo ring per collective on one NIC, the node's NICs shared by its groups."""
    per_node = spec["packages_per_node"] * spec["ranks_per_package"]
    gbps = {LinkClass(k): spec[f"{k}_mbit"] / 8 / 1000 for k in LINK_CLASSES}
    return CollectiveCosts(
        "emulated cluster, gloo",
        {(link, Algorithm.RING): AlgorithmFit(step_us=0.0, bus_gbps=g) for link, g in gbps.items()},
        nic_gbps=gbps[LinkClass.INTER_NODE] * (per_node // spec["ranks_per_nic"]),
    )


def gloo_hop_seconds(hop: cm.Hop, costs: CollectiveCosts, ranks_per_node: int) -> float:
    """One occurrence of ``hop`` on the emulated cluster, charged by the one cost model
    (:func:`collectives.seconds`): a reduce-scatter costs an all-reduce (gloo's runs one); a group
    spanning nodes is limited by the NICs its node's concurrent groups share or by its slowest
    edge inside the node."""
    op = Operation.ALL_REDUCE if hop.kind == "reduce" else Operation.ALL_GATHER
    buffer = hop.nbytes * hop.members / (hop.members - 1)
    if hop.link != LinkClass.INTER_NODE:
        return collectives.seconds(costs, op, Algorithm.RING, hop.members, buffer, hop.link)
    _, q, k = hop.layout
    concurrent = max(1, ranks_per_node // (q * k))
    across = collectives.seconds(costs, op, Algorithm.RING, hop.members, buffer, hop.link, concurrent)
    if q * k == 1:
        return across
    edge = LinkClass.NODE if q > 1 else LinkClass.PACKAGE
    edge_gbps = costs.fit(op, Algorithm.RING, edge).bus_gbps
    return max(across, collectives.bus_bytes(op, hop.members, buffer) / (edge_gbps * 1e9))


def summarize(runs: dict[str, list], spec: dict | None, micro: int) -> dict[str, Any]:
    shaped = runs.get(f"cluster micro {micro}")
    base = runs[f"loopback micro {micro}"]
    first = (shaped or base)[0]["ranks"][0]
    shape, model, variants = model_for(first)
    costs = emulated_costs(spec) if spec else None
    per_node = spec["packages_per_node"] * spec["ranks_per_package"] if spec else 0
    rows: dict[str, Any] = {}
    timed: dict[str, list[float]] = {}  # the steps the paired ratios come from: shaped where run
    for name in first["record"]:
        row: dict[str, Any] = {}
        for key, launches in (("shaped", shaped), ("unshaped", base)):
            if launches:
                steps, medians = step_times(launches, name)
                timed.setdefault(name, steps)
                row[key] = {
                    "median": statistics.median(steps),
                    "min": min(steps),
                    "max": max(steps),
                    "launch_medians": medians,
                }
        ranks = (shaped or base)[0]["ranks"]
        # on a stand-in nothing holds real tensors: no engine or peak bytes (empty / None)
        held = max((r["record"][name]["held"][-1] for r in ranks), key=lambda h: sum(h.values()))
        row["held_bytes"] = held or None
        peaks = [r["record"][name].get("peak") for launch in shaped or base for r in launch["ranks"]]
        row["peak_bytes"] = max(peaks) if None not in peaks else None
        row["nic"] = first["record"][name].get("nic")  # the same on every rank (summed over the job)
        if first["record"][name].get("device_s"):
            per_step = zip(*(r["record"][name]["device_s"] for r in ranks))
            row["device_s"] = statistics.median(max(step) for step in per_step)
        if shaped:
            row["wire_bytes"] = {
                k: statistics.mean(
                    statistics.median(s[k] for s in r["record"][name]["wire"])
                    for launch in shaped
                    for r in launch["ranks"]
                )
                for k in (*LINK_CLASSES, "total")
            }
        if name in variants:
            hops = cm.step_hops(model, shape, variants[name], micro)
            row["computed"] = {
                # gloo's reduce-scatter sends what an all-reduce sends (measured: 7.03 MB per rank
                # for a 4 MB reduce-scatter over the 8 ranks, 3.51 MB for the all-gather)
                "ring_wire_bytes": cm.ring_wire_bytes(hops, reduce_scatter_wire=2.0),
                "comm_s": sum(gloo_hop_seconds(h, costs, per_node) * h.times for h in hops)
                if costs
                else None,
            }
        rows[name] = row
    return {
        "rows": rows,
        "paired": paired(timed),
        "device": first.get("device"),
        "params": first["params"],
        "args": first["args"],
        "micro": micro,
        "loadavg": [launch["loadavg_before"][0] for launch in (shaped or []) + base],
        "launches": len(shaped or base),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--network", choices=("loopback", "cluster"), default="cluster")
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 4], help="gradient accumulation values")
    parser.add_argument(
        "--own-nic", action="store_true", help="every rank its own inter-node link (not shared)"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--name", help="file name stem (default: the network)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    parser.add_argument("--launches", type=int, default=1, help="rounds of launches, pooled")
    parser.add_argument(
        "--from-json", type=Path, help="rebuild the tables from an earlier run's raw/NAME.json"
    )
    add_device_flags(parser, dilation=None)
    args, rank_args = parser.parse_known_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        runs, spec = saved["runs"], saved["spec"]
        args.micro = [int(m) for m in saved["summary"]]
    else:
        check_keys(rank_args)
        check_pairs(parser, args, rank_args)
        if args.device != "host":
            if args.dilation is None:  # the cluster's links (the loopback twin takes the same)
                args.dilation = dilation_of(frontier(shared_nic=not args.own_nic))
            rank_args += device_flags(args)
        runs, spec = run_all(args, rank_args)
    if spec:
        title = (
            "Emulated cluster 2 nodes x 2 packages x 2, links 400 / 200 Mbit/s per rank, 50 Mbit/s inter-node per "
            + ("rank" if args.own_nic else "package (NIC shared by its 2 ranks)")
        )
    else:
        title = "Loopback (127.0.0.1, unshaped), 8 ranks as 2 nodes x 2 packages x 2"
    summaries = {str(m): summarize(runs, spec, m) for m in args.micro}
    text = "\n\n".join(markdown(s, title) for s in summaries.values())
    device = next(iter(summaries.values()))["device"]  # the run's, also when read back
    text += "\n\n" + notes(device)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.name or args.network + (f"_{device['device']}" if device else "")
    # the summary beside the tables (the summary plot reads it); every rank's steps under raw/
    (args.out / f"{name}.json").write_text(json.dumps({"summary": summaries, "spec": spec}, indent=1))
    (args.out / "raw").mkdir(exist_ok=True)
    (args.out / "raw" / f"{name}.json").write_text(
        json.dumps({"summary": summaries, "spec": spec, "runs": runs}, indent=1)
    )
    (args.out / f"{name}.md").write_text(text)


if __name__ == "__main__":
    main()
    exit_without_teardown()
