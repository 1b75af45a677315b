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
    node = shape.per_package * shape.packages_per_node
    return [k for k in range(node, 0, -1) if node % k == 0]


def hpz_name(k: int) -> str:
    return f"zero++ hpZ({k})"


def zeropp_name(k: int) -> str:
    return f"zero++ hpZ({k})+qwZ+qgZ"


def variants(shape: DPShape) -> dict[str, Candidate]:
    """ZeRO-3; ZeRO++ hpZ alone and with qwZ+qgZ (the paper's byte factors) at every partition size
    inside a node; ours at the node level and at the package level where a package holds more than
    one DP member, as the engine would run them (planner.variant_for: boundary sync, int8 weights
    and int4 gradients with one fp32 scale per 256 elements)."""
    out = {"zero3": Candidate(cm.ZERO3)}
    for k in hpz_sizes(shape):
        link = LinkClass.PACKAGE if k <= shape.per_package else LinkClass.NODE
        out[hpz_name(k)] = Candidate(cm.hpz(k, link))
    for k in hpz_sizes(shape):
        link = LinkClass.PACKAGE if k <= shape.per_package else LinkClass.NODE
        out[zeropp_name(k)] = Candidate(cm.zeropp_paper(k, link))
    levels = ["node"] if shape.nodes > 1 else []
    levels += ["package"] if 1 < shape.per_package < shape.size else []
    for level in levels or ["global"]:
        for suffix, keys in OURS.items():
            # global has no secondary_level value: auto, of which the figures for global are read
            config = HierarchicalZeroConfig(
                enabled=True, secondary_level=level if level != "global" else "auto", **keys
            )
            out[f"ours ({level}){suffix}"] = Candidate(config=config, level=Level(level))
    return out


def secondary_bytes(model: cm.ModelSpec, shape: DPShape, variant: cm.Variant) -> int:
    """Computed bytes per rank of the secondary 16-bit weight copy (0 without one)."""
    full = model.padded(shape.size) * model.weight_bytes
    size = {
        "global": 0,
        "hpz": variant.hpz_size,
        "node": shape.packages_per_node * shape.per_package,
        "package": shape.per_package,
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
    node = shape.per_package * shape.packages_per_node
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


def _budget(seconds: float) -> str:
    if seconds < 0:
        return "is out of reach even with no communication"
    return f"needs at most {seconds:.2f} s of communication per step"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f}"


def markdown(results: dict, args: argparse.Namespace) -> str:
    top = str(max(args.nodes))
    first_overlap = next(iter(results["overlap"].values()))
    last = first_overlap[top]
    lines = [
        f"Frontier projection (computed, ring-aware cost model, {args.channels} channels), 20B GPT, TP={args.tp}, "
        f"micro-batch {args.micro_batch}, grad-accum {args.grad_accum}, compute at {args.mfu:.0%} of "
        f"{GCD_PEAK_TFLOPS:.1f} TFLOPS/GCD, {last['compute_s']:.2f} s of compute per step",
        "",
        f"### Extra memory per rank over ZeRO-3 at {last['gcds']} GCDs (computed, GB)",
        "",
        "Ours: the planner's figures (planner.choose_secondary_level, DeepSpeed's default buckets). "
        "hpZ(1): a full 16-bit copy per rank, the most any hpZ partition size can hold (DeepSpeed's "
        "zero_hpz_partition_size=1 turns hpZ off; it stands for the limit, not a setting). qwZ/qgZ "
        "transient buffers are not counted.",
        "",
        "| variant | secondary 16-bit copy | held fp32 gradient block + error-feedback residual | "
        "hop buffers, gather + reduce | total |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in last["rows"].items():
        m = row["memory"]
        lines.append(
            f"| {name} | {_gb(m['secondary'])} | {_gb(m['held'])} | {_gb(m['hop_gather'])} + "
            f"{_gb(m['hop_reduce'])} | {_gb(m['total'])} |"
        )
    lines.append("")
    for overlap, by_nodes in results["overlap"].items():
        last = by_nodes[top]
        node = last["node_size"]
        s = results["summary"][overlap]
        lines += [
            f"### Communication hidden behind compute: {float(overlap):.0%}",
            "",
            "TFLOPS per GCD (computed):",
            "",
            "| GCDs | DP | " + " | ".join(f"{k}" for k in last["rows"]) + " |",
            "|---:|---:|" + "---:|" * len(last["rows"]),
        ]
        for n in args.nodes:
            r = by_nodes[str(n)]
            lines.append(
                f"| {r['gcds']} | {r['dp']} | "
                + " | ".join(f"{v['tflops_per_gcd']:.1f}" for v in r["rows"].values())
                + " |"
            )
        lines += [
            "",
            f"Ours at {last['gcds']} GCDs against hpZ holding at least as much memory, ZeRO++ hpZ+qwZ+qgZ "
            f"at the same partition size, and both at the node size ({hpz_name(node)}, the paper's "
            "setting); computed:",
            "",
            "| variant | extra GB per rank | TFLOPS per GCD | hpZ at >= memory (GB) | vs it | "
            "vs ZeRO++ at >= memory | "
            f"vs {hpz_name(node)} | vs {zeropp_name(node)} |",
            "|---|---:|---:|---|---:|---:|---:|---:|",
        ]
        for name, c in s["compare"].items():
            base = f"{c['equal_memory_hpz']} ({c['equal_memory_hpz_gb']:.2f})"
            if c["baseline_holds_less"]:
                base += ", holds less: no hpZ holds as much"
            lines.append(
                f"| {name} | {c['memory_gb']:.2f} | {last['rows'][name]['tflops_per_gcd']:.1f} | {base} | "
                f"{c['vs_equal_hpz']:.2f}x | {c['vs_equal_zeropp']:.2f}x | {c['vs_node_hpz']:.2f}x | "
                f"{c['vs_node_zeropp']:.2f}x |"
            )
        eff = f"{s['efficiency']:.2f}" if s["efficiency"] is not None else "-"
        hpz_b, zpp_b = s["bounds"][hpz_name(node)], s["bounds"][zeropp_name(node)]
        best = s["best_equal_memory"]
        lines += [""]
        if best is not None:
            c = s["compare"][best]
            lines.append(
                f"- best of ours at equal or greater hpZ memory (computed), {best}: **{c['vs_equal_hpz']:.2f}x** "
                f"{c['equal_memory_hpz']}, **{c['vs_equal_zeropp']:.2f}x** ZeRO++ at that size"
            )
        lines += [
            f"- fastest of ours (computed), {s['fastest']}: {s['fastest_vs_node_hpz']:.2f}x {hpz_name(node)}, "
            f"{s['fastest_vs_node_zeropp']:.2f}x {zeropp_name(node)} (paper: {PAPER_RATIO}x); scaling "
            f"efficiency {s['from_gcds']} -> {s['to_gcds']} GCDs {eff} (paper: {PAPER_EFFICIENCY})",
            f"- bound (computed): compute {s['compute_s']:.2f} s per step; {hpz_name(node)} communicates "
            f"{hpz_b['comm_s']:.2f} s (step {hpz_b['step_s']:.2f} s), {zeropp_name(node)} {zpp_b['comm_s']:.2f} s "
            f"(step {zpp_b['step_s']:.2f} s): with no communication at all a variant reaches at most "
            f"{hpz_b['cap']:.2f}x hpZ and {zpp_b['cap']:.2f}x ZeRO++; {TARGET_VS_HPZ}x hpZ "
            f"{_budget(s['comm_budget_for_target_vs_hpz'])}, {TARGET_VS_ZEROPP}x ZeRO++ "
            f"{_budget(s['comm_budget_for_target_vs_zeropp'])}",
            "",
        ]
    return "\n".join(lines)


def combine(out: Path, names: list[str]) -> str:
    """The tables of docs/hierarchical_zero.md from projections already written (computed figures
    at the largest size; TFLOPS per GCD without overlap / with half the communication hidden)."""
    runs = [json.loads((out / f"{n}.json").read_text()) for n in names]
    lines: list[str] = []
    for tp in dict.fromkeys(r["args"]["tp"] for r in runs):
        mine = [r for r in runs if r["args"]["tp"] == tp]
        last = [r["overlap"][o][r["top_nodes"]] for r in mine for o in ("0.0", "0.5")]
        rows = last[0]["rows"]
        bases = [k for k in rows if k.startswith("zero")]
        lines += [
            f"TP={tp}, ZeRO-3 and ZeRO++ at {last[0]['gcds']} GCDs (computed; header: extra GB per rank):",
            "",
            "| accumulation | compute s | "
            + " | ".join(
                f"{k.removeprefix('zero++ ')}, {rows[k]['memory']['total'] / 1e9:.2f}" for k in bases
            )
            + " |",
            "|---:|---:|" + "---:|" * len(bases),
        ]
        for i, r in enumerate(mine):
            none, half = last[2 * i]["rows"], last[2 * i + 1]["rows"]
            lines.append(
                f"| {r['args']['grad_accum']} | {last[2 * i]['compute_s']:.2f} | "
                + " | ".join(
                    f"{none[k]['tflops_per_gcd']:.1f} / {half[k]['tflops_per_gcd']:.1f}" for k in bases
                )
                + " |"
            )
        lines.append("")
    node_cols = "hpZ(node) | vs ZeRO++ hpZ(node)+qwZ+qgZ"
    lines += [
        "Ours (computed; ratios without overlap; hpZ(node) is hpZ(2) at TP=4 and hpZ(8) at TP=1):",
        "",
        "| TP | accumulation | variant | extra GB per rank | TFLOPS per GCD | hpZ at >= memory (GB) | vs it | "
        f"vs ZeRO++ at >= memory | vs {node_cols} |",
        "|---:|---:|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in runs:
        top = r["top_nodes"]
        none, half = r["overlap"]["0.0"][top]["rows"], r["overlap"]["0.5"][top]["rows"]
        for name, c in r["summary"]["0.0"]["compare"].items():
            base = f"{c['equal_memory_hpz'].removeprefix('zero++ ')} ({c['equal_memory_hpz_gb']:.2f})"
            base += ", holds less: no hpZ holds as much" if c["baseline_holds_less"] else ""
            lines.append(
                f"| {r['args']['tp']} | {r['args']['grad_accum']} | {name.removeprefix('ours ')} | "
                f"{c['memory_gb']:.2f} | {none[name]['tflops_per_gcd']:.1f} / {half[name]['tflops_per_gcd']:.1f} | "
                f"{base} | {c['vs_equal_hpz']:.2f}x | {c['vs_equal_zeropp']:.2f}x | {c['vs_node_hpz']:.2f}x | "
                f"{c['vs_node_zeropp']:.2f}x |"
            )
    lines += [
        "",
        "Bounds without overlap (computed): compute per step, what zero communication would give, the "
        "communication ours may spend to reach the targets, and the least ours spends:",
        "",
        f"| TP | accumulation | compute s | hpZ(node): comm s, cap | ZeRO++ hpZ(node)+qwZ+qgZ: comm s, cap | "
        f"{TARGET_VS_HPZ}x hpZ(node) needs ours at | {TARGET_VS_ZEROPP}x ZeRO++ needs ours at | ours' least comm s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def budget(seconds: float) -> str:
        return "out of reach" if seconds < 0 else f"<= {seconds:.2f} s"

    for r in runs:
        s = r["summary"]["0.0"]
        node, zpp = s["node_hpz"], zeropp_name(s["node_hpz_size"])
        rows = r["overlap"]["0.0"][r["top_nodes"]]["rows"]
        least = min(v["comm_s"] for k, v in rows.items() if k.startswith("ours"))
        lines.append(
            f"| {r['args']['tp']} | {r['args']['grad_accum']} | {s['compute_s']:.2f} | "
            f"{s['bounds'][node]['comm_s']:.2f} s, {s['bounds'][node]['cap']:.2f}x | "
            f"{s['bounds'][zpp]['comm_s']:.2f} s, {s['bounds'][zpp]['cap']:.2f}x | "
            f"{budget(s['comm_budget_for_target_vs_hpz'])} | {budget(s['comm_budget_for_target_vs_zeropp'])} | "
            f"{least:.2f} |"
        )
    return "\n".join(lines)


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
