"""Cost-model projection to Frontier: a 20B GPT on 1..48 nodes (8..384 GCDs), ZeRO-3, ZeRO++ and ours.

  python -m benchmarks.zero.project --tp 4 --grad-accum 1 --name projection_tp4_ga1   # the 20B preset
  python -m benchmarks.zero.project --tp 1 --grad-accum 4 --name projection_tp1_ga4
  options: [--micro-batch 1] [--grad-accum 1] [--mfu 0.40] [--channels 4] [--nodes 1 2 6 12 24 48]

Every figure here is computed (ring-aware cost model, deepspeed_ext/zero/cost_model.py), none is
measured. Prints TFLOPS per GCD of each variant and the extra memory per rank each one holds over
ZeRO-3, counted whole: the secondary 16-bit copy, and for ours the fp32 gradient block held for
the cross-node hop (boundary sync), the error-feedback residual (quantized gradients) and the hop
buffers, all from the planner (deepspeed_ext/zero/planner.py, DeepSpeed's default buckets). Each of
our variants is compared with the hpZ partition size holding at least as much (hpZ(k) for every k
dividing the DP members of a node, hpZ(1) being a full 16-bit copy), with ZeRO++ hpZ+qwZ+qgZ at
the same size (the paper's byte factors), and with both at the node size (the paper's setting);
plus our scaling efficiency from 8 to 384 GCDs next to the paper's 0.94 and the bound compute puts
on any ratio. Communication hidden behind compute not at all, half, or fully. TP traffic is left
out (the same for every variant). Writes benchmarks/results/zero/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from deepspeed_ext.topology import Level, LinkClass
from deepspeed_ext.zero import cost_model as cm
from deepspeed_ext.zero import planner
from deepspeed_ext.zero.api import largest_collectives
from deepspeed_ext.zero.config import HierarchicalZeroConfig
from deepspeed_ext.zero.levels import DPShape

OUT = Path(__file__).resolve().parents[1] / "results" / "zero"
PAPER_RATIO, PAPER_EFFICIENCY = 1.71, 0.94
TARGET_VS_HPZ, TARGET_VS_ZEROPP = 1.5, 1.2
GCD_PEAK_TFLOPS = 191.5 / 2  # MI250X bf16 dense peak, per GCD
GCDS_PER_NODE, GCDS_PER_PACKAGE = 8, 2
DEEPSPEED_DEFAULTS: dict = {"zero_optimization": {"stage": 3}}
"""The DeepSpeed config the hop buffers are computed for: its default prefetch and reduce buckets."""
OURS = {
    "": {},
    " + boundary sync": {"grad_sync": "accumulation_boundary"},
    " + int8/int4 hops": {
        "grad_sync": "accumulation_boundary",
        "quantized_weights": True,
        "quantized_gradients": "int4",
    },
}
"""Our variants at each level: the hierarchical_zero keys on top of secondary_level."""


@dataclass(frozen=True)
class GPT:
    """The 20B GPT (GPT-NeoX-20B shape, scripts/presets/gpt-20b-frontier.args)."""

    layers: int = 44
    """Transformer layers."""
    hidden: int = 6144
    """Hidden size."""
    seq: int = 2048
    """Sequence length."""
    vocab: int = 50432
    """Vocabulary (input and output embeddings untied)."""

    @property
    def params(self) -> int:
        return (
            12 * self.layers * self.hidden**2 + 13 * self.layers * self.hidden + 2 * self.vocab * self.hidden
        )

    def tensors(self, tp: int) -> tuple[int, ...]:
        """Elements of each parameter one TP rank holds (megatron's split: QKV and fc1 with their
        biases, the attention projection, fc2 and both embeddings split; layer norms and the
        projection and fc2 biases whole)."""
        h = self.hidden
        layer = (
            3 * h * h // tp,
            3 * h // tp,
            h * h // tp,
            h,
            4 * h * h // tp,
            4 * h // tp,
            4 * h * h // tp,
            h,
        )
        layer += (h, h, h, h)  # two layer norms, weight and bias
        return layer * self.layers + (self.vocab * h // tp,) * 2

    def flops_per_sequence(self) -> float:
        """Forward + backward, no recomputation (Narayanan et al., 2021)."""
        h, s, lyr, v = self.hidden, self.seq, self.layers, self.vocab
        return 72 * s * lyr * h**2 * (1 + s / (6 * h) + v / (12 * lyr * h))


@dataclass(frozen=True)
class Candidate:
    """One column: ZeRO-3 or ZeRO++ as a cost-model variant, or ours as the engine's config."""

    variant: cm.Variant | None = None
    """ZeRO-3 or ZeRO++ (DeepSpeed's flat collectives); None for ours."""
    config: HierarchicalZeroConfig | None = None
    """Ours: the hierarchical_zero config."""
    level: Level = Level.GLOBAL
    """Ours: the secondary level (global: none)."""


def dp_shape(nodes: int, tp: int) -> DPShape:
    """A DP group under megatron's rank order (TP ranks contiguous): its members on each node."""
    if GCDS_PER_NODE % tp:
        raise ValueError(f"--tp {tp} must divide the {GCDS_PER_NODE} GCDs of a node")
    per_node = GCDS_PER_NODE // tp
    per_package = max(1, GCDS_PER_PACKAGE // tp)
    return DPShape(nodes=nodes, packages_per_node=per_node // per_package, per_package=per_package)


def hpz_sizes(shape: DPShape) -> list[int]:
    """hpZ partition sizes inside a node, largest (the paper's, the whole node) first; 1 is a full
    16-bit copy per rank, the most memory hpZ can trade for communication."""
    return [k for k in range(shape.per_node, 0, -1) if shape.per_node % k == 0]


def hpz_name(k: int) -> str:
    return f"zero++ hpZ({k})"


def zeropp_name(k: int) -> str:
    return f"zero++ hpZ({k})+qwZ+qgZ"


def variants(shape: DPShape) -> dict[str, Candidate]:
    """ZeRO-3; ZeRO++ hpZ alone and with qwZ+qgZ (the paper's byte factors) at every partition size
    inside a node; ours at the node level and at the package level where a package holds more than
    one DP member, as the engine would run them (planner.variant_for: boundary sync, int8 weights
    and int4 gradients with one fp32 scale per 256 elements)."""
    sizes = hpz_sizes(shape)
    links = {k: LinkClass.PACKAGE if k <= shape.per_package else LinkClass.NODE for k in sizes}
    out = {"zero3": Candidate(cm.ZERO3)}
    out.update({hpz_name(k): Candidate(cm.hpz(k, links[k])) for k in sizes})
    out.update({zeropp_name(k): Candidate(cm.zeropp_paper(k, links[k])) for k in sizes})
    levels = [Level.NODE] if shape.nodes > 1 else []
    levels += [Level.PACKAGE] if 1 < shape.per_package < shape.size else []
    for level in levels or [Level.GLOBAL]:
        for suffix, keys in OURS.items():
            # global has no secondary_level value: auto, of which the figures for global are read
            secondary = level.value if level != Level.GLOBAL else "auto"
            config = HierarchicalZeroConfig(enabled=True, secondary_level=secondary, **keys)
            out[f"ours ({level}){suffix}"] = Candidate(config=config, level=level)
    return out


def secondary_bytes(model: cm.ModelSpec, shape: DPShape, variant: cm.Variant) -> int:
    """Computed bytes per rank of the secondary 16-bit weight copy (0 without one)."""
    full = model.padded(shape.size) * model.weight_bytes
    size = {
        Level.GLOBAL: 0,
        "hpz": variant.hpz_size,
        Level.NODE: shape.per_node,
        Level.PACKAGE: shape.per_package,
    }[variant.secondary]
    return full // size if size else 0


def resolve(
    cand: Candidate, model: cm.ModelSpec, shape: DPShape, links: cm.Links, micro: int
) -> tuple[cm.Variant, dict[str, int]]:
    """The variant to cost and its extra bytes per rank over ZeRO-3, counted whole (computed). Ours:
    the planner's own figures, as the engine logs them at start-up (choose_secondary_level's extra
    bytes: secondary copy + held gradient block and residual + hop buffers; a level that spans the
    whole group falls back to no copy, as the planner does). ZeRO++: its secondary copy (the
    transient buffers of qwZ/qgZ are not counted)."""
    if cand.config is None:
        secondary = secondary_bytes(model, shape, cand.variant)
        zero = {"secondary": secondary, "held": 0, "hop_gather": 0, "hop_reduce": 0, "total": secondary}
        return cand.variant, zero
    config = cand.config
    gather, reduce = largest_collectives(DEEPSPEED_DEFAULTS, model)
    buffers = planner.hop_buffers(config, shape, model, gather, reduce)
    choice = planner.choose_secondary_level(config, shape, model, links, micro, buffers)
    total = choice.extra_bytes.get(cand.level, choice.extra_bytes[Level.GLOBAL])
    held = planner.held_bytes(config, shape, model)
    memory = {
        "secondary": total - held - buffers.total,
        "held": held,
        "hop_gather": buffers.gather,
        "hop_reduce": buffers.reduce,
        "total": total,
    }
    return planner.variant_for(config, cand.level, model), memory


def model_spec(gpt: GPT, tp: int) -> cm.ModelSpec:
    numels = gpt.tensors(tp)
    return cm.ModelSpec(
        param_numels=numels,
        weight_bytes=2,
        grad_bytes=2,
        gathers_per_pass=gpt.layers + 2,
        reduce_launches=max(1, sum(numels) // 500_000_000),
    )


def equal_memory(rows: dict, name: str, ks: list[int]) -> tuple[int, bool]:
    """hpZ partition size (of ``ks``) of our row ``name``'s baseline: the largest, i.e. the smallest
    copy, holding at least as much as ours; where even a full copy (hpZ(1)) holds less, 1 and True."""
    mine = rows[name]["memory"]["total"]
    enough = [k for k in ks if rows[hpz_name(k)]["memory"]["total"] >= mine]
    return (max(enough), False) if enough else (min(ks), True)


def project(gpt: GPT, nodes: int, args: argparse.Namespace, overlap: float) -> dict:
    shape = dp_shape(nodes, args.tp)
    model = model_spec(gpt, args.tp)
    links = cm.Links(channels=args.channels)
    flops = gpt.flops_per_sequence() * args.micro_batch * args.grad_accum / args.tp
    compute = flops / (GCD_PEAK_TFLOPS * 1e12 * args.mfu)
    rows = {}
    # One set of variants for every size (the largest's), so that the columns line up.
    largest = dp_shape(max(args.nodes), args.tp)
    for name, cand in variants(largest).items():
        variant, memory = resolve(cand, model, shape, links, args.grad_accum)
        hops = cm.step_hops(model, shape, variant, args.grad_accum)
        comm = cm.comm_time(hops, links)
        step = cm.step_time(compute, comm, overlap)
        rows[name] = {
            "comm_s": comm,
            "step_s": step,
            "tflops_per_gcd": flops / step / 1e12,
            "memory": memory,
            "counter_bytes": cm.bytes_per_link(hops),
            "ring_wire_bytes": cm.ring_wire_bytes(hops),
        }
    for name in [k for k in rows if k.startswith("ours")]:
        k, holds_less = equal_memory(rows, name, hpz_sizes(largest))
        rows[name]["equal_memory_hpz"] = k
        rows[name]["baseline_holds_less"] = holds_less
    node = shape.per_node
    return {
        "gcds": nodes * GCDS_PER_NODE,
        "dp": shape.size,
        "node_size": node,
        "compute_s": compute,
        "rows": rows,
    }


def summary(first: dict, last: dict) -> dict:
    """Ratios at the largest size (computed)."""
    rows = last["rows"]
    tf = {k: v["tflops_per_gcd"] for k, v in rows.items()}
    node = last["node_size"]
    compare = {}
    for name in (k for k in rows if k.startswith("ours")):
        k = rows[name]["equal_memory_hpz"]
        compare[name] = {
            "memory_gb": rows[name]["memory"]["total"] / 1e9,
            "equal_memory_hpz": hpz_name(k),
            "equal_memory_hpz_gb": rows[hpz_name(k)]["memory"]["total"] / 1e9,
            "baseline_holds_less": rows[name]["baseline_holds_less"],
            "vs_equal_hpz": tf[name] / tf[hpz_name(k)],
            "vs_equal_zeropp": tf[name] / tf[zeropp_name(k)],
            "vs_node_hpz": tf[name] / tf[hpz_name(node)],
            "vs_node_zeropp": tf[name] / tf[zeropp_name(node)],
        }
    fair = [k for k, c in compare.items() if not c["baseline_holds_less"]]
    best_equal = max(fair, key=lambda k: compare[k]["vs_equal_hpz"]) if fair else None
    fastest = max(compare, key=lambda k: tf[k])
    compute = last["compute_s"]
    # Zero communication leaves the compute: no variant beats a baseline by more than its step / compute.
    bounds = {
        b: {"step_s": rows[b]["step_s"], "comm_s": rows[b]["comm_s"], "cap": rows[b]["step_s"] / compute}
        for b in rows
        if b.startswith("zero")
    }
    return {
        "node_hpz": hpz_name(node),
        "node_hpz_size": node,
        "compare": compare,
        "best_equal_memory": best_equal,
        "fastest": fastest,
        "fastest_vs_node_hpz": compare[fastest]["vs_node_hpz"],
        "fastest_vs_node_zeropp": compare[fastest]["vs_node_zeropp"],
        "compute_s": compute,
        "bounds": bounds,
        # Communication ours may spend per step to reach the targets (negative: out of reach even at 0).
        "comm_budget_for_target_vs_hpz": bounds[hpz_name(node)]["step_s"] / TARGET_VS_HPZ - compute,
        "comm_budget_for_target_vs_zeropp": bounds[zeropp_name(node)]["step_s"] / TARGET_VS_ZEROPP - compute,
        "efficiency": tf[fastest] / first["rows"][fastest]["tflops_per_gcd"]
        if fastest in first["rows"]
        else None,
        "from_gcds": first["gcds"],
        "to_gcds": last["gcds"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp", type=int, default=4, help="tensor-parallel size (the 20B preset: 4)")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--mfu", type=float, default=0.40, help="compute efficiency of the GEMMs alone")
    parser.add_argument("--channels", type=int, default=4, help="rings per collective (RCCL uses every NIC)")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 6, 12, 24, 48])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--name", default="projection", help="file name stem of the JSON and markdown")
    parser.add_argument(
        "--combine", nargs="+", metavar="NAME", help="print the docs' tables from projections already written"
    )
    args = parser.parse_args(argv)
    from benchmarks.zero.project_tables import combine, markdown  # they read this module's constants

    if args.combine:
        print(combine(args.out, args.combine))
        return {}
    gpt = GPT()
    results: dict = {
        "gpt": asdict(gpt) | {"params": gpt.params},
        "args": {k: str(v) for k, v in vars(args).items() if k != "out"},
        "links": asdict(cm.Links(channels=args.channels)),
        "top_nodes": str(max(args.nodes)),
        "overlap": {},
        "summary": {},
    }
    for overlap in (0.0, 0.5, 1.0):
        by_nodes = {str(n): project(gpt, n, args, overlap) for n in args.nodes}
        results["overlap"][str(overlap)] = by_nodes
        results["summary"][str(overlap)] = summary(
            by_nodes[str(min(args.nodes))], by_nodes[str(max(args.nodes))]
        )
    table = markdown(results, args)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    (args.out / f"{args.name}.md").write_text(table + "\n")
    return results


if __name__ == "__main__":
    main()
