"""The engines ``benchmarks.zero.rank`` compares and their DeepSpeed configs.

The levels set (``benchmarks.zero.run``): ZeRO-3, hpZ and ours at the package and node levels. The
scale set (the study ``benchmarks.studies.zero.scale``), all at the same secondary memory: every
variant that keeps a secondary weight copy keeps it over the ranks of one node (hpZ with
``zero_hpz_partition_size`` = ranks per node, ours with ``secondary_level: node``), so each holds
``1 / ranks per node`` of the weights besides its primary partition.
"""

from __future__ import annotations

import argparse
import json
from enum import StrEnum

from deepspeed_ext.zero.tools.ab.variants import Variant
from mdsp_base.topology import Level, Topology


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


def scale_variants(
    ranks_per_node: int, chunks: int, algorithms: list[str], question: Question = Question.ALL
) -> dict[str, Variant]:
    """The variants that answer ``question``, by display name; for all: flat ZeRO-3, hpZ, ZeRO++
    (hpZ with our quantized hops), ours with serial hops and ours pipelined with each algorithm
    across nodes."""
    serial = {"inter_node_algorithm": "ring", "pipeline_chunks": 1}
    zero3 = Variant("zero3", ours=False, role="flat")
    hpz = Variant(
        f"hpZ({ranks_per_node})", ours=False, zero={"zero_hpz_partition_size": ranks_per_node}, role="hpz"
    )
    ours_serial = Variant("ours serial (ring, 1 chunk)", ours=True, hierarchical=serial, role="serial")
    if question == Question.ALGORITHM:
        out = [
            Variant(
                f"ours ({algorithm}, 1 chunk)",
                ours=True,
                hierarchical={"inter_node_algorithm": algorithm, "pipeline_chunks": 1},
                role="serial",
            )
            for algorithm in ("ring", "recursive")
        ]
    elif question == Question.PIPELINING:
        out = [
            Variant(
                f"ours ({algorithms[0]}, {c} chunk{'s' if c > 1 else ''})",
                ours=True,
                hierarchical={"inter_node_algorithm": algorithms[0], "pipeline_chunks": c},
                role="pipelined",
            )
            for c in (1, chunks)
        ]
    elif question == Question.BASELINES:
        out = [zero3, hpz, ours_serial]
    else:
        # DeepSpeed's qwZ / qgZ are CUDA kernels: on CPU, ZeRO++ is our engine with hpZ's node-level
        # secondary copy, serial hops, and our int8 weight / int4 gradient hops across nodes.
        zeropp = Variant(
            f"zero++ (hpZ({ranks_per_node}) + our int8/int4 hops)",
            ours=True,
            hierarchical={**serial, "quantized_weights": True, "quantized_gradients": "int4"},
            role="zero++",
        )
        out = [zero3, hpz, zeropp, ours_serial] + [
            Variant(
                f"ours pipelined ({algorithm}, {chunks} chunks)",
                ours=True,
                hierarchical={"inter_node_algorithm": algorithm, "pipeline_chunks": chunks},
                role="pipelined",
            )
            for algorithm in algorithms
        ]
    return {v.name: v for v in out}


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


def variant_configs(args: argparse.Namespace, topology: Topology) -> dict[str, tuple[bool, dict]]:
    """The engines to compare, by name: (ours or stock DeepSpeed, DeepSpeed config)."""
    node, package = topology.ranks_per_node, topology.ranks_per_package
    if args.variant_set == "scale":
        configs: dict[str, tuple[bool, dict]] = {}
        for name, variant in scale_variants(node, args.chunks, args.algorithms, args.question).items():
            cfg = ds_config(args, topology, Level.NODE, **variant.zero)
            cfg["hierarchical_zero"].update(variant.hierarchical)
            configs[name] = (variant.ours, cfg)
        return configs
    # ZeRO++ hpZ next to ours at the same secondary memory: hpZ(package size) and hpZ(node size).
    configs: dict[str, tuple[bool, dict]] = {
        "zero3": (False, ds_config(args, topology)),
        f"zero++ hpZ({package})": (False, ds_config(args, topology, zero_hpz_partition_size=package)),
        "ours (package)": (True, ds_config(args, topology, Level.PACKAGE)),
        f"zero++ hpZ({node})": (False, ds_config(args, topology, zero_hpz_partition_size=node)),
        "ours (node)": (True, ds_config(args, topology, Level.NODE)),
    }
    for item in args.ours_variant:
        name, _, keys = item.partition("=")
        cfg = ds_config(args, topology, Level.PACKAGE)
        cfg["hierarchical_zero"].update(json.loads(keys))
        configs[f"ours ({name})"] = (True, cfg)
    return configs
