"""The engines of the scale benchmark (``benchmarks.zero.scale``), all at the same secondary memory.

Every variant that keeps a secondary weight copy keeps it over the ranks of one node: hpZ with
``zero_hpz_partition_size`` = ranks per node, ours with ``secondary_level: node``, so each holds
``1 / ranks per node`` of the weights besides its primary partition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

Role = Literal["flat", "hpz", "zero++", "serial", "pipelined"]


class Question(StrEnum):
    """What one run of the scale benchmark answers: its variants differ in that alone."""

    ALL = "all"
    """Every variant; ours pipelined against hpZ and against ours serial (the targets)."""
    ALGORITHM = "algorithm"
    """Ours, 1 chunk: ring against recursive across nodes."""
    PIPELINING = "pipelining"
    """Ours, one algorithm (the first of --algorithms): 1 chunk against --chunks chunks."""
    BASELINES = "baselines"
    """ZeRO-3 against hpZ and ours serial, each one's wire bytes beside the bandwidth-optimal
    volume of what it launched (run with a model over stage3_max_live_parameters, so that hpZ's
    backward gathers read its secondary copy)."""


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


def scale_variants(
    ranks_per_node: int, chunks: int, algorithms: list[str], question: Question = Question.ALL
) -> dict[str, Variant]:
    """The variants that answer ``question``, by display name; for all: flat ZeRO-3, hpZ, ZeRO++
    (hpZ with our quantized hops), ours with serial hops and ours pipelined with each algorithm
    across nodes."""
    serial = {"inter_node_algorithm": "ring", "pipeline_chunks": 1}
    if question == Question.ALGORITHM:
        return {
            f"ours ({algorithm}, 1 chunk)": Variant(
                "ours", "serial", hierarchical={"inter_node_algorithm": algorithm, "pipeline_chunks": 1}
            )
            for algorithm in ("ring", "recursive")
        }
    if question == Question.PIPELINING:
        return {
            f"ours ({algorithms[0]}, {c} chunk{'s' if c > 1 else ''})": Variant(
                "ours",
                "pipelined",
                hierarchical={"inter_node_algorithm": algorithms[0], "pipeline_chunks": c},
            )
            for c in (1, chunks)
        }
    if question == Question.BASELINES:
        return {
            "zero3": Variant("stock", "flat"),
            f"hpZ({ranks_per_node})": Variant("stock", "hpz", {"zero_hpz_partition_size": ranks_per_node}),
            "ours serial (ring, 1 chunk)": Variant("ours", "serial", hierarchical=serial),
        }
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
