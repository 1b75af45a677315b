"""Cost-model projection to Frontier: a 20B GPT on 1..48 nodes (8..384 GCDs), ZeRO-3, ZeRO++ and ours.

  python -m benchmarks.zero.project [--micro-batch 1] [--grad-accum 1] [--mfu 0.40] [--budget-gb 24]

Prints TFLOPS per GCD of each variant, our ratio to ZeRO++ (hpZ only, as measured here, and with
qwZ+qgZ on paper) next to the paper's 1.71x, and our scaling efficiency from 8 to 384 GCDs next to
its 0.94, for communication hidden behind compute not at all, half, or fully. Writes
benchmarks/results/zero/<name>.{json,md} (default name: projection).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from deepspeed_ext.config import HierarchicalZeroConfig
from deepspeed_ext.zero import cost_model as cm
from deepspeed_ext.zero.planner import choose_secondary_level

OUT = Path(__file__).resolve().parents[1] / "results" / "zero"
PAPER_RATIO, PAPER_EFFICIENCY = 1.71, 0.94
GCD_PEAK_TFLOPS = 191.5 / 2  # MI250X bf16 dense peak, per GCD


@dataclass(frozen=True)
class GPT:
    """The 20B GPT (GPT-NeoX-20B shape)."""

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
        return 12 * self.layers * self.hidden**2 + 13 * self.layers * self.hidden + 2 * self.vocab * self.hidden

    def flops_per_sequence(self) -> float:
        """Forward + backward, no recomputation (Narayanan et al., 2021)."""
        h, s, lyr, v = self.hidden, self.seq, self.layers, self.vocab
        return 72 * s * lyr * h**2 * (1 + s / (6 * h) + v / (12 * lyr * h))


def variants(shape: cm.DPShape, level: str) -> dict[str, cm.Variant]:
    node = shape.per_package * shape.packages_per_node
    return {
        "zero3": cm.ZERO3,
        "zero++ hpZ": cm.hpz(node, "node" if shape.packages_per_node > 1 else "package"),
        "zero++ hpZ+qwZ+qgZ (paper)": cm.zeropp_paper(node, "node" if shape.packages_per_node > 1 else "package"),
        f"ours ({level})": cm.hierarchical(level),
    }


def project(gpt: GPT, nodes: int, micro: int, accum: int, mfu: float, budget_gb: float, overlap: float) -> dict:
    shape = cm.DPShape(nodes=nodes, packages_per_node=4, per_package=2)
    model = cm.ModelSpec(param_numels=(gpt.params,), weight_bytes=2, grad_bytes=2,
                         gathers_per_pass=gpt.layers + 2, reduce_launches=max(1, gpt.params // 500_000_000))
    links = cm.Links()
    choice = choose_secondary_level(HierarchicalZeroConfig(enabled=True, secondary_memory_budget_gb=budget_gb),
                                    shape, model, links, accum)
    flops = gpt.flops_per_sequence() * micro * accum
    compute = flops / (GCD_PEAK_TFLOPS * 1e12 * mfu)
    rows = {}
    for name, variant in variants(shape, choice.level).items():
        hops = cm.step_hops(model, shape, variant, accum)
        comm = cm.comm_time(hops, links)
        step = cm.step_time(compute, comm, overlap)
        rows[name] = {"comm_s": comm, "step_s": step, "tflops_per_gcd": flops / step / 1e12,
                      "bytes": cm.bytes_per_link(hops)}
    return {"gcds": shape.size, "level": choice.level, "compute_s": compute, "rows": rows}


def markdown(results: dict, args: argparse.Namespace) -> str:
    lines = [f"Frontier projection (cost model), 20B GPT, micro-batch {args.micro_batch}, grad-accum {args.grad_accum}, "
             f"compute at {args.mfu:.0%} of {GCD_PEAK_TFLOPS:.1f} TFLOPS/GCD, secondary budget {args.budget_gb} GB", ""]
    for overlap, by_nodes in results["overlap"].items():
        last = by_nodes[str(max(args.nodes))]
        ours = next(k for k in last["rows"] if k.startswith("ours"))
        lines += [f"### Communication hidden behind compute: {float(overlap):.0%}", "",
                  "| GCDs | level | " + " | ".join(f"{k} TFLOPS/GCD" for k in last["rows"]) + " |",
                  "|---:|---|" + "---:|" * len(last["rows"])]
        for n in args.nodes:
            r = by_nodes[str(n)]
            lines.append(f"| {r['gcds']} | {r['level']} | " + " | ".join(f"{v['tflops_per_gcd']:.1f}" for v in r["rows"].values()) + " |")
        s = results["summary"][overlap]
        lines += ["", f"- {ours} vs ZeRO++ hpZ at {last['gcds']} GCDs: **{s['vs_hpz']:.2f}x**; vs ZeRO++ hpZ+qwZ+qgZ "
                  f"(paper factors): **{s['vs_zeropp']:.2f}x** (paper: {PAPER_RATIO}x)",
                  f"- our scaling efficiency {s['from_gcds']} -> {s['to_gcds']} GCDs: **{s['efficiency']:.2f}** "
                  f"(paper: {PAPER_EFFICIENCY})", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--mfu", type=float, default=0.40, help="compute efficiency of the GEMMs alone")
    parser.add_argument("--budget-gb", type=float, default=24.0, help="secondary_memory_budget_gb")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 6, 12, 24, 48])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--name", default="projection", help="file name stem of the JSON and markdown")
    args = parser.parse_args()
    gpt = GPT()
    results: dict = {"gpt": asdict(gpt) | {"params": gpt.params}, "args": {k: str(v) for k, v in vars(args).items()},
                     "links": asdict(cm.Links()), "overlap": {}, "summary": {}}
    for overlap in (0.0, 0.5, 1.0):
        by_nodes = {str(n): project(gpt, n, args.micro_batch, args.grad_accum, args.mfu, args.budget_gb, overlap)
                    for n in args.nodes}
        first, last = by_nodes[str(min(args.nodes))], by_nodes[str(max(args.nodes))]
        ours = next(k for k in last["rows"] if k.startswith("ours"))
        ours_first = next(k for k in first["rows"] if k.startswith("ours"))
        results["overlap"][str(overlap)] = by_nodes
        results["summary"][str(overlap)] = {
            "vs_hpz": last["rows"][ours]["tflops_per_gcd"] / last["rows"]["zero++ hpZ"]["tflops_per_gcd"],
            "vs_zeropp": last["rows"][ours]["tflops_per_gcd"] / last["rows"]["zero++ hpZ+qwZ+qgZ (paper)"]["tflops_per_gcd"],
            "efficiency": last["rows"][ours]["tflops_per_gcd"] / first["rows"][ours_first]["tflops_per_gcd"],
            "from_gcds": first["gcds"], "to_gcds": last["gcds"],
        }
    table = markdown(results, args)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    (args.out / f"{args.name}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
