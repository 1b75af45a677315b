"""Flash-Overlap benchmark: forward + backward of the MLP and of a whole transformer layer, with
megatron-core's linears (on gloo's collectives and on the P2P exchange), their 4-chunk slicing (gloo),
TransformerEngine's split (P2P) and the Flash-Overlap linears side by side (``--methods`` picks some).
The same-transport comparison with its targets and the UP benchmark: ``benchmarks.flash_overlap.overlap``.

Method in full: benchmarks/results/methods.md, `benchmarks.flash_overlap.run`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from benchmarks.device import add_device_flags, device_flags
from benchmarks.flash_overlap.report import markdown, paired_vs_megatron_core, summarize, timeline_png
from mdsp_base.shutdown import exit_without_teardown
from multirank import launch_ranks

REPO_ROOT = Path(__file__).resolve().parents[2]
RANK_MODULE = ["-m", "benchmarks.flash_overlap.rank"]
H100_NVLINK_GBPS = 450.0
"""H100 SXM5, NVLink 4: 18 links x 25 GB/s per direction per GPU (NVIDIA H100 datasheet: 900 GB/s
bidirectional), every pair of a node's GPUs at that rate through NVSwitch."""
MI250X_PACKAGE_GBPS = 200.0
"""Between the two GCDs of one MI250X (OLCF's Frontier user guide: 4 Infinity Fabric links)."""
MI250X_BETWEEN_PACKAGES_GBPS = 50.0
"""Between GCDs of different MI250Xs, 50-100 GB/s (OLCF's Frontier user guide): a group that spans
packages moves at the pace of its slowest hop."""


def derived_dilation(device: str, world: int, mbit: float) -> float:
    """The dilation that makes the emulated ``mbit`` link the ``device``'s GPU-GPU link for a group
    of ``world`` consecutive GPUs of one node (a TP or SP group): its rate over the emulated one,
    device time stretched as much."""
    if device == "h100":
        gbps = H100_NVLINK_GBPS
    else:  # consecutive ranks: 2 share a package
        gbps = MI250X_PACKAGE_GBPS if world <= 2 else MI250X_BETWEEN_PACKAGES_GBPS
    return gbps * 8000 / mbit


def launch_dilation(args: argparse.Namespace, world: int, mbit: float | None) -> float:
    """The dilation of a launch of ``world`` ranks on links of ``mbit`` (None: loopback, where
    ``--dilation`` must be given): ``--dilation`` as given, else derived from the link."""
    if args.dilation is not None:
        return float(args.dilation)
    return 1.0 if args.device == "host" or mbit is None else derived_dilation(args.device, world, mbit)


def rank_device_flags(args: argparse.Namespace, dilation: float) -> list[str]:
    """The device flags of a rank's command line."""
    return device_flags(argparse.Namespace(device=args.device, dilation=dilation, contention=args.contention))


def check_device_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a stand-in on loopback without ``--dilation``: no emulated rate to derive it from."""
    if args.device != "host" and args.network == "loopback" and args.dilation is None:
        parser.error(
            f"--device {args.device} on --network loopback needs --dilation (its links have no set rate)"
        )


def device_note(args: argparse.Namespace, dilation: float) -> str:
    """How the ranks computed, for a title."""
    if args.device == "host":
        return "compute on the host's CPU"
    return (
        f"compute on a stand-in {args.device} (dilation {dilation:g}, contention {args.contention:g}; bf16; "
        "values not computed, so the check against megatron-core is skipped)"
    )


def run_loopback(
    tp: int, rank_args: list[str], timeout: float, module: list[str] = RANK_MODULE
) -> list[dict[str, Any]]:
    """All ranks (``python *module *rank_args``) as local processes talking over 127.0.0.1."""
    return launch_ranks([*module, *rank_args], world_size=tp, timeout=timeout)


def run_cluster(
    tp: int, mbit: float, rank_args: list[str], timeout: float, module: list[str] = RANK_MODULE
) -> list[dict[str, Any]]:
    """All ranks in one emulated package whose links are shaped to ``mbit``."""
    from benchmarks.cluster import ClusterSpec, EmulatedCluster

    spec = ClusterSpec(1, 1, tp, mbit, mbit, mbit, name=f"flash-overlap-tp{tp}")
    with EmulatedCluster(spec, prefix="emfo") as cluster:
        return cluster.launch([*module, *rank_args], timeout=timeout, echo=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--network", choices=("loopback", "cluster"), default="loopback")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mbit", type=float, default=400.0, help="link rate on the emulated cluster")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "flash_overlap")
    parser.add_argument("--timeout", type=float, default=1200.0)
    add_device_flags(parser, dilation=None)
    args, rank_args = parser.parse_known_args()
    check_device_flags(parser, args)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.device == "host" else f"_{args.device}"
    for tp in args.tp:
        load_before = os.getloadavg()[0]
        mbit = None if args.network == "loopback" else args.mbit
        dilation = launch_dilation(args, tp, mbit)
        flags = rank_device_flags(args, dilation)
        if mbit is None:
            per_rank = run_loopback(tp, [*rank_args, *flags], args.timeout)
            label = f"loopback_tp{tp}{suffix}"
            title = f"Loopback (127.0.0.1, unshaped), TP={tp}"
        else:
            per_rank = run_cluster(tp, mbit, [*rank_args, *flags], args.timeout)
            label = f"cluster{mbit:g}_tp{tp}{suffix}"
            title = f"Emulated cluster, links shaped to {mbit:g} Mbit/s, TP={tp}"
        title += f", {device_note(args, dilation)}"
        # The host's load decides how much CPU the ranks and gloo's threads get: report it with the figures.
        load = f"host load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
        summaries = [
            summarize(per_rank, regime, block)
            for regime in per_rank[0]["regimes"]
            for block in per_rank[0]["regimes"][regime]["blocks"]
        ]
        table = markdown(f"{title} ({load})", summaries, per_rank[0]["args"])
        command = "python -m benchmarks.flash_overlap.run " + " ".join(sys.argv[1:])
        table = f"`{command}` (measured)\n\n{table}"
        print(table, flush=True)
        (args.out / f"{label}.md").write_text(table + "\n")
        entries = [e for s in summaries for e in paired_vs_megatron_core(s)]
        result = {
            "title": title, "command": command, "load": load, "args": per_rank[0]["args"],
            "device": args.device,
            "paired": [e for e in entries if e["ratio"] is not None],
            "unpaired": [e for e in entries if e["ratio"] is None],
            "summaries": summaries,
        }  # fmt: skip
        (args.out / f"{label}.json").write_text(json.dumps(result, indent=1))
        for s in summaries:
            for name, m in s["methods"].items():
                if not m["timeline"]:  # no profiled step: the compute ran on a stand-in
                    continue
                timeline_png(
                    args.out / f"{label}_{s['block']}_{s['regime']}_{name}.png",
                    f"{title}, {s['block']} fwd+bwd, {s['regime']}: {name}, profiled step "
                    f"{m['profiled_step_s'] * 1e3:.1f} ms (timed median {m['step_s']['median'] * 1e3:.1f} ms)",
                    m["timeline"],
                )


if __name__ == "__main__":
    main()
    exit_without_teardown()
