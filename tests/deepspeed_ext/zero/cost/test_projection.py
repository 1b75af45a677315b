"""The projection library (deepspeed_ext/zero/cost/projection.py) and the planner CLI against
hand-derived figures: parameter counts, DeepSpeed's launches from the JSON's buckets, Megatron's
activation memory, qgZ's two all-to-alls, pipelined hops. Pure arithmetic, no processes."""

from __future__ import annotations

import json

import pytest

from deepspeed_ext.zero.config import HierarchicalZeroConfig, InterNodeAlgorithm
from deepspeed_ext.zero.cost.collectives import (
    Algorithm,
    AlgorithmFit,
    CollectiveCosts,
    for_topology,
)
from deepspeed_ext.zero.cost.projection import (
    Candidate,
    Scheme,
    comm_seconds,
    gather_calls,
    memory,
    reduce_calls,
    shape,
)
from deepspeed_ext.zero.cost.secondary_level import choose_secondary_level
from deepspeed_ext.zero.cost.shape import DPShape
from deepspeed_ext.zero.cost.volume import ShardSpec
from deepspeed_ext.zero.cost.workload import Buckets, Model, Recompute, System
from deepspeed_ext.zero.tools.recommend import PRESETS
from mdsp_base.topology import LinkClass, Topology

GPT_20B = Model(layers=44, hidden=6144, heads=64, seq=2048)
PRESET = Buckets(prefetch=50_000_000, reduce=50_000_000, persistence=100_000, max_live=1_000_000_000)
# Round numbers: every link 1 GB/s per rank, no latency, NICs 8 GB/s per node.
UNIT = CollectiveCosts(
    "unit",
    {
        (LinkClass.PACKAGE, Algorithm.RING): AlgorithmFit(0.0, 1.0),
        (LinkClass.NODE, Algorithm.RING): AlgorithmFit(0.0, 1.0),
        (LinkClass.INTER_NODE, Algorithm.RING): AlgorithmFit(0.0, 1.0),
        (LinkClass.INTER_NODE, Algorithm.RECURSIVE): AlgorithmFit(0.0, 1.0),
    },
    nic_gbps=8.0,
)
UNIT_SYSTEM = System(UNIT, ranks_per_node=8, ranks_per_package=2)
FRONTIER_TOPOLOGY = Topology(world_size=384, ranks_per_node=8, ranks_per_package=2)


def test_20b_parameters_and_buckets_from_the_preset_json():
    # 44 x (12 h^2 + 13 h) + 2 V h with h = 6144, V = 50432.
    assert GPT_20B.params == 20_554_555_392
    ds = json.loads((PRESETS / "ds_frontier_20b.json").read_text())
    assert Buckets.from_json(ds) == PRESET
    # TP=4: QKV 28.3M, projection 9.4M, fc1 and fc2 37.7M each: one all-gather each (under 5e7);
    # each embedding 77.5M: two. 44 x 4 + 2 x 2 = 180 per pass, "about 4 per layer".
    assert len(gather_calls(GPT_20B.modules(4), PRESET)) == 180
    # Gradients: 5.14e9 elements per TP rank in 5e7 buckets: 103 reduce-scatters per micro-batch.
    assert len(reduce_calls(GPT_20B.params // 4, PRESET)) == 103
    # DeepSpeed's default 5e8 reduce bucket: 11.
    assert len(reduce_calls(GPT_20B.params // 4, Buckets())) == 11


def test_megatron_activation_memory_and_zero3_states():
    # Korthikanti et al. Table 2, TP without SP: sbh (10 + 24/t + 5as/(ht)) = 2048 x 6144 x 42.67 per layer.
    per_layer = 2048 * 6144 * (10 + 24 / 4 + 5 * 64 * 2048 / (6144 * 4))
    logits = 4 * 2048 * 50432 / 4
    assert GPT_20B.activation_bytes(1, 4, Recompute.NONE) == pytest.approx(44 * per_layer + logits)
    assert GPT_20B.activation_bytes(1, 4, Recompute.FULL) == pytest.approx(44 * 2 * 2048 * 6144 + logits)
    frontier = System(UNIT)
    s = shape(frontier, 48, 4)
    assert s == DPShape(nodes=48, packages_per_node=2, per_package=1)
    m = memory(frontier, GPT_20B, s, Candidate(Scheme.ZERO3, tp=4, buckets=PRESET))
    assert m["states"] == pytest.approx(16 * GPT_20B.params / 4 / 96)  # 16 bytes per element over DP 96
    assert m["secondary"] == 0
    ideal = memory(frontier, GPT_20B, s, Candidate(Scheme.HPZ_IDEAL, tp=4, buckets=PRESET))
    deepspeed = memory(frontier, GPT_20B, s, Candidate(Scheme.HPZ, tp=4, buckets=PRESET))
    assert ideal["secondary"] == pytest.approx(2 * GPT_20B.params / 4 / 2)  # the node's 2 DP members
    assert deepspeed["secondary"] == pytest.approx(2 * GPT_20B.params / 4 / 8)  # 8 consecutive ranks


def test_qgz_is_an_all_to_all_in_the_node_then_one_across_nodes():
    """One 8 GB reduce bucket, 2 nodes x 8 DP members (TP=1). qgZ: int4 (2 GB) all-to-all over
    the node's 8 at 1 GB/s: 7/8 x 2 GB = 1.75 s; then 2 GB / 8 = 0.25 GB across 2 nodes, half of
    it sent, 8 communicators sharing 8 GB/s: 0.125 GB / 1 GB/s = 0.125 s."""
    s = DPShape(2, 4, 2)
    t = comm_seconds(UNIT_SYSTEM, [], [4_000_000_000], s, Candidate(Scheme.ZEROPP))
    assert t == pytest.approx(1.75 + 0.125)


def test_pipelined_hops_take_the_slowest_level_and_one_chunk_of_the_others():
    """An 8 GB all-gather over 2 nodes x 4 packages x 2 (TP=1), hops, 1 GB/s everywhere. Across
    nodes 1 GB (8 GB / 8 members per node) half sent: 0.5 s; across packages 4 GB, 3/4 sent: 3 s;
    in the package 8 GB, half sent: 4 s. In sequence 7.5 s; in 4 chunks 4 + (0.5 + 3) / 4."""
    s = DPShape(2, 4, 2)
    calls = [4_000_000_000]  # elements, bf16: 8 GB
    ours = Candidate(Scheme.OURS, secondary=None, inter_node=InterNodeAlgorithm.RING, grad_accum=1)
    gathers = comm_seconds(UNIT_SYSTEM, calls, [], s, ours)
    assert gathers == pytest.approx(2 * 7.5)  # forward and backward
    piped = comm_seconds(UNIT_SYSTEM, calls, [], s, Candidate(**{**ours.__dict__, "pipeline_chunks": 4}))
    assert piped == pytest.approx(2 * (4 + 3.5 / 4))


def test_flat_ring_is_held_by_its_edges_inside_the_node():
    """ZeRO-3's flat all-gather of 8 GB over 16 ranks: 15/16 x 8 GB = 7.5 GB per rank through every
    edge; the NICs carry it at 1 GB/s (one communicator per node), so do the links inside."""
    t = comm_seconds(UNIT_SYSTEM, [4_000_000_000], [], DPShape(2, 4, 2), Candidate(Scheme.ZERO3))
    assert t == pytest.approx(2 * 7.5)


def test_secondary_level_auto_times_levels_with_the_clis_projection():
    """The engine's choice (planner.choose_secondary_level) and the CLI cost a level the same way:
    a model of 4 equal modules of 1e8 elements (one bucket each), 48 nodes x 4 x 2, one reduce bucket.
    Without a measured profile inter_node_algorithm auto runs the library's collective, so the
    engine charges its hops across nodes as rings."""
    s = DPShape(48, 4, 2)
    spec = ShardSpec(param_numels=(100_000_000,) * 4, gathers_per_pass=4)
    buckets = Buckets(prefetch=100_000_000, reduce=400_000_000)
    config = HierarchicalZeroConfig(enabled=True, secondary_memory_budget_gb=1e3, pipeline_chunks=2)
    choice = choose_secondary_level(config, s, spec, FRONTIER_TOPOLOGY, micro_batches=2, buckets=buckets)
    frontier = System(for_topology(2))
    for level, link in ((LinkClass.PACKAGE, LinkClass.PACKAGE), (LinkClass.NODE, LinkClass.NODE)):
        plan = Candidate(
            Scheme.OURS,
            grad_accum=2,
            secondary=link,
            inter_node=InterNodeAlgorithm.RING,
            pipeline_chunks=2,
            buckets=buckets,
        )
        assert choice.step_seconds[level] == comm_seconds(frontier, [100_000_000] * 4, [400_000_000], s, plan)
    assert choice.level == "package"  # the smallest backward gathers, with memory to spare


def test_the_step_charges_the_systems_gemm_efficiency_and_overlap():
    """A 1-layer toy at TP=1 on one node: compute = FLOPs / (peak x efficiency); the step hides the
    system's overlap fraction of the communication behind it."""
    from dataclasses import replace

    from deepspeed_ext.zero.cost.projection import project

    toy = Model(layers=1, hidden=256, heads=4, seq=128)
    slow, fast = (replace(UNIT_SYSTEM, peak_tflops=1.0, gemm_efficiency=e) for e in (0.25, 0.5))
    plan = Candidate(Scheme.ZERO3)
    a, b = project(slow, toy, 1, plan), project(fast, toy, 1, plan)
    assert a.compute_s == pytest.approx(toy.flops(1, Recompute.NONE) / 0.25e12)
    assert a.compute_s == pytest.approx(2 * b.compute_s)
    hidden = project(replace(slow, overlap=1.0), toy, 1, plan)
    assert hidden.step_s == pytest.approx(max(a.compute_s, a.comm_s))
    assert a.step_s == pytest.approx(a.compute_s + a.comm_s)


def test_quantized_and_boundary_held_hops_are_charged_whole_as_the_runtime_runs_them():
    """pipeline_chunks pipelines plain hops only: the runtime sends a quantized gather, and a
    gradient reduce-scatter that is quantized or held for boundary sync, in one piece."""
    from dataclasses import replace

    s = DPShape(4, 2, 2)
    plain = Candidate(Scheme.OURS, secondary=None, inter_node=InterNodeAlgorithm.RING)
    for keys in ({"quantized_gradients": True}, {"boundary_sync": True, "grad_accum": 2}):
        one, four = (replace(plain, pipeline_chunks=c, **keys) for c in (1, 4))
        assert comm_seconds(UNIT_SYSTEM, [], [10**8], s, four) == comm_seconds(
            UNIT_SYSTEM, [], [10**8], s, one
        )
    # A plain reduce-scatter is pipelined: with no latency, 4 chunks cost less than 1.
    assert comm_seconds(UNIT_SYSTEM, [], [10**8], s, replace(plain, pipeline_chunks=4)) < comm_seconds(
        UNIT_SYSTEM, [], [10**8], s, plain
    )
    # Quantized weights, no secondary copy, one micro-batch: the first (quantized) gather whole, the
    # backward one (plain, over the same hops) pipelined: only half of what 4 chunks save unquantized.
    q1, q4 = (replace(plain, quantized_weights=True, pipeline_chunks=c) for c in (1, 4))
    p1, p4 = (replace(plain, pipeline_chunks=c) for c in (1, 4))
    saved = {k: comm_seconds(UNIT_SYSTEM, [10**8], [], s, a) - comm_seconds(UNIT_SYSTEM, [10**8], [], s, b)
             for k, (a, b) in {"quantized": (q1, q4), "plain": (p1, p4)}.items()}  # fmt: skip
    assert saved["plain"] > 0 and saved["quantized"] == pytest.approx(saved["plain"] / 2)
