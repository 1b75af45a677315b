"""Planner CLI: the fastest hierarchical ZeRO-3 configuration that fits, and the DeepSpeed / Megatron
settings for it.

  python -m deepspeed_ext.zero.plan --model 20b --nodes 48 --topology frontier --memory-gb 64
  python -m deepspeed_ext.zero.plan --layers 32 --hidden 4096 --heads 32 --seq 2048 --nodes 16 --topology h100
  python -m deepspeed_ext.zero.plan --model 20b --nodes 48 --profile profile.json   # the probe's measured costs

Per candidate (TP, secondary level, inter-node algorithm, quantization, boundary sync, pipeline
chunks, DeepSpeed buckets) the largest micro-batch and the least recomputation that fit, the
projected TFLOPS per GCD and memory per rank, and the ratio to ZeRO-3, hpZ (as DeepSpeed runs it:
consecutive-rank groups, TP peers at TP > 1) and ZeRO++ (hpZ + qwZ + qgZ) at the same TP,
micro-batch and buckets of the DeepSpeed JSON. All figures are computed (deepspeed_ext/zero/cost/projection.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import replace
from pathlib import Path

from deepspeed_ext.zero.config import InterNodeAlgorithm
from deepspeed_ext.zero.cost.collectives import FRONTIER_RCCL, H100_NCCL
from deepspeed_ext.zero.cost.projection import Plan, Projection, Scheme, memory, project, shape
from deepspeed_ext.zero.cost.workload import Buckets, Model, Recompute, System
from deepspeed_ext.zero.profile import parse
from plugin_base.topology import LinkClass

PRESETS = Path(__file__).resolve().parents[2] / "scripts" / "presets"
MODELS = {"20b": PRESETS / "gpt-20b-frontier.args", "1.3b": PRESETS / "gpt-1.3b.args"}
TOPOLOGIES = {
    "frontier": System(FRONTIER_RCCL),
    "h100": System(H100_NCCL, ranks_per_node=8, ranks_per_package=1, peak_tflops=989.0, memory_gb=80.0),
}
BUCKETS = (50_000_000, 200_000_000)
"""Prefetch and reduce bucket sizes (elements) the plan tries."""
MICRO_BATCHES = (8, 4, 2, 1)


def measured_system(path: Path, base: System) -> System:
    """``base`` with a probe profile's topology and measured collective costs (the costs it did not
    measure, the peak and the memory stay ``base``'s)."""
    profile = parse(json.loads(path.read_text()), str(path))
    return replace(
        base,
        costs=profile.costs(base.costs),
        ranks_per_node=profile.topology["ranks_per_node"],
        ranks_per_package=profile.topology["ranks_per_package"],
    )


def fitting(system: System, model: Model, nodes: int, plan: Plan) -> tuple[Plan, Projection] | None:
    """``plan`` at the micro-batch and recomputation that fit the memory and project fastest: for
    each recomputation its largest fitting micro-batch. None when nothing fits."""
    s = shape(system, nodes, plan.tp)
    best = None
    for rc in Recompute:
        for mb in MICRO_BATCHES:
            candidate = replace(plan, micro_batch=mb, recompute=rc)
            if memory(system, model, s, candidate)["total"] <= system.memory_gb * 1e9:
                mine = project(system, model, nodes, candidate)
                if best is None or mine.tflops_per_gcd > best[1].tflops_per_gcd:
                    best = candidate, mine
                break
    return best


def candidates(system: System, model: Model, grad_accum: int) -> list[Plan]:
    """Every configuration of ours worth projecting."""
    out = []
    for tp in (t for t in (1, 2, 4, 8) if system.ranks_per_node % t == 0 and model.heads % t == 0):
        levels = [None, LinkClass.NODE] + ([LinkClass.PACKAGE] if system.ranks_per_package // tp > 1 else [])
        syncs = (False, True) if grad_accum > 1 else (False,)
        for level, alg, quant, sync, chunks, bucket in itertools.product(
            levels, InterNodeAlgorithm, (False, True), syncs, (1, 4), BUCKETS
        ):
            plan = Plan(
                Scheme.OURS,
                tp=tp,
                grad_accum=grad_accum,
                secondary=level,
                inter_node=alg,
                quantized_weights=quant,
                quantized_gradients=quant,
                boundary_sync=sync,
                pipeline_chunks=chunks,
                buckets=Buckets(prefetch=bucket, reduce=bucket, max_live=3 * bucket),
            )
            out.append(plan)
    return out


def baselines(
    system: System, model: Model, nodes: int, plan: Plan, ds_buckets: Buckets
) -> dict[str, Projection]:
    """ZeRO-3, hpZ (DeepSpeed's and idealized) and ZeRO++ at the plan's TP, micro-batch, recomputation."""
    return {
        scheme.value: project(system, model, nodes, replace(plan, scheme=scheme, buckets=ds_buckets))
        for scheme in (Scheme.ZERO3, Scheme.HPZ, Scheme.HPZ_IDEAL, Scheme.ZEROPP)
    }


def sections(plan: Plan, model: Model, ds: dict) -> tuple[dict, list[str]]:
    """The DeepSpeed JSON sections and the Megatron flags of ``plan``."""
    zero = dict(ds.get("zero_optimization") or {"stage": 3})
    zero.update(
        stage3_prefetch_bucket_size=plan.buckets.prefetch,
        reduce_bucket_size=plan.buckets.reduce,
        stage3_max_live_parameters=plan.buckets.max_live,
    )
    hz = {
        "enabled": True,
        "secondary_level": plan.secondary.value if plan.secondary else "auto",
        "grad_sync": "accumulation_boundary" if plan.boundary_sync else "every_micro_batch",
        "quantized_weights": plan.quantized_weights,
        "quantized_gradients": "int4" if plan.quantized_gradients else "none",
        "inter_node_algorithm": plan.inter_node.value,
        "pipeline_chunks": plan.pipeline_chunks,
    }
    section = {
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "zero_optimization": zero,
        "hierarchical_zero": hz,
    }
    flags = [
        f"--tensor-model-parallel-size {plan.tp}",
        f"--micro-batch-size {plan.micro_batch}",
        f"--num-layers {model.layers}",
        f"--hidden-size {model.hidden}",
        f"--num-attention-heads {model.heads}",
        f"--seq-length {model.seq}",
    ]
    if plan.recompute != Recompute.NONE:
        flags.append(f"--recompute-granularity {plan.recompute.value}")
        flags += ["--recompute-method uniform"] if plan.recompute == Recompute.FULL else []
    return section, flags


def label(plan: Plan) -> str:
    quant = "int8/int4" if plan.quantized_weights else "bf16"
    return (
        f"TP={plan.tp} {plan.secondary.value if plan.secondary else 'no copy'} {plan.inter_node} {quant} "
        f"{'boundary' if plan.boundary_sync else 'every-mb'} chunks={plan.pipeline_chunks} "
        f"bucket={plan.buckets.prefetch:.0e} mb={plan.micro_batch} {plan.recompute.value}"
    )


def evaluate(system: System, model: Model, nodes: int, ds: dict, grad_accum: int) -> list[dict]:
    """Every candidate that fits, fastest first, with its baselines' ratios (computed)."""
    ds_buckets = Buckets.from_json(ds)
    rows, cache = [], {}
    for candidate in candidates(system, model, grad_accum):
        found = fitting(system, model, nodes, candidate)
        if found is None:
            continue
        plan, mine = found
        key = (plan.tp, plan.micro_batch, plan.recompute)
        if key not in cache:
            cache[key] = baselines(system, model, nodes, plan, ds_buckets)
        ratios = {k: mine.tflops_per_gcd / v.tflops_per_gcd for k, v in cache[key].items()}
        rows.append({"plan": plan, "projection": mine, "ratios": ratios})
    return sorted(rows, key=lambda r: -r["projection"].tflops_per_gcd)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), help="a preset (scripts/presets/*.args)")
    for flag in ("--layers", "--hidden", "--heads", "--seq"):
        parser.add_argument(flag, type=int, help="the model's shape, without --model")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--topology", choices=sorted(TOPOLOGIES), default="frontier")
    parser.add_argument("--memory-gb", type=float, help="memory per GPU (default: the topology's)")
    parser.add_argument("--ds-config", type=Path, default=PRESETS / "ds_frontier_20b.json")
    parser.add_argument(
        "--grad-accum", type=int, help="default: the DeepSpeed JSON's gradient_accumulation_steps"
    )
    parser.add_argument("--top", type=int, default=20, help="rows to print (0: all)")
    parser.add_argument(
        "--profile", type=Path, help="a probe profile: its topology and measured collective costs"
    )
    parser.add_argument("--output-json", type=Path, help="write the best plan's DeepSpeed sections here")
    args = parser.parse_args(argv)
    if args.model:
        model = Model.from_megatron_args(MODELS[args.model])
    elif None in (args.layers, args.hidden, args.heads, args.seq):
        raise SystemExit("give --model, or all of --layers --hidden --heads --seq")
    else:
        model = Model(args.layers, args.hidden, args.heads, args.seq)
    system = TOPOLOGIES[args.topology]
    system = replace(system, memory_gb=args.memory_gb) if args.memory_gb else system
    if args.profile:
        system = measured_system(args.profile, system)
    ds = json.loads(args.ds_config.read_text())
    grad_accum = args.grad_accum or int(ds.get("gradient_accumulation_steps", 1))
    rows = evaluate(system, model, args.nodes, ds, grad_accum)
    if not rows:
        raise SystemExit(f"no candidate fits {system.memory_gb} GB per GPU: more nodes or a larger TP")
    print(
        f"{model.params / 1e9:.1f}B GPT on {args.nodes} nodes ({args.topology}, {system.memory_gb:g} GB), "
        f"grad-accum {grad_accum}; computed (deepspeed_ext/zero/cost/projection.py; costs: {system.costs.system}); "
        f"{len(rows)} candidates fit"
    )
    print(
        "| | candidate | TFLOPS/GCD | GB/rank | vs ZeRO-3 | vs hpZ (DeepSpeed) | vs hpZ (ideal) | vs ZeRO++ |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for i, r in enumerate(rows[: args.top or None]):
        p, q = r["plan"], r["projection"]
        cols = " | ".join(f"{r['ratios'][k]:.2f}x" for k in ("zero3", "hpz", "hpz_ideal", "zeropp"))
        mark = "best" if i == 0 else ""
        print(f"| {mark} | {label(p)} | {q.tflops_per_gcd:.1f} | {q.memory['total'] / 1e9:.1f} | {cols} |")
    section, flags = sections(rows[0]["plan"], model, ds)
    print("\nDeepSpeed JSON (best plan):\n" + json.dumps(section, indent=1))
    print("\nMegatron flags:\n" + " ".join(flags))
    if args.output_json:
        args.output_json.write_text(json.dumps(section, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
