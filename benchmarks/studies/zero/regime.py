"""The regime a step runs in, as dimensionless numbers: Frontier's (computed) against the emulated
cluster's (from an A/B run's counted collectives and its probe profile).

Method in full: benchmarks/results/methods.md, `benchmarks.studies.zero.regime`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path

from benchmarks.studies.zero import calibration
from benchmarks.zero.link_regime import Message, link_regimes
from deepspeed_ext.zero.cost.collectives import Algorithm, Operation
from deepspeed_ext.zero.cost.projection import (
    Candidate,
    Projection,
    Scheme,
    gather_calls,
    hop_levels,
    reduce_calls,
    shape,
)
from deepspeed_ext.zero.cost.search import Rules, evaluate, fitting
from deepspeed_ext.zero.cost.shape import DPShape
from deepspeed_ext.zero.cost.verified import Backend
from deepspeed_ext.zero.cost.workload import Buckets, Model, System
from mdsp_base.shutdown import exit_without_teardown
from mdsp_base.topology import LinkClass

FRONTIER_NODES = 48
PRESET = Path(__file__).resolve().parents[3] / "scripts" / "presets" / "ds_frontier_20b.json"
PLANNER_RULES = Rules(Backend.RCCL, build_bytes_per_param=2)
"""The planner CLI's defaults with the batch free: exact plans that have run on RCCL, 10 % headroom,
the bf16 build counted."""


def _flat(op: Operation, s: DPShape, nbytes: float, count: float) -> list[Message]:
    """A library collective over the whole group: a ring over every rank, set by its slowest link."""
    if s.nodes > 1:
        link = LinkClass.INTER_NODE
    else:
        link = LinkClass.NODE if s.per_node > s.per_package else LinkClass.PACKAGE
    return [Message(op, Algorithm.RING, link, s.size, nbytes, count)]


def _hops(op: Operation, s: DPShape, nbytes: float, count: float, inter: Algorithm) -> list[Message]:
    return [
        Message(op, inter if link == LinkClass.INTER_NODE else Algorithm.RING, link, members, size, count)
        for members, link, size in hop_levels(s, nbytes)
    ]


def frontier_messages(system: System, model: Model, nodes: int, plan: Candidate) -> list[Message]:
    """The collectives of one step of an exact ``plan`` (ZeRO-3, hpZ or ours) as the cost model
    charges them (:func:`deepspeed_ext.zero.cost.projection.comm_seconds`), a flat collective by the
    link that sets its time; ours' inter-node hops by the plan's algorithm (``auto`` taken as ring)."""
    if plan.quantized_weights or plan.quantized_gradients or plan.scheme not in (
        Scheme.ZERO3, Scheme.HPZ, Scheme.OURS,
    ):  # fmt: skip
        raise ValueError(f"{plan.scheme} with quantization: only exact ZeRO-3, hpZ and ours are described")
    s, ga = shape(system, nodes, plan.tp), plan.grad_accum
    inner = replace(s, nodes=1)
    secondary = DPShape(1, 1, s.per_package) if plan.secondary == LinkClass.PACKAGE else inner
    inter = Algorithm.RECURSIVE if plan.inter_node == "recursive" else Algorithm.RING
    ag, rs = Operation.ALL_GATHER, Operation.REDUCE_SCATTER
    out: list[Message] = []
    for elems in gather_calls(model.modules(plan.tp), plan.buckets):
        b = 2.0 * elems
        if plan.scheme == Scheme.ZERO3:
            out += _flat(ag, s, b, 2 * ga)
        elif plan.scheme == Scheme.HPZ and plan.tp > 1:  # DeepSpeed's group: the node's consecutive ranks
            out += _flat(ag, s, b, 1) + [
                Message(ag, Algorithm.RING, LinkClass.NODE, system.ranks_per_node, b, 2 * ga - 1)
            ]
        elif plan.scheme == Scheme.HPZ:
            out += _flat(ag, s, b, 1) + _flat(ag, inner, b, 2 * ga - 1)
        else:
            out += _hops(ag, s, b, 1, inter) + _hops(ag, secondary, b, 2 * ga - 1, inter)
    for elems in reduce_calls(model.params // plan.tp, plan.buckets):
        b = 2.0 * elems
        out += _hops(rs, s, b, ga, inter) if plan.scheme == Scheme.OURS else _flat(rs, s, b, ga)
    return out


def best_plans(system: System, model: Model, nodes: int, ds: dict) -> dict[str, tuple[Candidate, Projection]]:
    """The planner's best exact plan ("ours") and ZeRO-3's and hpZ's best that fit."""
    rows = evaluate(system, model, nodes, ds, int(ds.get("gradient_accumulation_steps", 1)), PLANNER_RULES)
    if not rows:
        raise ValueError(f"no exact plan fits {system.memory_gb:g} GB on {nodes} nodes")
    out = {"ours": (rows[0].plan, rows[0].projection)}
    base = Candidate(Scheme.ZERO3, buckets=Buckets.from_json(ds))
    for scheme in (Scheme.ZERO3, Scheme.HPZ):
        fits = [fitting(system, model, nodes, replace(base, scheme=scheme, tp=tp), PLANNER_RULES)
                for tp in (1, 2, 4, 8)]  # fmt: skip
        found = [f for f in fits if f is not None]
        if not found:
            raise ValueError(f"no {scheme} plan fits {system.memory_gb:g} GB on {nodes} nodes")
        plan, projection, _ = max(found, key=lambda f: f[1].tflops_per_gcd)
        out["hpZ" if scheme == Scheme.HPZ else "zero3"] = (plan, projection)
    return out


def frontier(nodes: int = FRONTIER_NODES) -> dict[str, dict]:
    """Frontier's numbers for ZeRO-3, hpZ and ours at their best plans (computed)."""
    system, model = calibration.FRONTIER, calibration.GPT_20B
    ds = json.loads(PRESET.read_text())
    out = {}
    for name, (plan, projection) in best_plans(system, model, nodes, ds).items():
        messages = frontier_messages(system, model, nodes, plan)
        out[name] = {
            "plan": f"{plan.scheme} TP={plan.tp} micro-batch {plan.micro_batch} {plan.recompute} "
            f"buckets {plan.buckets.prefetch:.0e}",
            "links": {k: vars(v) for k, v in link_regimes(messages, system.costs).items()},
            "comm_over_compute": projection.comm_s / projection.compute_s,
            "tflops_per_gcd": projection.tflops_per_gcd,
        }
    return out


def markdown(frontier_numbers: Mapping[str, dict], runs: Iterable[dict]) -> str:
    """Frontier's numbers and each A/B run's, one row per variant and link class."""
    lines = [
        "| where | variant | plan / regime | link | messages /step | median message | message / (latency x bandwidth) "
        "| per algorithm step | communication / compute |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]

    def rows(where: str, variant: str, what: str, numbers: dict) -> None:
        ratio = f"{numbers['comm_over_compute']:.2f}"
        if "measured_comm_over_compute" in numbers:
            ratio += f" (measured {numbers['measured_comm_over_compute']:.2f})"
        for link, n in numbers["links"].items():
            lines.append(
                f"| {where} | {variant} | {what} | {link} | {n['messages']:g} | {n['median_bytes'] / 2**20:.2f} MiB "
                f"| {n['message_over_product']:.0f} | {n['step_over_product']:.1f} | {ratio} |"
            )

    for variant, numbers in frontier_numbers.items():
        rows(f"Frontier, {FRONTIER_NODES * 8} GCDs (computed)", variant, numbers["plan"], numbers)
    for result in runs:
        for variant, numbers in result["dimensionless"].items():
            rows(f"emulated, `{result['command']}`", variant, result["regime"], numbers)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    import argparse

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "ab", nargs="*", type=Path, help="A/B results (python -m benchmarks.zero.ab --out DIR)"
    )
    parser.add_argument("--out", type=Path, help="write the table here (markdown)")
    args = parser.parse_args(argv)
    runs: list[dict] = []
    for path in args.ab:
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            parser.exit(2, f"error: {path}: {exc}: give an A/B result JSON (python -m benchmarks.zero.ab)\n")
        if "dimensionless" not in runs[-1] or "error" in runs[-1]["dimensionless"]:
            said = runs[-1].get("dimensionless", {}).get("error", "none written")
            parser.exit(
                2, f"error: {path} has no regime numbers ({said}): rerun python -m benchmarks.zero.ab\n"
            )
    table = markdown(frontier(), runs)
    print(table)
    if args.out:
        args.out.write_text(table)
    return table


if __name__ == "__main__":
    main()
    exit_without_teardown()
