"""Flash-Overlap benchmark: forward + backward of the MLP and of a whole transformer layer, with
megatron-core's linears (on gloo's collectives and on the P2P exchange), their 4-chunk slicing (gloo),
TransformerEngine's split (P2P) and the Flash-Overlap linears side by side (``--methods`` picks some).
The same-transport comparison with its targets and the UP benchmark: ``benchmarks.flash_overlap.overlap``.

  python -m benchmarks.flash_overlap.run --network loopback --tp 2 4
  python -m benchmarks.flash_overlap.run --network cluster --mbit 400 --tp 2 4     (root: namespaces + tc)

Writes <network>_tp<N>.json / .md and one timeline PNG per block, regime and method under --out, and
prints the tables. Remaining arguments go to ``benchmarks.flash_overlap.rank``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from benchmarks.flash_overlap.report import markdown, summarize, timeline_png
from mdsp_base.shutdown import exit_without_teardown
from multirank import launch_ranks

REPO_ROOT = Path(__file__).resolve().parents[2]
RANK_MODULE = ["-m", "benchmarks.flash_overlap.rank"]


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
    args, rank_args = parser.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for tp in args.tp:
        load_before = os.getloadavg()[0]
        if args.network == "loopback":
            per_rank = run_loopback(tp, rank_args, args.timeout)
            label = f"loopback_tp{tp}"
            title = f"Loopback (127.0.0.1, unshaped), TP={tp}"
        else:
            per_rank = run_cluster(tp, args.mbit, rank_args, args.timeout)
            label = f"cluster{args.mbit:g}_tp{tp}"
            title = f"Emulated cluster, links shaped to {args.mbit:g} Mbit/s, TP={tp}"
        # The host's load decides how much CPU the ranks and gloo's threads get: report it with the figures.
        load = f"host load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
        summaries = [
            summarize(per_rank, regime, block)
            for regime in per_rank[0]["regimes"]
            for block in per_rank[0]["regimes"][regime]["blocks"]
        ]
        table = markdown(f"{title} ({load})", summaries, per_rank[0]["args"])
        print(table, flush=True)
        (args.out / f"{label}.md").write_text(table + "\n")
        (args.out / f"{label}.json").write_text(
            json.dumps(
                {"title": title, "load": load, "args": per_rank[0]["args"], "summaries": summaries}, indent=1
            )
        )
        for s in summaries:
            for name, m in s["methods"].items():
                timeline_png(
                    args.out / f"{label}_{s['block']}_{s['regime']}_{name}.png",
                    f"{title}, {s['block']} fwd+bwd, {s['regime']}: {name}, profiled step "
                    f"{m['profiled_step_s'] * 1e3:.1f} ms (timed median {m['step_s']['median'] * 1e3:.1f} ms)",
                    m["timeline"],
                )


if __name__ == "__main__":
    main()
    exit_without_teardown()
