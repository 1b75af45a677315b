"""ZeRO variants side by side on an emulated cluster of many small nodes with per-link latency.

  python -m benchmarks.studies.zero.scale --quick                 (root; 1 launch, 2 timed steps: a smoke test)
  python -m benchmarks.studies.zero.scale                         (root; the benchmark: 3 launches x 3 steps)
  python -m benchmarks.studies.zero.scale --nodes 6               (12 ranks)
  python -m benchmarks.studies.zero.scale --from-json benchmarks/results/zero/scale_8x2.json   (tables again, after a run)
  python -m benchmarks.studies.zero.scale --nodes 4 --question algorithm   (one question: see Question)

Method in full: benchmarks/results/methods.md, `benchmarks.studies.zero.scale`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.cluster.spec import FRONTIER_LATENCY_SCALE, frontier_latency
from benchmarks.zero.run import OUT, RANK_MODULE, model_for, step_times
from benchmarks.zero.variants import Question, scale_variants
from deepspeed_ext.zero.config import HierarchicalZeroConfig
from deepspeed_ext.zero.cost import volume as cm
from deepspeed_ext.zero.cost.secondary_level import placement_for
from deepspeed_ext.zero.tools.ab.report import separated
from mdsp_base.comm import LINK_CLASSES
from mdsp_base.shutdown import exit_without_teardown
from mdsp_base.topology import Level, LinkClass
from multirank import launch_ranks

TARGET_VS_HPZ = 1.5
TARGET_VS_SERIAL = 1.2


def _loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def rank_argv(args: argparse.Namespace, rank_args: list[str]) -> list[str]:
    """What every rank runs: benchmarks.zero.rank with the scale variants and this run's sizes."""
    return [*RANK_MODULE, "--variant-set", "scale", "--no-peak", "--micro", *map(str, args.micro),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--chunks", str(args.chunks),
            "--algorithms", *args.algorithms, "--hidden", str(args.hidden), "--layers", str(args.layers),
            "--question", args.question, *rank_args]  # fmt: skip


def run(args: argparse.Namespace, rank_args: list[str]) -> tuple[dict[str, list], dict[str, Any]]:
    """All launches on one cluster; returns the launches by accumulation value and the spec."""
    from benchmarks.cluster import EmulatedCluster

    spec = frontier_latency(nodes=args.nodes, scale=args.latency_scale)
    runs: dict[str, list] = {}
    argv = rank_argv(args, rank_args)
    with EmulatedCluster(spec, prefix="emzs") as cluster:
        for round_ in range(args.launches):
            before, start = _loadavg(), time.monotonic()
            ranks = cluster.launch(argv, timeout=args.timeout)
            after, seconds = _loadavg(), time.monotonic() - start
            # Each rank returns one result per accumulation value, in --micro order.
            for i, micro in enumerate(args.micro):
                runs.setdefault(str(micro), []).append(
                    {
                        "loadavg_before": before,
                        "loadavg_after": after,
                        "seconds": seconds,
                        "ranks": [per_rank[i] for per_rank in ranks],
                    }
                )
            print(f"launch {round_ + 1}/{args.launches} (accumulation {' and '.join(map(str, args.micro))}): "
                  f"{seconds:.0f} s; /proc/loadavg {before} -> {after}", flush=True)  # fmt: skip
    return runs, spec.to_dict() | {"ranks_per_nic": spec.ranks_per_nic}


def loopback_medians(args: argparse.Namespace, rank_args: list[str], spec: dict[str, Any]) -> dict[str, Any]:
    """One launch of the same ranks on plain loopback (no emulated links, the same host): per
    accumulation value, each variant's median step, the step less the emulated network."""
    world = spec["nodes"] * spec["packages_per_node"] * spec["ranks_per_package"]
    ranks = launch_ranks(
        [*RANK_MODULE, *rank_argv(args, rank_args)[2:]],
        world_size=world,
        timeout=args.timeout,
        env={"BENCH_RANKS_PER_PACKAGE": str(spec["ranks_per_package"])},
        ranks_per_node=spec["packages_per_node"] * spec["ranks_per_package"],
    )
    out = {}
    for i, micro in enumerate(args.micro):
        launch = [{"ranks": [per_rank[i] for per_rank in ranks]}]
        names = launch[0]["ranks"][0]["record"]
        out[str(micro)] = {name: statistics.median(step_times(launch, name)[0]) for name in names}
    return out


def summarize(launches: list[dict[str, Any]], spec: dict[str, Any]) -> dict[str, Any]:
    """Per variant: step times, throughput, wire bytes; then the targets."""
    first = launches[0]["ranks"][0]
    world = len(launches[0]["ranks"])
    args = first["args"]
    question = Question(args.get("question", Question.ALL))
    optimal = optimal_wire(first, question)
    roles = {
        name: v.role
        for name, v in scale_variants(
            spec["ranks_per_package"] * spec["packages_per_node"],
            args["chunks"],
            args["algorithms"],
            question,
        ).items()
    }
    rows = {}
    for name in first["record"]:
        steps, medians = step_times(launches, name)
        wire = {
            k: statistics.mean(
                statistics.median(s[k] for s in r["record"][name]["wire"])
                for launch in launches
                for r in launch["ranks"]
            )
            for k in (*LINK_CLASSES, "total")
        }
        rows[name] = {
            "role": roles[name],
            "median": statistics.median(steps),
            "min": min(steps),
            "max": max(steps),
            "launch_medians": medians,
            "samples_per_s": world * args["batch"] * args["micro"] / statistics.median(steps),
            "wire_bytes": wire,
            "inter_node_bytes_all_ranks": wire["inter_node"] * world,
            "optimal_inter_node_bytes": optimal[name],
            "secondary_bytes": max(r["record"][name]["held"][-1]["secondary"] for r in launches[0]["ranks"]),
        }
    found = targets(rows) if question == Question.ALL else []
    return {"rows": rows, "targets": found, "answers": answers(rows, question), "args": args,
            "params": first["params"], "world": world}  # fmt: skip


def optimal_wire(first: dict[str, Any], question: Question) -> dict[str, float]:
    """Per variant, the inter-node bytes per rank and step that the bandwidth-optimal ring algorithms
    of its collectives put on the wire (computed: each reduce-scatter sends its optimal volume,
    where gloo's runs an all-reduce), for the benchmark's MLP."""
    shape, model, _ = model_for(first)
    a, per_package = first["args"], shape.per_package
    out = {}
    for name, v in scale_variants(shape.per_node, a["chunks"], a["algorithms"], question).items():
        if not v.ours and not v.zero:
            variant = cm.ZERO3
        elif not v.ours:
            size = v.zero["zero_hpz_partition_size"]
            variant = cm.hpz(size, LinkClass.PACKAGE if size <= per_package else LinkClass.NODE)
        else:
            config = HierarchicalZeroConfig(enabled=True, secondary_level="node", **v.hierarchical)
            variant = placement_for(config, Level.NODE, model)
        out[name] = cm.ring_wire_bytes(cm.step_hops(model, shape, variant, a["micro"]))[LinkClass.INTER_NODE]
    return out


def answers(rows: dict[str, dict[str, Any]], question: Question) -> list[dict[str, Any]]:
    """The question's comparisons: the first variant's median step over the second's, claimed only
    where their min-max ranges do not overlap."""
    names = list(rows)
    if question in (Question.ALGORITHM, Question.PIPELINING):
        pairs = [(names[0], names[1])]
    elif question == Question.BASELINES:
        pairs = [(names[0], names[1]), (names[1], names[2])]
    else:
        pairs = []
    out = []
    for slow, fast in pairs:
        a, b = rows[slow], rows[fast]
        apart = separated((a["min"], a["max"]), (b["min"], b["max"]))
        out.append({"first": slow, "second": fast, "ratio": a["median"] / b["median"], "separated": apart})
    return out


def targets(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Best pipelined variant against hpZ and against ours serial: throughput ratios, met or missed."""
    by_role = {}
    for name, row in rows.items():
        best = by_role.get(row["role"])
        if best is None or row["median"] < rows[best]["median"]:
            by_role[row["role"]] = name
    best = by_role["pipelined"]
    out = []
    for role, target in (("hpz", TARGET_VS_HPZ), ("serial", TARGET_VS_SERIAL)):
        ratio = rows[by_role[role]]["median"] / rows[best]["median"]
        out.append(
            {"ours": best, "against": by_role[role], "ratio": ratio, "target": target, "met": ratio >= target}
        )
    return out


def markdown(
    summaries: dict[str, dict[str, Any]], runs: dict[str, list], spec: dict[str, Any], command: str | None
) -> str:
    mb = 1e6
    lat = " / ".join(f"{spec[f'{k}_latency_ms']:g}" for k in LINK_CLASSES)
    lines = [
        f"Emulated cluster {spec['nodes']} nodes x {spec['packages_per_node']} package x {spec['ranks_per_package']} "
        f"ranks ({spec['nodes'] * spec['packages_per_node'] * spec['ranks_per_package']} ranks, one NIC per package), "
        f"{spec['package_mbit']:g} / {spec['node_mbit']:g} / {spec['inter_node_mbit']:g} Mbit/s and one-way "
        f"delays {lat} ms (package / node / inter-node)." + (f" Command: `{command}`." if command else ""),
    ]
    for micro, s in summaries.items():
        a = s["args"]
        lines += [
            "",
            f"### Gradient accumulation {micro}",
            "",
            f"{s['params']:,} fp32 parameters ({a['layers']} x {a['hidden']}), batch {a['batch']} per rank, "
            f"{len(runs[micro])} launch(es) x {a['steps']} timed steps after {a['warmup']} warm-up.",
            "",
            "| variant | step s: median (min-max) | launch medians | samples/s | wire MB per rank and step: "
            "package / node / inter-node (all) | inter-node MB per step, all ranks | secondary MB per rank |",
            "|---|---|---|---:|---|---:|---:|",
        ]
        for name, r in s["rows"].items():
            w = r["wire_bytes"]
            lines.append(
                f"| {name} | {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}) | "
                + ", ".join(f"{t:.2f}" for t in r["launch_medians"])
                + f" | {r['samples_per_s']:.1f} | {w['package'] / mb:.2f} / {w['node'] / mb:.2f} / "
                f"{w['inter_node'] / mb:.2f} ({w['total'] / mb:.2f}) | {r['inter_node_bytes_all_ranks'] / mb:.2f} | "
                f"{r['secondary_bytes'] / mb:.2f} |"
            )
        lines += ["", "| variant | inter-node MB per rank and step: on the wire (measured) | bandwidth-optimal "
                  "rings of its collectives (computed) | wire / optimal | step on plain loopback, median s "
                  "(measured, one launch) | share of the step that is the emulated network |",
                  "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for name, r in s["rows"].items():
            wire, best = r["wire_bytes"]["inter_node"], r["optimal_inter_node_bytes"]
            ratio = f"{wire / best:.2f}" if best else "-"
            base = r.get("loopback_median")
            local = f"{base:.3f} | {1 - base / r['median']:.0%}" if base else "- | -"
            lines.append(f"| {name} | {wire / mb:.2f} | {best / mb:.2f} | {ratio} | {local} |")
        lines.append("")
        for q in s.get("answers", []):
            verdict = (
                f"{q['ratio']:.2f}x"
                if q["separated"]
                else f"not separated ({q['ratio']:.2f}x at the medians)"
            )
            lines.append(f"- {q['first']} step / {q['second']} step: {verdict}")
        for t in s["targets"]:
            lines.append(
                f"- {t['ours']} vs {t['against']}: {t['ratio']:.2f}x step throughput (target {t['target']:g}x): "
                + ("**met**" if t["met"] else "**missed**")
            )
        lines.append("")
        lines.append("/proc/loadavg before -> after each launch: " + "; ".join(
            f"{x['loadavg_before']} -> {x['loadavg_after']}" for x in runs[micro]))  # fmt: skip
    return "\n".join(lines) + "\n"


def shown_command(argv: list[str]) -> str:
    """This run's command line as a user types it, without where it wrote."""
    shown, skip = [], False
    for word in argv:
        if skip or word == "--out":
            skip = not skip
            continue
        shown.append(word)
    return " ".join(["python -m benchmarks.studies.zero.scale", *shown])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=8, help="nodes of 2 ranks (default 8: 16 ranks)")
    parser.add_argument(
        "--latency-scale",
        type=float,
        default=FRONTIER_LATENCY_SCALE,
        help="emulated per Frontier latency (0: none)",
    )
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 4], help="gradient accumulation values")
    parser.add_argument("--launches", type=int, default=3, help="launches per accumulation value, pooled")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and launch")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--chunks", type=int, default=4, help="pipeline_chunks of the pipelined variants")
    parser.add_argument("--algorithms", nargs="+", default=["recursive"], help="inter_node_algorithm values")
    # Small enough that 16 ranks on 2 cores finish the full benchmark in about 15 minutes.
    parser.add_argument("--hidden", type=int, default=256, help="width of the MLP's layers")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--question",
        type=Question,
        choices=list(Question),
        default=Question.ALL,
        help="run only the variants that answer one question (benchmarks.zero.variants.Question)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 launch, 2 timed steps")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--name", help="file name stem (default scale_<nodes>x2, _quick with --quick)")
    parser.add_argument("--from-json", type=Path, help="rebuild the tables from an earlier result file")
    args, rank_args = parser.parse_known_args()
    start = time.monotonic()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        runs, spec, wall = saved["runs"], saved["spec"], saved["wall_s"]
        loopback, command = saved.get("loopback", {}), saved.get("command")
    else:
        if args.quick:
            args.launches, args.steps = 1, 2
        runs, spec = run(args, rank_args)
        loopback = {} if args.quick else loopback_medians(args, rank_args, spec)
        command = shown_command(sys.argv[1:])
        wall = time.monotonic() - start
    stem = (
        args.from_json.stem
        if args.from_json
        else f"scale_{spec['nodes']}x2"
        + ("" if args.question == Question.ALL else f"_{args.question}")
        + ("_quick" if args.quick else "")
    )
    name = args.name or stem
    args.out.mkdir(parents=True, exist_ok=True)
    saved = {"command": command, "spec": spec, "wall_s": wall, "runs": runs, "loopback": loopback}
    (args.out / f"{name}.json").write_text(json.dumps(saved, indent=1))  # the runs first, whatever follows
    summaries = {micro: summarize(launches, spec) for micro, launches in runs.items()}
    for micro, medians in loopback.items():
        for row_name, row in summaries[micro]["rows"].items():
            row["loopback_median"] = medians.get(row_name)
    text = markdown(summaries, runs, spec, command) + f"\nWall time of the whole command: {wall:.0f} s.\n"
    print(text)
    (args.out / f"{name}.json").write_text(json.dumps({"summary": summaries, **saved}, indent=1))
    (args.out / f"{name}.md").write_text(text)
    print(f"wrote {args.out / name}.{{json,md}}; wall time {wall:.0f} s", flush=True)


if __name__ == "__main__":
    main()
    exit_without_teardown()
