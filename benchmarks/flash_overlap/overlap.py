"""The overlap, measured on one transport: Flash-Overlap against megatron-core's linears and
TransformerEngine's published split (TP/SP blocks), and Flash-Overlap's UP attention against DeepSpeed's
DistributedAttention (Ulysses), every method's bytes moved by the same P2P exchange. The gloo-collective
figures of megatron-core and DistributedAttention run beside them, labelled as such.

  python -m benchmarks.flash_overlap.overlap --network cluster --quick      (root: namespaces + tc)
  python -m benchmarks.flash_overlap.overlap --network cluster --tp 2 --sp 2 4
  python -m benchmarks.flash_overlap.overlap --network loopback --quick

Writes overlap_<network>[_quick].json / .md under --out and prints the tables. What is swapped for the
same transport: ``benchmarks/flash_overlap/same_transport.py``; TE's split: ``te_split.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.flash_overlap.overlap_report import markdown, targets, up_summary
from benchmarks.flash_overlap.report import summarize
from benchmarks.flash_overlap.run import REPO_ROOT, run_cluster, run_loopback

TP_METHODS = ["megatron_core_p2p", "te_split_p2p", "flash_overlap", "megatron_core"]
UP_MODULE = ["-m", "benchmarks.flash_overlap.ulysses_rank"]
TP_MODULE = ["-m", "benchmarks.flash_overlap.rank"]


def _launch(args: argparse.Namespace, world: int, module: list[str], rank_args: list[str]) -> list[dict]:
    if args.network == "loopback":
        return run_loopback(world, rank_args, args.timeout, module)
    return run_cluster(world, args.mbit, rank_args, args.timeout, module)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--network", choices=("loopback", "cluster"), default="cluster")
    parser.add_argument("--mbit", type=float, default=400.0, help="link rate on the emulated cluster")
    parser.add_argument("--tp", type=int, nargs="*", default=[2], help="TP sizes of the TP/SP blocks")
    parser.add_argument("--sp", type=int, nargs="*", default=[2, 4], help="sequence-parallel sizes of UP")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a few minutes in all)")
    parser.add_argument("--steps", type=int, default=None, help="timed repeats (default 10, quick 5)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed repeats (default 2, quick 1)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "flash_overlap")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    steps = args.steps or (5 if args.quick else 10)
    warmup = args.warmup or (1 if args.quick else 2)
    repeats = ["--steps", str(steps), "--warmup", str(warmup)]
    args.out.mkdir(parents=True, exist_ok=True)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    tp_summaries, up_summaries = [], []
    for tp in args.tp:
        per_rank = _launch(args, tp, TP_MODULE, ["--methods", *TP_METHODS, *repeats])
        tp_summaries += [
            summarize(per_rank, regime, block)
            for regime in per_rank[0]["regimes"]
            for block in per_rank[0]["regimes"][regime]["blocks"]
        ]
    for sp in args.sp:
        per_rank = _launch(args, sp, UP_MODULE, repeats)
        up_summaries += [up_summary(per_rank, regime) for regime in per_rank[0]["regimes"]]
    network = "loopback (127.0.0.1, unshaped)" if args.network == "loopback" else (
        f"emulated cluster, one package, links shaped to {args.mbit:g} Mbit/s"
    )  # fmt: skip
    minutes = (time.monotonic() - started) / 60
    meta = {
        "network": network,
        "load": f"host load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after",
        "wall_minutes": minutes,
        "steps": steps,
        "warmup": warmup,
        "note": (
            f"{network}; {steps} timed repeats after {warmup} warm-up, methods interleaved repeat by repeat; "
            f"host load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; {minutes:.1f} min "
            "in all. Same transport: megatron-core's linears with their collectives swapped for the P2P "
            "exchange, TE's split (ring exchange for qkv/fc1 fprop and proj/fc2 dgrad, pipelined 4-chunk "
            "GEMM + reduce-scatter for proj/fc2 fprop, bulk column backward) on it, DistributedAttention's "
            "all-to-alls on it; gloo rows are references on gloo's own collectives. Bounds are computed "
            "from GEMMs and transfers timed alone, not measured."
        ),
    }
    label = f"overlap_{'cluster' + format(args.mbit, 'g') if args.network == 'cluster' else 'loopback'}"
    label += "_quick" if args.quick else ""
    table = markdown(f"Same-transport overlap benchmark, {network}", tp_summaries, up_summaries, meta)
    print(table, flush=True)
    (args.out / f"{label}.md").write_text(table + "\n")
    for s in tp_summaries:
        for m in s["methods"].values():
            m.pop("timeline", None)  # the per-op spans are run.py's PNGs, not this benchmark's figures
    (args.out / f"{label}.json").write_text(json.dumps(
        {"meta": meta, "targets": targets(tp_summaries, up_summaries), "tp": tp_summaries, "up": up_summaries},
        indent=1,
    ))  # fmt: skip


if __name__ == "__main__":
    main()
