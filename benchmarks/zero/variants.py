"""The engines of the scale benchmark (``benchmarks.zero.scale``), all at the same secondary memory.

Every variant that keeps a secondary weight copy keeps it over the ranks of one node: hpZ with
``zero_hpz_partition_size`` = ranks per node, ours with ``secondary_level: node``, so each holds
``1 / ranks per node`` of the weights besides its primary partition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Role = Literal["flat", "hpz", "zero++", "serial", "pipelined"]


@dataclass(frozen=True)
class Variant:
    """One engine: stock DeepSpeed or ours, with the keys that make it this variant."""

    kind: Literal["stock", "ours"]
    """Which initialize builds it."""
    role: Role
    """What it stands for in the targets."""
    zero: dict[str, object] = field(default_factory=dict)
    """Extra zero_optimization keys."""
    hierarchical: dict[str, object] = field(default_factory=dict)
    """hierarchical_zero keys (ours only)."""


def scale_variants(ranks_per_node: int, chunks: int, algorithms: list[str]) -> dict[str, Variant]:
    """Flat ZeRO-3, hpZ, ZeRO++ (hpZ with our quantized hops), ours with serial hops and ours
    pipelined with each algorithm across nodes, by display name."""
    serial = {"inter_node_algorithm": "ring", "pipeline_chunks": 1}
    out = {
        "zero3": Variant("stock", "flat"),
        f"hpZ({ranks_per_node})": Variant("stock", "hpz", {"zero_hpz_partition_size": ranks_per_node}),
        # DeepSpeed's qwZ / qgZ are CUDA kernels: on CPU, ZeRO++ is our engine with hpZ's node-level
        # secondary copy, serial hops, and our int8 weight / int4 gradient hops across nodes.
        f"zero++ (hpZ({ranks_per_node}) + our int8/int4 hops)": Variant(
            "ours",
            "zero++",
            hierarchical={**serial, "quantized_weights": True, "quantized_gradients": "int4"},
        ),
        "ours serial (ring, 1 chunk)": Variant("ours", "serial", hierarchical=serial),
    }
    for algorithm in algorithms:
        out[f"ours pipelined ({algorithm}, {chunks} chunks)"] = Variant(
            "ours",
            "pipelined",
            hierarchical={"inter_node_algorithm": algorithm, "pipeline_chunks": chunks},
        )
    return out
