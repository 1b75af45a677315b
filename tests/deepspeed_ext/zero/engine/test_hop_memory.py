"""Transient memory of the hops, read from the CPU allocator, against DeepSpeed's flat calls and the
planner's computed figure (deepspeed_ext.zero.cost.memory.hop_buffers), at 8 ranks (2 x 2 x 2), fp32.

The peak is the most bytes the call has allocated at once, inputs and preallocated outputs excluded
(the allocation events of torch's profiler, in order). Allocations made inside a collective or on the
backend's threads are the backend's (gloo copies its inputs; NCCL does not) and left out of both
sides. The planner's figure must cover the measured
extra over DeepSpeed's call and stay within 15 % of it: a budget that neither hides memory nor
reserves memory that is never used."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from deepspeed_ext.zero.config import HierarchicalZeroConfig, InterNodeAlgorithm
from deepspeed_ext.zero.cost import volume as cm
from deepspeed_ext.zero.cost.memory import hop_buffers
from deepspeed_ext.zero.cost.shape import DPShape
from mdsp_base import comm
from mdsp_base.allocations import AllocationTrace
from mdsp_base.topology import Topology

TOPOLOGY = Topology(world_size=8, ranks_per_node=4, ranks_per_package=2)
SHAPE = DPShape(nodes=2, packages_per_node=2, per_package=2)
BUCKET = (300_001, 1_000, 500_003, 200_000)  # gradient tensors of one reduce bucket
GATHER = 8 * 100_000  # elements of one parameter all-gather
CONFIGS = {
    "plain": HierarchicalZeroConfig(enabled=True, inter_node_algorithm="ring"),
    "recursive": HierarchicalZeroConfig(enabled=True, inter_node_algorithm="recursive"),
    "int8": HierarchicalZeroConfig(enabled=True, quantized_weights=True, quantized_gradients="int8"),
    "int4": HierarchicalZeroConfig(enabled=True, quantized_weights=True, quantized_gradients="int4"),
}


def peak_bytes(fn: Callable[[], Any], repeats: int = 5) -> int:
    """Fewest of ``repeats`` calls' :func:`one_peak`: gloo's thread sometimes drops its reference
    to a hop's input late, which holds that buffer a moment longer than the call needs it."""
    return min(one_peak(fn) for _ in range(repeats))


def one_peak(fn: Callable[[], Any]) -> int:
    """Most bytes ``fn`` held allocated at once (its result counts while it lives)."""
    with AllocationTrace() as trace:
        result = fn()
    del result
    return trace.peak()


def _measure() -> dict:
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced as ds_rs

    from deepspeed_ext.zero.engine import hops
    from deepspeed_ext.zero.engine.grad_sync import GradientReducer
    from deepspeed_ext.zero.engine.levels import build_levels

    comm.patch_deepspeed_comm()
    levels = build_levels(TOPOLOGY, None, "global", CONFIGS["plain"])
    plan, dp = levels.dp_plan(), levels.dp_group
    recursive = dataclasses.replace(plan, inter_node=InterNodeAlgorithm.RECURSIVE)
    g = torch.Generator().manual_seed(dist.get_rank())
    grads = [torch.randn(n, generator=g) for n in BUCKET]
    block = torch.randn(GATHER // 8, generator=g)
    out = torch.empty(GATHER)
    out_ = {
        "reduce stock": peak_bytes(lambda: ds_rs(grads, dp)),
        "reduce plain": peak_bytes(lambda: hops.reduce_scatter_coalesced(plan, grads)),
        "reduce recursive": peak_bytes(lambda: hops.reduce_scatter_coalesced(recursive, grads)),
        "gather stock": peak_bytes(lambda: comm.all_gather_into_tensor(out, block, group=dp)),
        "gather plain": peak_bytes(lambda: hops.all_gather(plan, block, out)),
        "gather int8": peak_bytes(lambda: hops.all_gather(plan, block, out, 256)),
    }
    for bits in (8, 4):
        reducer = GradientReducer(plan, at_boundary=False, grad_bits=bits, block=256)
        reducer(grads)  # the second call carries an error-feedback residual, as in training
        out_[f"reduce int{bits}"] = peak_bytes(functools.partial(reducer, grads))
    levels.destroy_groups()
    return out_


@pytest.fixture(scope="module")
def measured(run_ranks) -> list[dict]:
    return run_ranks(8, _measure)


def _computed(name: str) -> Any:
    model = cm.ShardSpec(param_numels=BUCKET, weight_bytes=4, grad_bytes=4)
    padded_bucket = sum(-(-n // 8) * 8 for n in BUCKET)
    return hop_buffers(CONFIGS[name], SHAPE, model, GATHER, padded_bucket)


def test_reduce_scatter_hops_take_no_more_memory_than_deepspeeds_flat_call(measured):
    for rank in measured:
        assert rank["reduce plain"] <= rank["reduce stock"] * 1.01, rank
        assert _computed("plain").reduce == 0


@pytest.mark.parametrize("name", ["recursive", "int8", "int4"])
def test_recursive_and_quantized_reduce_extra_is_the_planners_figure(measured, name):
    """Recursive: the distance-halving steps receive into one buffer of the largest step's blocks
    (half the cross-node hop's input at 2 nodes)."""
    computed = _computed(name).reduce
    for rank in measured:
        extra = rank[f"reduce {name}"] - rank["reduce stock"]
        assert extra <= computed <= 1.15 * extra, (name, extra, computed)


@pytest.mark.parametrize("name", ["plain", "int8"])
def test_all_gather_extra_is_the_planners_figure(measured, name):
    """Plain: the innermost hop's input and output, 1.5x the gathered bytes at 2 members per
    package; the flat call allocates nothing (DeepSpeed owns the output)."""
    computed = _computed(name).gather
    if name == "plain":
        assert computed == GATHER * 4 * 3 // 2
    for rank in measured:
        extra = rank[f"gather {name}"] - rank["gather stock"]
        assert extra <= computed <= 1.15 * extra, (name, extra, computed)
