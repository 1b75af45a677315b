"""The engines ``benchmarks.zero.rank`` compares and their DeepSpeed configs.

The levels set (``benchmarks.zero.run``): ZeRO-3, hpZ and ours at the package and node levels. The
scale set (``benchmarks.zero.scale``), all at the same secondary memory: every variant that keeps a secondary weight copy keeps it over the ranks of one node: hpZ with
``zero_hpz_partition_size`` = ranks per node, ours with ``secondary_level: node``, so each holds
``1 / ranks per node`` of the weights besides its primary partition.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from mdsp_base.topology import Level, Topology

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


def param_count(args: argparse.Namespace) -> int:
    """Parameters of the benchmark's MLP: ``--layers`` square layers of ``--hidden`` with biases."""
    return args.layers * (args.hidden * args.hidden + args.hidden)


def ds_config(
    args: argparse.Namespace, topology: Topology, level: Level = Level.PACKAGE, **zero: object
) -> dict:
    """The DeepSpeed JSON of one engine (``zero``: extra zero_optimization keys); bf16 on a
    stand-in device, as on Frontier, fp32 on the host's own compute, which its CPU runs fastest."""
    # Prefetch on; every parameter gathered in each forward and backward (no reuse, none persistent,
    # at most --max-live elements gathered at once: with DeepSpeed's default of 1e9 a small model
    # stays gathered from its forward to its backward), as the cost model assumes. One reduce bucket
    # of the model's size: DeepSpeed's default (5e8 elements) reduces this model in one bucket at the
    # end of backward too, but preallocates 2 GB for it, which would swamp every peak.
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.micro,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": args.prefetch_bucket,
            "overlap_comm": True,
            "reduce_bucket_size": param_count(args),
            "stage3_max_live_parameters": args.max_live,
            **zero,
        },
        "steps_per_print": 10**9,
        "topology": {
            "ranks_per_node": topology.ranks_per_node,
            "ranks_per_package": topology.ranks_per_package,
        },
        "hierarchical_zero": {"enabled": False, "secondary_level": level, "secondary_memory_budget_gb": 1.0},
        "bf16": {"enabled": args.device != "host"},
    }


def variant_configs(args: argparse.Namespace, topology: Topology) -> dict[str, tuple[str, dict]]:
    """The engines to compare, by name: (stock or ours, DeepSpeed config)."""
    node, package = topology.ranks_per_node, topology.ranks_per_package
    if args.variant_set == "scale":
        configs: dict[str, tuple[str, dict]] = {}
        for name, variant in scale_variants(node, args.chunks, args.algorithms, args.question).items():
            cfg = ds_config(args, topology, Level.NODE, **variant.zero)
            cfg["hierarchical_zero"].update(variant.hierarchical)
            configs[name] = (variant.kind, cfg)
        return configs
    # ZeRO++ hpZ next to ours at the same secondary memory: hpZ(package size) and hpZ(node size).
    configs: dict[str, tuple[str, dict]] = {
        "zero3": ("stock", ds_config(args, topology)),
        f"zero++ hpZ({package})": ("stock", ds_config(args, topology, zero_hpz_partition_size=package)),
        "ours (package)": ("ours", ds_config(args, topology, Level.PACKAGE)),
        f"zero++ hpZ({node})": ("stock", ds_config(args, topology, zero_hpz_partition_size=node)),
        "ours (node)": ("ours", ds_config(args, topology, Level.NODE)),
    }
    for item in args.ours_variant:
        name, _, keys = item.partition("=")
        cfg = ds_config(args, topology, Level.PACKAGE)
        cfg["hierarchical_zero"].update(json.loads(keys))
        configs[f"ours ({name})"] = ("ours", cfg)
    return configs
