"""The probe and the A/B command on the emulated cluster, as a user runs them on 2+ nodes.

  python -m benchmarks.zero.ab            (root; 8 ranks as 4 nodes x 2 sharing one NIC per node)
  python -m benchmarks.zero.ab --quick    (a smoke test: small sweep, tiny model, 5 timed steps)

Three launches on one cluster (benchmarks.cluster.spec.frontier_latency): the probe (its wall time
from launch to exit, against the 2-minute target), the probe again (a held-out measurement), and
``deepspeed_ext.zero.bench`` with the first profile. The check of ``auto``: at every size both
probes measured across nodes, the algorithm the first profile picks is timed in the second, and
its median is compared with the faster of ring and recursive there (target: at most 5% slower).
Writes benchmarks/results/zero/ab{,_quick}.{json,md,png} and the first profile beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.cluster.spec import frontier_latency
from benchmarks.zero.run import OUT
from deepspeed_ext.zero.cost.collectives import Algorithm
from deepspeed_ext.zero.profile import Profile, parse
from plugin_base.topology import LinkClass

# 8 ranks as 4 nodes x 2: 16 ranks drove a 2-core host to a load average of 17
DEFAULT_NODES = 4
# Small enough that 8 ranks on a small host stay network-bound: 0.66 M parameters, 2.6 MB in fp32
MODEL = ["--layers", "2", "--hidden", "128", "--heads", "4", "--seq-length", "64", "--vocab", "1024"]
# Every parameter gathered in each forward and backward, buckets of the model's size (DeepSpeed's
# default reduce bucket, 5e8 elements, preallocates 2 GB, which would be every variant's peak)
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
        "reduce_bucket_size": 1_000_000,
        "stage3_prefetch_bucket_size": 500_000,
        "stage3_max_live_parameters": 300_000,
    },
}
PROBE_TARGET_S = 120.0
AUTO_TARGET = 1.05


def rank_main(argv: list[str]) -> None:
    """On a rank: ``probe ARGS...`` or ``bench ARGS...``, its result for the launcher."""
    from benchmarks.cluster import write_result

    if argv[0] == "probe":
        from deepspeed_ext.zero import probe

        probe.main(argv[1:])
        write_result(True)
    else:
        from deepspeed_ext.zero import bench

        write_result(bench.main(argv[1:]))
    # everything is written and the groups destroyed: skip the interpreter's teardown, where a
    # backend thread dropping a tensor can abort a rank that finished ("terminate called ...")
    sys.stdout.flush()
    os._exit(0)


def auto_check(first: Profile, second: Profile) -> list[dict[str, Any]]:
    """Per operation and size measured in both: what the first profile picks, its median in the
    second, the faster median there, and their ratio."""
    rows = []
    for t in second.timings:
        if t.link != LinkClass.INTER_NODE or t.algorithm != Algorithm.RING:
            continue
        recursive = [
            r
            for r in second.series(t.link, t.operation, Algorithm.RECURSIVE, t.members)
            if r.nbytes == t.nbytes
        ]
        measured_before = {r.nbytes for r in first.series(t.link, t.operation, Algorithm.RING, t.members)}
        if not recursive or t.nbytes not in measured_before:
            continue
        times = {Algorithm.RING: t.median, Algorithm.RECURSIVE: recursive[0].median}
        pick = first.fastest(t.link, t.operation, t.members, t.nbytes)
        rows.append(
            {
                "operation": str(t.operation),
                "bytes": t.nbytes,
                "pick": str(pick),
                "pick_s": times[pick],
                "best_s": min(times.values()),
                "ratio": times[pick] / min(times.values()),
            }
        )
    return rows


def markdown(result: dict[str, Any]) -> str:
    spec, checks = result["spec"], result["auto_check"]
    worst = max(c["ratio"] for c in checks) if checks else float("nan")
    lines = [
        f"Emulated cluster: {spec['nodes']} nodes x {spec['ranks_per_package'] * spec['packages_per_node']} ranks "
        f"sharing one {spec['inter_node_mbit']:g} Mbit/s NIC, one-way delays {spec['package_latency_ms']:g} / "
        f"{spec['inter_node_latency_ms']:g} ms (package / inter-node). Command: `{result['command']}`.",
        "",
        f"- Probe wall time (launch to exit, {result['spec']['nodes'] * spec['ranks_per_package'] * spec['packages_per_node']} ranks starting included): {result['probe_s'][0]:.0f} s and "
        f"{result['probe_s'][1]:.0f} s (target <= {PROBE_TARGET_S:.0f} s: "
        f"{'met' if max(result['probe_s']) <= PROBE_TARGET_S else 'missed'}); load "
        f"{result['loadavg'][0]} -> {result['loadavg'][1]}.",
        f"- auto from the first profile, timed in the second (measured): worst {worst:.3f}x the faster "
        f"algorithm (target <= {AUTO_TARGET}: {'met' if worst <= AUTO_TARGET else 'missed'}).",
        "",
        "| operation | bytes | auto picks | its median (s) | faster median (s) | ratio |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {c['operation']} | {c['bytes']} | {c['pick']} | {c['pick_s']:.4f} | {c['best_s']:.4f} | {c['ratio']:.3f} |"
        for c in checks
    ]
    lines += ["", "```", result["table"], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sweep, tiny model, 5 timed steps")
    parser.add_argument(
        "--nodes",
        type=int,
        default=DEFAULT_NODES,
        help="emulated nodes of 2 ranks (4: 8 ranks, the NIC sets the step)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    parser.add_argument("--out", default=str(OUT), help="where the results go")
    args = parser.parse_args(argv)
    from benchmarks.cluster import EmulatedCluster
    from deepspeed_ext.zero.bench_report import comparison, plot, predictions, table

    spec = frontier_latency(nodes=args.nodes)
    name = "ab_quick" if args.quick else "ab"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    topology = {"ranks_per_node": spec.ranks_per_node, "ranks_per_package": spec.ranks_per_package}
    config = out / f"{name}_ds_config.json"
    config.write_text(json.dumps({**DS_CONFIG, "topology": topology}, indent=1) + "\n")
    # --quick: up to 1 MiB, the quick model's largest message, so that no prediction extrapolates
    sweep = ["--largest", str(2**20), "--repeats", "2"] if args.quick else []
    profiles = [out / f"{name}_profile.json", out / f"{name}_profile_heldout.json"]
    rank = ["-m", "benchmarks.zero.ab", "--rank"]
    before, seconds = os.getloadavg(), []
    with EmulatedCluster(spec, prefix="emab") as cluster:
        for path in profiles:
            start = time.monotonic()
            cluster.launch(
                [*rank, "probe", "--out", str(path), "--deepspeed-config", str(config), *sweep],
                timeout=args.timeout,
            )
            seconds.append(time.monotonic() - start)
            print(f"probe: {seconds[-1]:.0f} s", flush=True)
        bench = ["--deepspeed-config", str(config), "--profile", str(profiles[0])]
        bench += ["--quick"] if args.quick else ["--steps", "5", "--warmup", "2", *MODEL]
        rows = cluster.launch([*rank, "bench", *bench], timeout=args.timeout)[0]
    first, second = (parse(json.loads(p.read_text()), str(p)) for p in profiles)
    shown = [os.path.relpath(a) if a.startswith(os.sep) else a for a in bench]  # paths as from the checkout
    header = f"{spec.world_size} emulated ranks; deepspeed_ext.zero.bench {' '.join(shown)}"
    result = {
        "command": "python -m benchmarks.zero.ab"
        + (f" --nodes {args.nodes}" if args.nodes != DEFAULT_NODES else "")
        + (" --quick" if args.quick else ""),
        "spec": spec.to_dict(),
        "probe_s": seconds,
        "loadavg": [before, os.getloadavg()],
        "auto_check": auto_check(first, second),
        "variants": rows,
        "table": table(rows, header) + "\n" + "\n".join(comparison(rows) + predictions(rows)),
    }
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(result))
    plot(
        rows,
        out / f"{name}.png",
        f"{spec.world_size} emulated ranks ({spec.nodes} nodes); {result['command']}",
    )
    print(markdown(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(sys.argv[2:])
    else:
        main()
