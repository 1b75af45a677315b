"""Planner: the fastest hierarchical ZeRO-3 configuration that fits, written back into your DeepSpeed
JSON, with the Megatron flags it changes.

  python -m deepspeed_ext.zero.plan --model gpt-20b-frontier --nodes 48 --topology frontier
  python -m deepspeed_ext.zero.plan --layers 24 --hidden 2048 --heads 16 --seq 2048 --nodes 4 --topology h100
  python -m deepspeed_ext.zero.plan --model gpt-20b-frontier --nodes 48 --profile profile.json --output-json ds.json

By default it proposes exact plans on the paths that have run on the topology's collective library
(:mod:`deepspeed_ext.zero.cost.verified`), keeps your global batch and leaves 10 % of the memory
free. Your JSON is checked before any work (DeepSpeed's sections, this plugin's; the suite's other
sections when its check is passed to :func:`main`). Every figure comes from the cost model.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from importlib import resources
from pathlib import Path
from statistics import mean

from deepspeed_ext.zero.cost.collectives import FRONTIER_RCCL, H100_NCCL
from deepspeed_ext.zero.cost.projection import Scheme, project
from deepspeed_ext.zero.cost.search import Row, Rules, baseline, evaluate
from deepspeed_ext.zero.cost.uncertainty import systems
from deepspeed_ext.zero.cost.verified import RUN, Backend, has_run
from deepspeed_ext.zero.cost.verified import Path as VerifiedPath
from deepspeed_ext.zero.cost.workload import Model, Recompute, System
from deepspeed_ext.zero.tools.recommend_inputs import (
    PlanInputError,
    check_config,
    check_numbers,
    global_batch,
    measured_costs,
    written_config,
)
from mdsp_base.section import ConfigError
from mdsp_base.shutdown import exit_without_teardown

PRESETS = Path(str(resources.files("mdsp_base") / "presets"))
"""The suite's presets (package data; scripts/presets links here)."""
MODELS = {path.stem: path for path in sorted(PRESETS.glob("*.args"))}
"""Model presets by the names the Slurm scripts take (MODEL=gpt-20b-frontier)."""
ALIASES = {"20b": "gpt-20b-frontier", "1.3b": "gpt-1.3b"}
TOPOLOGIES = {
    "frontier": (System(FRONTIER_RCCL), Backend.RCCL, "GCD"),
    "h100": (
        System(H100_NCCL, ranks_per_node=8, ranks_per_package=1, peak_tflops=989.0, memory_gb=80.0),
        Backend.NCCL,
        "GPU",
    ),
}
"""Documented machines: their costs, collective library and the name of one device."""


def label(row: Row) -> str:
    """The candidate's settings as ``key=value`` words, each explained by :data:`LEGEND`."""
    p = row.plan
    return (
        f"TP={p.tp} copy={p.secondary.value if p.secondary else 'none'} inter-node={p.inter_node} "
        f"weights={'int8' if p.quantized_weights else 'bf16'} "
        f"grads={'int4' if p.quantized_gradients else 'bf16'} "
        f"sync={'boundary' if p.boundary_sync else 'every-mb'} chunks={p.pipeline_chunks} "
        f"bucket={p.buckets.prefetch:.0e} mb={p.micro_batch} recompute={p.recompute.value}"
    )


LEGEND = (
    "candidate: TP = --tensor-model-parallel-size; copy = hierarchical_zero.secondary_level (the level "
    "holding the secondary bf16 weight copy, none without one); inter-node = inter_node_algorithm; "
    "weights, grads = what crosses nodes (int8/int4: quantized_weights/quantized_gradients); sync = "
    "grad_sync (every micro-batch, or at the accumulation boundary); chunks = pipeline_chunks; bucket = "
    "stage3_prefetch_bucket_size; mb = --micro-batch-size; recompute = --recompute-granularity (none: off)"
)
"""What each word of a candidate's label means, by the setting it writes."""


def megatron_flags(row: Row, model: Model, batch: int) -> list[str]:
    """The flags of ``scripts/pretrain_gpt.py`` (Megatron-LM's and Megatron-DeepSpeed's names) that
    the plan sets."""
    p = row.plan
    flags = [
        f"--tensor-model-parallel-size {p.tp}",
        f"--micro-batch-size {p.micro_batch}",
        f"--global-batch-size {batch}",
        f"--num-layers {model.layers} --hidden-size {model.hidden} --num-attention-heads {model.heads}",
        f"--seq-length {model.seq}",
    ]
    if p.recompute != Recompute.NONE:
        flags.append(f"--recompute-granularity {p.recompute.value}")
        # Megatron's full recomputation needs both: every layer checkpointed on its own.
        flags += (
            ["--recompute-method uniform --recompute-num-layers 1"] if p.recompute == Recompute.FULL else []
        )
    return flags


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deepspeed_ext.zero.plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    names = sorted(MODELS) + sorted(ALIASES)
    parser.add_argument("--model", choices=names, help="a preset, as the Slurm scripts name it")
    for flag in ("--layers", "--hidden", "--heads", "--seq"):
        parser.add_argument(flag, type=int, help="the model's shape, without --model")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument(
        "--topology", choices=sorted(TOPOLOGIES), default="frontier", help="(default: %(default)s)"
    )
    parser.add_argument("--memory-gb", type=float, help="memory per device (default: the topology's)")
    parser.add_argument(
        "--ds-config", type=Path, default=PRESETS / "ds_frontier_20b.json", help="(default: the 20B preset)"
    )
    parser.add_argument(
        "--grad-accum", type=int, help="default: the DeepSpeed JSON's gradient_accumulation_steps"
    )
    parser.add_argument(
        "--global-batch", type=int, help="sequences per step to keep (default: your configuration's)"
    )
    parser.add_argument("--free-batch", action="store_true", help="let the plan change the global batch")
    parser.add_argument("--headroom", type=float, default=0.1, help="memory left free (default: %(default)s)")
    parser.add_argument(
        "--allow-lossy", action="store_true", help="also int8 weights / int4 gradients across nodes"
    )
    parser.add_argument(
        "--allow-unverified", action="store_true", help="also settings that have not run on this backend"
    )
    parser.add_argument("--top", type=int, default=10, help="rows to print (0: all; default: %(default)s)")
    parser.add_argument(
        "--profile", type=Path, help="a probe profile: this cluster's measured collective costs"
    )
    parser.add_argument(
        "--output-json", type=Path, help="write --ds-config with the best plan's changes here"
    )
    return parser


def _model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Model, Path | None]:
    if args.model:
        path = MODELS[ALIASES.get(args.model, args.model)]
        return Model.from_megatron_args(path), path
    if None in (args.layers, args.hidden, args.heads, args.seq):
        parser.error("give --model, or all of --layers --hidden --heads --seq")
    return Model(args.layers, args.hidden, args.heads, args.seq), None


def _print_table(rows: list[Row], top: int, device: str) -> None:
    print(
        f"| | candidate | TFLOPS/{device} | GB/rank (peak) | settings not run here | vs ZeRO-3 | vs hpZ (DeepSpeed) | vs hpZ (ideal) | vs ZeRO++ |"
    )
    print("|---|---|---:|---:|---|---:|---:|---:|---:|")
    for i, r in enumerate(rows[: top or None]):
        cols = " | ".join(f"{r.ratios[k]:.2f}x" for k in ("zero3", "hpz", "hpz_ideal", "zeropp"))
        lossy = " (lossy)" if r.plan.quantized_weights else ""
        unrun = ", ".join(r.unverified) or "-"
        print(
            f"| {'best' if i == 0 else ''} | {label(r)}{lossy} | {r.projection.tflops_per_gcd:.3g} | "
            f"{r.peak_bytes / 1e9:.1f} | {unrun} | {cols} |"
        )


def _ranges(
    system: System, model: Model, nodes: int, best: Row, ds: dict, measured: bool, device: str
) -> str:
    """The best row's TFLOPS and ratio to hpZ (as the table prices it) over every combination of the
    uncertain inputs, and the input whose values move the TFLOPS most (averaged over the others)."""
    tflops, vs_hpz = [], []
    by_input: dict[str, dict[float, list[float]]] = {}
    for inputs, s in systems(system, sweep_collectives=system.costs is FRONTIER_RCCL and not measured):
        mine = project(s, model, nodes, best.plan).tflops_per_gcd
        hpz = project(s, model, nodes, baseline(best.plan, Scheme.HPZ, ds)).tflops_per_gcd
        tflops.append(mine)
        vs_hpz.append(mine / hpz)
        for name, value in inputs.items():
            by_input.setdefault(name, {}).setdefault(value, []).append(mine)
    spread = {
        name: max(map(mean, runs.values())) - min(map(mean, runs.values())) for name, runs in by_input.items()
    }
    top = max(spread, key=spread.__getitem__)
    values = sorted(by_input[top])
    return (
        f"best row over the uncertain inputs ({len(tflops)} combinations): {min(tflops):.3g}-{max(tflops):.3g} "
        f"TFLOPS/{device}, {min(vs_hpz):.2f}-{max(vs_hpz):.2f}x hpZ; most of the spread is {top} "
        f"({values[0]:g}-{values[-1]:g} moves it {spread[top]:.3g} TFLOPS/{device} on average)"
    )


NO_GAIN = 1.01
"""The best plan must project at least this many times stock ZeRO-3's TFLOPS to be recommended: below
it (one node, where no byte crosses a NIC, for one) the planner writes stock ZeRO-3 instead."""


def no_gain(best: Row) -> str | None:
    """Why the best plan is not recommended over stock ZeRO-3 at its TP (None: it is)."""
    ratio = best.ratios["zero3"]
    if ratio >= NO_GAIN:
        return None
    return (
        f"the best plan projects {ratio:.2f}x stock ZeRO-3's TFLOPS at the same TP (below {NO_GAIN:g}x): "
        "hierarchical ZeRO saves NIC bytes, and here they do not set the step"
    )


def _what_has_run(backend: Backend, allow_unverified: bool) -> str:
    """What the proposed plans' paths have run on ``backend``, in :mod:`~deepspeed_ext.zero.cost.verified`'s words."""
    if allow_unverified:
        return f"Paths not run on {backend} included (column 'settings not run here'). "
    others = [p.value for p in VerifiedPath if p not in (VerifiedPath.LIBRARY_HOPS, VerifiedPath.PROBE)]
    ran = [p for p in others if has_run(VerifiedPath(p), backend)]
    rest = f"besides it only {', '.join(ran)}, which have run there" if ran else "no other path has run there"
    return f"Path: {VerifiedPath.LIBRARY_HOPS.value}, run on {backend}: {RUN[VerifiedPath.LIBRARY_HOPS][backend]}; {rest}. "


def main(argv: list[str] | None = None, check_sections: Callable[[dict], object] | None = None) -> list[Row]:
    """The planner's command: prints the candidates and writes the JSON asked for.

    Args:
        argv: the command line; None: ``sys.argv``.
        check_sections: the suite's check of every plugin section of ``--ds-config``; None: this
            plugin's own section only (see :func:`~.recommend_inputs.check_config`).

    Returns:
        The rows printed, best first. A refused input exits 2 with one error line.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        check_numbers(args)  # before anything divides by them
    except PlanInputError as exc:
        parser.exit(2, f"error: {exc}\n")
    model, preset = _model(args, parser)
    system, backend, device = TOPOLOGIES[args.topology]
    system = replace(system, memory_gb=args.memory_gb) if args.memory_gb else system
    try:
        ds = json.loads(args.ds_config.read_text())
        check_config(ds, args.ds_config, check_sections)
        measured = measured_costs(args.profile, system, backend, args.nodes) if args.profile else None
        if measured is not None:
            system = measured.system
            for note in measured.notes:
                print(f"warning: {note}", file=sys.stderr)
        grad_accum = args.grad_accum or int(ds.get("gradient_accumulation_steps", 1))
        batch = global_batch(ds, preset, system.ranks_per_node * args.nodes, grad_accum, args.global_batch)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, PlanInputError, ConfigError) as exc:
        parser.exit(2, f"error: {exc}\n")
    rules = Rules(
        backend,
        measured=measured is not None and measured.verifies,
        allow_lossy=args.allow_lossy,
        allow_unverified=args.allow_unverified,
        global_batch=None if args.free_batch else batch,
        headroom=args.headroom,
        build_bytes_per_param=2 if (ds.get("bf16") or {}).get("enabled") else 4,
    )

    def progress(done: int, total: int) -> None:
        if done % 50 == 0:
            print(f"projecting candidates: {done}/{total}", file=sys.stderr, flush=True)

    rows = evaluate(system, model, args.nodes, ds, grad_accum, rules, progress)
    if not rows:
        parser.exit(
            2,
            f"error: no plan fits {system.memory_gb:g} GB per {device} less {args.headroom:.0%} headroom at a "
            f"global batch of {batch} (DP x accumulation must divide it): more nodes, --free-batch, or --allow-lossy\n",
        )
    best = rows[0]
    kept = f"{batch} sequences, kept" if rules.global_batch else "free (--free-batch)"
    print(
        f"{model.params / 1e9:.1f}B GPT on {args.nodes} nodes ({args.topology}, {backend}, {system.memory_gb:g} GB "
        f"less {args.headroom:.0%} headroom), accumulation {grad_accum}, global batch {kept}; "
        f"COMPUTED by the cost model (costs: {system.costs.system}), not measured. "
        f"{'Lossy plans included. ' if args.allow_lossy else 'Exact plans only. '}"
        f"{_what_has_run(backend, args.allow_unverified)}"
        f"{len(rows)} fit."
    )
    print(_ranges(system, model, args.nodes, best, ds, args.profile is not None, device))
    _print_table(rows, args.top, device)
    print(LEGEND)
    plan_batch = (
        best.plan.micro_batch * best.plan.grad_accum * system.ranks_per_node * args.nodes // best.plan.tp
    )
    profile = args.profile if measured is not None and measured.job_reads_it else None
    written = written_config(ds, best.plan, profile, plan_batch)
    why = no_gain(best)
    if why is not None:
        written["hierarchical_zero"]["enabled"] = False
        print(
            f"\nNo gain: {why}. Keep stock ZeRO-3: the JSON below is the best plan's with hierarchical_zero off."
        )
    print(
        "\nDeepSpeed JSON (your --ds-config with the best plan's changes):\n" + json.dumps(written, indent=1)
    )
    print("\nMegatron flags:\n" + " ".join(megatron_flags(best, model, plan_batch)))
    if args.output_json:
        args.output_json.write_text(json.dumps(written, indent=1) + "\n")
        print(f"\nwrote {args.output_json}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
    exit_without_teardown()
