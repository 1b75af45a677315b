"""Kernel launches per layer, forward and backward: Flash-Overlap's TP/SP layer against
megatron-core's, and its Ulysses block (on Megatron-DeepSpeed's [q | k | v] weight and group-major)
against DeepSpeed's ``DistributedAttention``, at TP = SP = 2 and 4 (``launches_rank.py`` counts).

  python -m benchmarks.studies.flash_overlap.launches [--out benchmarks/results/flash_overlap]

Writes launches.json and launches.md. Counts are exact (the same every run), not timings.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mdsp_base.shutdown import exit_without_teardown
from multirank import launch_ranks

KINDS = ("gemm", "attention", "other")
TP_LINEARS = 4  # qkv, proj, fc1, fc2


def _kernels(passes: dict[str, dict[str, int]], which: str) -> int:
    return sum(passes[which].get(kind, 0) for kind in KINDS)


def _row(method: str, passes: dict[str, dict[str, int]]) -> str:
    cells = [f"{passes[p].get('gemm', 0)} / {_kernels(passes, p)}" for p in ("forward", "backward")]
    return f"| {method} | {cells[0]} | {cells[1]} |"


def markdown(results: dict[int, dict[str, Any]]) -> str:
    lines = [
        "# Kernel launches per layer (GEMMs / all kernels; counted, exact)",
        "",
        "`python -m benchmarks.studies.flash_overlap.launches`. Every ATen operator that runs a kernel, on rank 0,",
        "views and allocations excluded; communication not included. Layer: megatron-core's TransformerLayer,",
        "sequence parallelism on; flash_overlap_merged: flash_overlap with 2 GEMMs per collective",
        "(`flash_overlap.compute_slices: 2`); Ulysses: QKV linear, all-to-all, causal attention, all-to-all,",
        "output linear.",
        "",
    ]
    for n, r in sorted(results.items()):
        a = r["args"]
        lines += [f"## N = {n} (hidden {a['heads'] * a['head_dim']}, {a['heads']} heads, {a['kv_heads']} KV heads "
                  f"for Ulysses, s = {a['seq']})", "", "| method | forward | backward |", "|---|---:|---:|"]  # fmt: skip
        lines += [_row(f"TP layer: {m}", p) for m, p in r["tp_layer"].items()]
        lines += [_row(f"Ulysses: {m}", p) for m, p in r["ulysses"].items()]
        mc = r["tp_layer"]["megatron_core"]
        lines += [
            "",
            f"Target (<= megatron-core's + 2 per TP linear, {2 * TP_LINEARS} per layer and pass):",
            "",
        ]
        for ours in ("flash_overlap", "flash_overlap_merged"):
            if ours not in r["tp_layer"]:
                continue
            extra = {p: _kernels(r["tp_layer"][ours], p) - _kernels(mc, p) for p in ("forward", "backward")}
            verdict = {p: "met" if e <= 2 * TP_LINEARS else "missed" for p, e in extra.items()}
            lines.append(
                f"- {ours}: forward +{extra['forward']} ({verdict['forward']}), "
                f"backward +{extra['backward']} ({verdict['backward']})"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/flash_overlap"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    results = {
        n: launch_ranks(["-m", "benchmarks.studies.flash_overlap.launches_rank"], world_size=n, timeout=600)[
            0
        ]
        for n in args.sizes
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "launches.json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    (args.out / "launches.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
    exit_without_teardown()
