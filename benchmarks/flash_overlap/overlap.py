"""The overlap, measured on one transport: Flash-Overlap against megatron-core's linears and
TransformerEngine's published split (TP/SP blocks), and Flash-Overlap's UP attention against DeepSpeed's
DistributedAttention (Ulysses), every method's bytes moved by the same P2P exchange. The gloo-collective
figures of megatron-core and DistributedAttention run beside them, labelled as such.

Method in full: benchmarks/results/methods.md, `benchmarks.flash_overlap.overlap`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.device import TABLES, add_device_flags
from benchmarks.flash_overlap.overlap_report import LABELS, markdown, up_summary
from benchmarks.flash_overlap.paired import table
from benchmarks.flash_overlap.report import summarize
from benchmarks.flash_overlap.run import (
    REPO_ROOT,
    check_device_flags,
    device_note,
    launch_dilation,
    rank_device_flags,
    run_cluster,
    run_loopback,
)
from benchmarks.flash_overlap.slices import best_compute_slices
from benchmarks.flash_overlap.targets import paired_across, targets, targets_markdown
from mdsp_base.paired import MIN_PAIRS
from mdsp_base.shutdown import exit_without_teardown

TP_METHODS = ["megatron_core_p2p", "te_split_p2p", "flash_overlap", "megatron_core"]
UP_MODULE = ["-m", "benchmarks.flash_overlap.ulysses_rank"]
TP_MODULE = ["-m", "benchmarks.flash_overlap.rank"]
PRESETS = {"1.3b": (2048, 16), "20b": (6144, 64)}
"""(hidden, attention heads) of the GPT presets whose layers ``--preset`` stacks (MLP width 4 h)."""


def _tp_regime(args: argparse.Namespace) -> str:
    """A preset keeps its real MLP width; without one the width is tuned to the balanced regime."""
    return "fixed" if args.preset else "balanced"


def _tp_args(args: argparse.Namespace, tp: int) -> list[str]:
    """The TP rank's sizes: a preset's stack of layers (whole sequence ``--seq``), or the tuned MLP
    and layer at the rank's default sizes."""
    if not args.preset:
        return ["--methods", *TP_METHODS, "--regimes", _tp_regime(args)]
    hidden, heads = PRESETS[args.preset]
    merged = args.merged[tp]["gemms"]
    return [
        "--methods", *TP_METHODS, "domino_p2p", *(["flash_overlap_merged"] if merged else []),
        "--compute-slices", str(merged), "--regimes", "fixed", "--blocks", "layers",
        "--layers", str(args.layers), "--hidden", str(hidden), "--heads", str(heads),
        "--ffn", str(4 * hidden), "--seq-per-rank", str(args.seq // tp), "--batch", str(args.batch),
    ]  # fmt: skip


def _merged(parser: argparse.ArgumentParser, args: argparse.Namespace, tp: int) -> dict:
    """GEMMs per collective of ``flash_overlap_merged`` at TP=tp (0: it does not run) and, for
    ``auto``, every candidate's computed layer forward (``benchmarks.flash_overlap.slices``)."""
    if args.compute_slices is None:
        return {"gemms": 0, "computed_layer_forward_s": None}
    if not args.preset:
        parser.error("--compute-slices runs on a preset's stack of layers: pass --preset")
    if args.compute_slices == "auto" and (args.device == "host" or args.network != "cluster"):
        parser.error(
            "--compute-slices auto reads a device table and a link: pass --device h100 or mi250x "
            "and --network cluster, or give the count"
        )
    if args.compute_slices != "auto":
        gemms = int(args.compute_slices)
        if not 2 <= gemms < tp:
            parser.error(f"--compute-slices {gemms} at TP={tp}: merging needs 2 to {tp - 1} GEMMs")
        return {"gemms": gemms, "computed_layer_forward_s": None}
    hidden = PRESETS[args.preset][0]
    link = args.mbit * 1e6 / 8 * _dilation(args, tp, args.mbit)  # bytes per second of device time
    tokens = args.seq * args.batch
    gemms, times = best_compute_slices(TABLES[args.device], tokens, hidden, 4 * hidden, tp, link)
    return {"gemms": gemms, "computed_layer_forward_s": times}


def _check_preset(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse preset sizes that a TP or SP degree does not divide, before any launch."""
    if not args.preset:
        return
    heads = PRESETS[args.preset][1]
    for tp in args.tp:
        if args.seq % (4 * tp) or heads % tp:
            parser.error(
                f"--preset {args.preset} at TP={tp}: --seq {args.seq} must be a multiple of 4 x {tp} "
                f"(the 4-chunk slicing cuts each rank's share in 4) and {tp} must divide its {heads} heads"
            )
    if args.batch % 2:
        parser.error(f"--batch {args.batch}: Domino splits the micro-batch in two halves, so it must be even")
    for sp in args.sp:
        if args.seq % sp:
            parser.error(f"--preset {args.preset} at SP={sp}: --seq {args.seq} must be a multiple of {sp}")


def _up_args(args: argparse.Namespace, sp: int) -> list[str]:
    """The UP rank's sizes: a preset's whole sequence ``--seq`` cut over SP ranks, or its defaults."""
    if not args.preset:
        return []
    return ["--seq-per-rank", str(args.seq // sp), "--batch", str(args.batch)]


def _launch(
    args: argparse.Namespace, world: int, module: list[str], rank_args: list[str], mbit: float
) -> list[dict]:
    flags = rank_device_flags(args, _dilation(args, world, mbit))
    if args.network == "loopback":
        return run_loopback(world, [*rank_args, *flags], args.timeout, module)
    return run_cluster(world, mbit, [*rank_args, *flags], args.timeout, module)


def _dilation(args: argparse.Namespace, world: int, mbit: float) -> float:
    return launch_dilation(args, world, None if args.network == "loopback" else mbit)


def _tp_launches(args: argparse.Namespace, tp: int, repeats: list[str]) -> list[list[dict]]:
    """Every launch's summaries at TP=tp, the MLP width tuned by the first launch and kept."""
    runs, fixed, regime = [], [], _tp_regime(args)
    for _ in range(args.launches):
        rank_args = [*_tp_args(args, tp), *fixed, *repeats]
        per_rank = _launch(args, tp, TP_MODULE, rank_args, args.mbit)
        if not args.preset:
            fixed = fixed or ["--ffn", str(per_rank[0]["regimes"][regime]["ffn"])]
        runs.append(
            [summarize(per_rank, regime, block) for block in per_rank[0]["regimes"][regime]["blocks"]]
        )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--network", choices=("loopback", "cluster"), default="cluster")
    parser.add_argument("--mbit", type=float, default=400.0, help="link rate on the emulated cluster")
    parser.add_argument("--tp", type=int, nargs="*", default=[2], help="TP sizes of the TP/SP blocks")
    parser.add_argument("--sp", type=int, nargs="*", default=[2], help="sequence-parallel sizes of UP")
    parser.add_argument("--up-mbit", type=float, default=100.0, help="link rate of the UP runs")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="time a stack of this GPT preset's layers at its real shapes (TP, with Domino) and its "
        "sequence under UP, instead of the tuned MLP and layer",
    )
    parser.add_argument("--layers", type=int, default=4, help="layers of a preset's stack")
    parser.add_argument(
        "--compute-slices",
        default=None,
        help="also run Flash-Overlap with this many GEMMs per collective (flash_overlap_merged), or "
        "auto: the count whose layer forward the device table and the link time first (0 there: not run)",
    )
    parser.add_argument("--seq", type=int, default=2048, help="whole sequence of a preset's runs")
    parser.add_argument(
        "--batch", type=int, default=2, help="micro-batch of a preset's runs (Domino halves it)"
    )
    parser.add_argument(
        "--launches", type=int, default=None, help="fresh launches per size (default 5, quick 1)"
    )
    parser.add_argument("--quick", action="store_true", help="one launch (a few minutes in all)")
    parser.add_argument("--steps", type=int, default=MIN_PAIRS, help=f"timed repeats (default {MIN_PAIRS})")
    parser.add_argument("--warmup", type=int, default=None, help="untimed repeats (default 2, quick 1)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "flash_overlap")
    parser.add_argument("--timeout", type=float, default=1800.0)
    add_device_flags(parser, dilation=None)
    args = parser.parse_args()
    check_device_flags(parser, args)
    _check_preset(parser, args)
    args.merged = {tp: _merged(parser, args, tp) for tp in args.tp}
    argv = sys.argv[1:]
    steps = args.steps
    warmup = args.warmup or (1 if args.quick else 2)
    args.launches = args.launches or (1 if args.quick else 5)
    if steps * args.launches < MIN_PAIRS:
        parser.error(
            f"--steps x --launches = {steps * args.launches}: a paired comparison needs {MIN_PAIRS} pairs"
        )
    repeats = ["--steps", str(steps), "--warmup", str(warmup)]
    args.out.mkdir(parents=True, exist_ok=True)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    tp_runs = [_tp_launches(args, tp, repeats) for tp in args.tp]
    up_runs = []
    for sp in args.sp:
        up_args = [*_up_args(args, sp), *repeats]
        launches = [_launch(args, sp, UP_MODULE, up_args, args.up_mbit) for _ in range(args.launches)]
        up_runs.append(
            [[up_summary(per_rank, regime) for regime in per_rank[0]["regimes"]] for per_rank in launches]
        )
    tp_summaries = [s for runs in tp_runs for s in runs[0]]
    up_summaries = [s for runs in up_runs for s in runs[0]]
    network = "loopback (127.0.0.1, unshaped)" if args.network == "loopback" else (
        f"emulated cluster, one package, links shaped to {args.mbit:g} Mbit/s (TP), {args.up_mbit:g} Mbit/s (UP)"
    )  # fmt: skip
    dilations = {
        **{f"tp{tp}": _dilation(args, tp, args.mbit) for tp in args.tp},
        **{f"sp{sp}": _dilation(args, sp, args.up_mbit) for sp in args.sp},
    }
    compute = "; ".join(f"{case}: {device_note(args, d)}" for case, d in dilations.items())
    if args.device == "host":
        compute = device_note(args, 1.0)
    minutes = (time.monotonic() - started) / 60
    meta = {
        "network": network,
        "load": f"host load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after",
        "wall_minutes": minutes,
        "steps": steps,
        "warmup": warmup,
        "compute": compute,
        "note": (
            f"{network}; {compute}; {args.launches} launch(es) per size, each {steps} timed repeats after "
            f"{warmup} warm-up, methods interleaved repeat by repeat; "
            f"host load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; {minutes:.1f} min "
            "in all. Same transport: megatron-core's linears with their collectives swapped for the P2P "
            "exchange, TE's split (ring exchange for qkv/fc1 fprop and proj/fc2 dgrad, pipelined 4-chunk "
            "GEMM + reduce-scatter for proj/fc2 fprop, bulk column backward) on it, DistributedAttention's "
            "all-to-alls on it; gloo rows are references on gloo's own collectives. Bounds are computed "
            "from GEMMs and transfers timed alone, not measured."
        ),
    }
    label = f"overlap_{'cluster' + format(args.mbit, 'g') if args.network == 'cluster' else 'loopback'}"
    label += ("" if args.device == "host" else f"_{args.device}") + (f"_{args.preset}" if args.preset else "")
    if args.preset:  # one command per size at its own link rate: each keeps its file
        label += "".join(
            f"_{kind}{'-'.join(map(str, sizes))}"
            for kind, sizes in (("tp", args.tp), ("sp", args.sp))
            if sizes
        )
    label += f"_slices-{args.compute_slices}" if args.compute_slices else ""
    label += (f"_contention{args.contention:g}" if args.contention else "") + ("_quick" if args.quick else "")
    entries = paired_across(tp_runs, up_runs)
    rows = targets(entries, tp_runs, up_runs)
    page = "\n".join([
        f"### Same-transport overlap benchmark, {network}", "",
        f"`python -m benchmarks.flash_overlap.overlap {' '.join(argv)}` (measured; {compute})", "",
        f"**Targets**, paired over {args.launches} launch(es) x {steps} repeats (ratio ours / baseline, 95 % "
        "interval from the per-pair log ratios; met only where the interval excludes 1):", "",
        *targets_markdown(rows), "", "**Every paired comparison** (exposed = step - the compute-only twin "
        "of the same repeat):", "", *table(entries, LABELS), "", "#### The first launch in detail", "",
        markdown(f"Launch 1 of {args.launches}", tp_summaries, up_summaries, meta),
    ])  # fmt: skip
    print(page, flush=True)
    (args.out / f"{label}.md").write_text(page + "\n")
    for s in tp_summaries:
        for m in s["methods"].values():
            m.pop("timeline", None)  # the per-op spans are run.py's PNGs, not this benchmark's figures
    result = {
        "meta": meta, "device": args.device, "dilation": dilations,
        "paired": [e for e in entries if e["ratio"] is not None],
        "unpaired": [e for e in entries if e["ratio"] is None],
        "targets": rows, "tp": tp_summaries, "up": up_summaries,
        "compute_slices": {f"tp{tp}": merged for tp, merged in args.merged.items()},
    }  # fmt: skip
    (args.out / f"{label}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
    exit_without_teardown()
