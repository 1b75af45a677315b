"""The probe and the A/B command on the emulated cluster, as a user runs them on 2+ nodes.

  python -m benchmarks.zero.ab [--regime frontier]   (root; 8 ranks as 4 nodes x 2 sharing one NIC per node)
  python -m benchmarks.zero.ab --regime latency      (the latency-bound regime: 2 / 4 / 10 ms delays)
  python -m benchmarks.zero.ab --quick               (a smoke test: small sweep, tiny model, 5 timed steps)
  python -m benchmarks.zero.ab --quick --warm        (its ranks forked after their imports: the suite's run)

Method in full: benchmarks/results/methods.md, `benchmarks.zero.ab`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.cluster.spec import ClusterSpec, dilation_of, frontier_bandwidth, frontier_latency
from benchmarks.device import add_device_flags, device_flags
from benchmarks.zero.link_regime import emulated
from benchmarks.zero.run import OUT
from deepspeed_ext.zero.cost.collectives import FRONTIER_RCCL, Algorithm
from deepspeed_ext.zero.cost.profile import Profile, parse
from mdsp_base.installer import Installer
from mdsp_base.paired import MIN_PAIRS
from mdsp_base.shutdown import exit_without_teardown
from mdsp_base.topology import LinkClass
from multirank.warm import WarmLauncher

# 8 ranks as 4 nodes x 2: 16 ranks drove a 2-core host to a load average of 17
DEFAULT_NODES = 4
# A GPT of 2 layers, 4 heads and a 1024-token vocabulary; hidden size and sequence per regime
MODEL = ("--layers", "2", "--heads", "4", "--vocab", "1024")
# Every parameter gathered in each forward and backward, buckets of the model's size (DeepSpeed's
# default reduce bucket, 5e8 elements, preallocates 2 GB, which would be every variant's peak)
DS_CONFIG = {
    "zero_optimization": {
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
        "reduce_bucket_size": 1_000_000,
        "stage3_prefetch_bucket_size": 500_000,
        "stage3_max_live_parameters": 300_000,
    },
}


@dataclass(frozen=True)
class Regime:
    """A cluster and a batch that put the step in one regime."""

    spec: Callable[[int, int], ClusterSpec]
    """The emulated cluster for a node count and MI250Xs (NICs) per node."""
    model: tuple[str, ...]
    """The A/B command's model flags: the parameters' sizes set the messages."""
    micro_batch: int
    """train_micro_batch_size_per_gpu: sets compute against the (batch-independent) communication."""
    about: str
    """One line for the report."""


REGIMES = {
    # hidden 256: modules of ~1 MB, ~200x the inter-node latency x bandwidth product the probe
    # measures with no delay added (1.6 ms x 2.9 MB/s); 48 x 256 tokens per rank: compute ~1-2x the
    # communication, as the best 20B plans' on Frontier (python -m benchmarks.studies.zero.regime)
    "frontier": Regime(
        lambda nodes, packages: frontier_bandwidth(nodes, packages),
        model=(*MODEL, "--hidden", "256", "--seq-length", "256"),
        micro_batch=48,
        about="Frontier's regime: no delay added, messages hundreds of times the latency x bandwidth "
        "product, compute above communication",
    ),
    "latency": Regime(
        lambda nodes, packages: frontier_latency(nodes, packages),
        model=(*MODEL, "--hidden", "128", "--seq-length", "64"),
        micro_batch=2,
        about="latency-bound regime: one-way delays 1000x Frontier's, compute a few percent of the step",
    ),
}
PROBE_TARGET_S = 120.0
AUTO_TARGET = 1.05
# What a rank imports before it works (--warm preloads them): the probe's and the A/B command's
# modules, and what DeepSpeed imports lazily at a process's first ZeRO optimizer (its Muon module:
# torch._dynamo, functorch's compiler, networkx) and CPU comm op (torch's extension loader). Without
# them, each rank pays for those imports at its first torch Adam and its first engine.
RANK_IMPORTS = [
    "deepspeed",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "torch.utils.cpp_extension",
    "deepspeed_ext.zero.tools.probe",
    "deepspeed_ext.zero.tools.ab.cli",
    "benchmarks.zero.ab",
]


def job_config(regime: Regime, spec: ClusterSpec, quick: bool, device: str = "host") -> dict[str, Any]:
    """The DeepSpeed JSON the regime's job runs on ``spec``; ``quick``: a smoke test of the
    cluster, not of its compute (micro-batch at most 2). On a stand-in device the job trains in
    bf16 as on Frontier (weights gathered in bf16, matmuls at the bf16 rate); on the host's own
    compute in fp32, which its CPU runs fastest."""
    micro_batch = min(regime.micro_batch, 2) if quick else regime.micro_batch
    topology = {"ranks_per_node": spec.ranks_per_node, "ranks_per_package": spec.ranks_per_package}
    cfg = {**DS_CONFIG, "train_micro_batch_size_per_gpu": micro_batch, "topology": topology}
    if device != "host":
        cfg["bf16"] = {"enabled": True}
    return cfg


def rank_main(argv: list[str]) -> None:
    """On a rank: ``probe ARGS...`` or ``bench ARGS...``, its result for the launcher."""
    from benchmarks.cluster import write_result

    if argv[0] == "probe":
        from deepspeed_ext.zero.tools import probe

        probe.main(argv[1:])
        write_result(True)
    else:
        from benchmarks.device import add_device_flags, stand_in
        from benchmarks.zero import quantizer_standin
        from deepspeed_ext.zero.tools.ab import cli as bench

        parser = argparse.ArgumentParser()
        add_device_flags(parser)
        device, rest = parser.parse_known_args(argv[1:])
        with Installer() as installer:
            # ZeRO++'s quantizer kernels as pure-torch ops; on a device stand-in each charged as
            # the one kernel it stands for
            ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
            quantizer_standin.install(installer, ranks_per_node, on_device_standin=device.device != "host")
            write_result(bench.main(rest, stand_in(device)))
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


def dimensionless(rows: list[dict], profile: Profile) -> dict[str, Any]:
    """The run's regime numbers (:func:`benchmarks.zero.link_regime.emulated`), or why they could not be
    placed: the run's own figures are written either way."""
    try:
        return emulated(rows, profile, FRONTIER_RCCL)
    except ValueError as exc:
        print(f"regime numbers not computed: {exc}", file=sys.stderr)
        return {"error": str(exc)}


def _probe_target(result: dict[str, Any]) -> str:
    """The 2-minute target is a cold launch's, its ranks' imports included: warm ranks do not judge it."""
    if result["warm"]:
        return f"target <= {PROBE_TARGET_S:.0f} s for a cold launch: not judged, the ranks started warm"
    return (
        f"target <= {PROBE_TARGET_S:.0f} s: {'met' if max(result['probe_s']) <= PROBE_TARGET_S else 'missed'}"
    )


def _compute_share(result: dict[str, Any]) -> float:
    """The compute-only step over stock ZeRO-3's median step."""
    zero3 = next(row for row in result["variants"] if row["variant"] == "zero3")
    return result["compute_only_step_s"] / statistics.median(zero3["step_s"])


def _device_line(result: dict[str, Any]) -> list[str]:
    """Where the ranks computed: the host's cores, or a stand-in device with its factors."""
    if result.get("device", "host") == "host":
        return ["Compute: the host's own cores, shared by every rank.", ""]
    return [
        f"Compute: each rank's tensor work on a virtual {result['device']} device (benchmarks.device), durations "
        f"x {result['dilation']:g} as the links are divided, contention {result['contention']:g}; compute-only "
        f"step {result['compute_only_step_s']:.3f} s ({_compute_share(result):.0%} of ZeRO-3's step, whatever the regime "
        "line says of the host's compute); values not computed (no clipping, no loss scaling).",
        "",
    ]


def markdown(result: dict[str, Any]) -> str:
    spec, checks = result["spec"], result["auto_check"]
    worst = max(c["ratio"] for c in checks) if checks else float("nan")
    lines = [
        f"Regime: {result['about']}.",
        "",
        *_device_line(result),
        f"Emulated cluster: {spec['nodes']} nodes x {spec['packages_per_node']} packages x {spec['ranks_per_package']} "
        f"ranks, each package's ranks sharing one {spec['inter_node_mbit']:g} Mbit/s NIC, one-way delays "
        f"{spec['package_latency_ms']:g} / "
        f"{spec['inter_node_latency_ms']:g} ms (package / inter-node). Command: `{result['command']}`.",
        "",
        f"- Probe wall time (launch to exit, {result['spec']['nodes'] * spec['ranks_per_package'] * spec['packages_per_node']} "
        f"{'warm ranks, forked after their imports' if result['warm'] else 'ranks starting included'}): {result['probe_s'][0]:.0f} s and "
        f"{result['probe_s'][1]:.0f} s ({_probe_target(result)}); load "
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
    if "trace_table" in result:
        lines += [
            "",
            "One traced step per variant after the paired ones (the mean rank, ms; "
            "`deepspeed_ext.zero.tools.ab.trace_report` defines each column; the Chrome/Perfetto traces "
            f"are `{result['trace_dir']}/<variant>.trace.json.gz`):",
            "",
            result["trace_table"].rstrip("\n"),
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--regime", choices=sorted(REGIMES), default="frontier", help="frontier (default) or latency"
    )
    parser.add_argument("--quick", action="store_true", help="small sweep, tiny model, 5 timed steps")
    parser.add_argument(
        "--nodes",
        type=int,
        default=DEFAULT_NODES,
        help="emulated nodes of 2 ranks (4: 8 ranks, the NIC sets the step)",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="fork each launch's ranks from one interpreter that has imported torch and DeepSpeed "
        "(multirank.warm); the probe's wall time then leaves the ranks' imports out",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=2700.0,
        help="seconds per launch, a hang bound (a full --device run's A/B launch, 6 variants, takes about 25 minutes)",
    )
    parser.add_argument(
        "--prefix",
        default="emab",
        help="the emulated cluster's name prefix (another for a run beside this one)",
    )
    parser.add_argument(
        "--packages",
        type=int,
        default=None,
        help="MI250Xs per node, each 2 ranks sharing one NIC (default 1 on the host's compute, 2 with --device)",
    )
    add_device_flags(parser, dilation=None)
    parser.add_argument("--out", default=str(OUT), help="where the results go")
    args = parser.parse_args(argv)
    from benchmarks.cluster import EmulatedCluster
    from deepspeed_ext.zero.tools.ab.report import comparison, plot, predictions, table

    regime = REGIMES[args.regime]
    if args.packages is None:  # device runs leave the cores free for 2 NICs of 2 ranks per node
        args.packages = 1 if args.device == "host" else 2
    spec = regime.spec(args.nodes, args.packages)
    if args.dilation is None:  # the links are Frontier's divided by it
        args.dilation = dilation_of(spec)
    device = [] if args.device == "host" else device_flags(args)
    name = (
        f"ab_{args.regime}"
        + ("" if args.device == "host" else f"_{args.device}")
        + (f"_nodes{args.nodes}" if args.nodes != DEFAULT_NODES else "")
        + (f"_contention{args.contention:g}" if args.contention else "")
        + ("_quick" if args.quick else "")
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = out / f"{name}_ds_config.json"
    config.write_text(json.dumps(job_config(regime, spec, args.quick, args.device), indent=1) + "\n")
    # --quick: up to 1 MiB, the quick model's largest message, so that no prediction extrapolates
    sweep = ["--largest", str(2**20), "--repeats", "2"] if args.quick else []
    profiles = [out / f"{name}_profile.json", out / f"{name}_profile_heldout.json"]
    bench_json, trace_dir = out / f"{name}_bench.json", out / f"{name}_trace"
    rank = ["-m", "benchmarks.zero.ab", "--rank"]
    before, seconds = os.getloadavg(), []
    launcher = WarmLauncher(dict(os.environ), preload=RANK_IMPORTS) if args.warm else nullcontext()
    with launcher as warm, EmulatedCluster(spec, prefix=args.prefix, warm=warm) as cluster:
        for path in profiles:
            start = time.monotonic()
            cluster.launch(
                [*rank, "probe", "--out", str(path), "--deepspeed-config", str(config), *sweep],
                timeout=args.timeout,
            )
            seconds.append(time.monotonic() - start)
            print(f"probe: {seconds[-1]:.0f} s", flush=True)
        bench = ["--deepspeed-config", str(config), "--profile", str(profiles[0]), "--json", str(bench_json)]
        bench += ["--trace", str(trace_dir)]  # one more step per variant, after the paired ones
        bench += ["--quantized-hops"]  # ours beside full ZeRO++ at its widths
        # pairs enough for a ratio; --quick checks that everything runs and is written
        bench += ["--quick"] if args.quick else ["--warmup", "1", "--steps", str(MIN_PAIRS), *regime.model]
        rows = cluster.launch([*rank, "bench", *bench, *device], timeout=args.timeout)[0]
    run = json.loads(bench_json.read_text())[0]["run"]
    first, second = (parse(json.loads(p.read_text()), str(p)) for p in profiles)
    shown = [os.path.relpath(a) if a.startswith(os.sep) else a for a in bench]  # paths as from the checkout
    header = f"{spec.world_size} emulated ranks; deepspeed_ext.zero.bench {' '.join(shown)}"
    result = {
        "command": f"python -m benchmarks.zero.ab --regime {args.regime}"
        + (f" --nodes {args.nodes}" if args.nodes != DEFAULT_NODES else "")
        + (f" --device {args.device}" if args.device != "host" else "")
        + (f" --contention {args.contention:g}" if args.contention else "")
        + (" --quick" if args.quick else "")
        + (" --warm" if args.warm else ""),
        "regime": args.regime,
        "warm": args.warm,
        "about": regime.about,
        "spec": spec.to_dict(),
        "probe_s": seconds,
        "loadavg": [before, os.getloadavg()],
        "auto_check": auto_check(first, second),
        "device": args.device,
        "dilation": args.dilation if args.device != "host" else None,
        "contention": args.contention if args.device != "host" else None,
        "compute_only_step_s": statistics.median(run["compute_step_s"]),
        "variants": rows,
        "paired": run["paired"],
        "dimensionless": dimensionless(rows, first),
        "table": table(rows, header) + "\n" + "\n".join(comparison(rows) + predictions(rows)),
        "trace": {row["variant"]: row["trace"] for row in rows if row["ran"]},
        "trace_table": (trace_dir / "trace.md").read_text(),
        "trace_dir": os.path.relpath(trace_dir),
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
    exit_without_teardown()
