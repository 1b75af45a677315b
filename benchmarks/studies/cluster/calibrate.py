"""Measure point-to-point bandwidth of each link class of an emulated cluster against its configured rate.

python -m benchmarks.studies.cluster.calibrate --profile frontier
python -m benchmarks.studies.cluster.calibrate --profile generic --nodes 3 --inter-node-mbit 80
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass

from benchmarks.cluster.launch import EmulatedCluster
from benchmarks.cluster.netns import DEFAULT_PREFIX, ClusterUnavailable
from benchmarks.cluster.spec import PROFILES, ClusterSpec, profile
from mdsp_base.shutdown import exit_without_teardown
from multirank.warm import WarmLauncher


@dataclass(frozen=True)
class LinkMeasurement:
    """Measured point-to-point bandwidth of one link class."""

    link: str
    """Link class the measured pair crosses, or the label of a shared-NIC measurement."""
    ranks: tuple[int, int]
    """The measured pair (a, b)."""
    configured_mbit: float
    """Rate the link class is shaped to, Mbit/s."""
    measured_mbit: float
    """Median over all transfers in both directions, Mbit/s of payload."""
    forward_mbit: float
    """Median of the a -> b transfers, Mbit/s (shared NIC: the slowest flow)."""
    backward_mbit: float
    """Median of the b -> a transfers, Mbit/s (shared NIC: the fastest flow)."""
    samples: int
    """Number of timed transfers behind the medians."""
    round_trip_ms: float | None = None
    """Median round trip of one float a -> b -> a, ms (None: not a link class pair)."""
    configured_round_trip_ms: float | None = None
    """Twice the class's configured one-way delay, ms."""

    @property
    def ratio(self) -> float:
        """Measured over configured."""
        return self.measured_mbit / self.configured_mbit


def calibrate(
    spec: ClusterSpec,
    mbytes: float = 4.0,
    repeats: int = 5,
    timeout: float = 600.0,
    prefix: str = DEFAULT_PREFIX,
    echo: bool = False,
    warm: WarmLauncher | None = None,
) -> list[LinkMeasurement]:
    """Build the cluster, time gloo send/recv for one pair per link class, tear it down (its ranks
    forked from ``warm`` when given, see EmulatedCluster)."""
    pairs = [(link, *spec.sample_pair(link)) for link in spec.link_classes()]
    if not pairs:
        raise ValueError(f"spec '{spec.name}' has a single rank: there is no link to measure")
    shared = shared_nic_flows(spec)
    argv = ["-m", "benchmarks.studies.cluster.p2p", "--pairs", json.dumps(pairs), "--concurrent", json.dumps(shared),
            "--mbytes", str(mbytes), "--repeats", str(repeats), "--timeout", str(timeout)]  # fmt: skip
    with EmulatedCluster(spec, prefix=prefix, warm=warm) as cluster:
        if echo:
            print(
                f"built {len(cluster.namespaces)} namespaces, launching {spec.world_size} ranks", flush=True
            )
        results = cluster.launch(argv, timeout=timeout, echo=echo)
    records = [rec for per_rank in results for rec in per_rank]
    out = []
    for link, a, b in pairs:

        def mbits(src: int, dst: int, link: str = link) -> list[float]:
            return [r["bytes"] * 8 / r["seconds"] / 1e6 for r in records
                    if r["link"] == link and r["src"] == src and r["dst"] == dst]  # fmt: skip

        fwd, bwd = mbits(a, b), mbits(b, a)
        rtt = [r["seconds"] * 1000 for r in records if r["link"] == f"{link} round trip"]
        out.append(LinkMeasurement(
            link=link, ranks=(a, b), configured_mbit=spec.rate_mbit(link),
            measured_mbit=statistics.median(fwd + bwd), forward_mbit=statistics.median(fwd),
            backward_mbit=statistics.median(bwd), samples=len(fwd) + len(bwd),
            round_trip_ms=statistics.median(rtt), configured_round_trip_ms=2 * spec.latency_ms(link),
        ))  # fmt: skip
    for label, flows in shared:
        per_flow = [r["bytes"] * 8 / r["seconds"] / 1e6 for r in records if r["link"] == label]
        # Several flows share one link: its measured rate is their sum.
        total = statistics.median(per_flow) * len(flows)
        out.append(
            LinkMeasurement(
                link=label,
                ranks=tuple(flows[0]),
                configured_mbit=spec.inter_node_mbit,
                measured_mbit=total,
                forward_mbit=min(per_flow),
                backward_mbit=max(per_flow),
                samples=len(per_flow),
            )
        )
    return out


def shared_nic_flows(spec: ClusterSpec) -> list[tuple[str, list[list[int]]]]:
    """Concurrent transfers that must share one inter-node link: every rank of rank 0's package
    sends to a different rank of the next node (one NIC's tx) and, the other way round, its rx."""
    if not (spec.shared_nic and spec.nodes > 1 and spec.ranks_per_package > 1):
        return []
    k, node = spec.ranks_per_package, spec.ranks_per_node
    return [
        ("inter_node tx shared by a package", [[i, node + i] for i in range(k)]),
        ("inter_node rx shared by a package", [[node + i, i] for i in range(k)]),
    ]


def format_table(rows: list[LinkMeasurement]) -> str:
    """Markdown table of configured vs measured rates."""
    lines = [
        "| link class | ranks | configured Mbit/s | measured Mbit/s (median) | measured/configured | a->b | b->a "
        "| round trip ms: configured delays / measured (median) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rtt = (
            f"{r.configured_round_trip_ms:g} / {r.round_trip_ms:.2f}" if r.round_trip_ms is not None else "-"
        )
        lines.append(
            f"| {r.link} | {r.ranks[0]}-{r.ranks[1]} | {r.configured_mbit:.0f} | {r.measured_mbit:.1f} | "
            f"{r.ratio:.3f} | {r.forward_mbit:.1f} | {r.backward_mbit:.1f} | {rtt} |"
        )
    return "\n".join(lines)


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    """The chosen profile with any factor given on the command line replaced."""
    base = profile(args.profile)
    overrides = {
        field: getattr(args, field)
        for field in (
            "nodes",
            "packages_per_node",
            "ranks_per_package",
            "package_mbit",
            "node_mbit",
            "inter_node_mbit",
        )
        if getattr(args, field) is not None
    }
    name = base.name if not overrides else f"{base.name}+custom"
    return dataclasses.replace(base, name=name, **overrides)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.cluster.calibrate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), default="frontier")
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--packages-per-node", type=int)
    parser.add_argument("--ranks-per-package", type=int)
    parser.add_argument("--package-mbit", type=float)
    parser.add_argument("--node-mbit", type=float)
    parser.add_argument("--inter-node-mbit", type=float)
    parser.add_argument("--mbytes", type=float, default=4.0, help="payload per transfer in MB (default 4)")
    parser.add_argument("--repeats", type=int, default=5, help="timed transfers per direction (default 5)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds for the whole run (default 600)"
    )
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="name prefix of namespaces and links")
    parser.add_argument("--json", metavar="PATH", help="also write the report to this file")
    args = parser.parse_args(argv)
    try:
        spec = spec_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    print(f"profile {spec.name}: {spec.nodes} nodes x {spec.packages_per_node} packages x "
          f"{spec.ranks_per_package} ranks = {spec.world_size} ranks; Mbit/s package {spec.package_mbit:g}, "
          f"node {spec.node_mbit:g}, inter-node {spec.inter_node_mbit:g}", flush=True)  # fmt: skip
    start = time.monotonic()
    try:
        rows = calibrate(spec, args.mbytes, args.repeats, args.timeout, args.prefix, echo=True)
    except ClusterUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = {
        "spec": spec.to_dict(),
        "mbytes": args.mbytes,
        "repeats": args.repeats,
        "seconds": round(time.monotonic() - start, 1),
        "links": [{**dataclasses.asdict(r), "ratio": round(r.ratio, 4)} for r in rows],
    }
    print(format_table(rows))
    print(json.dumps(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
