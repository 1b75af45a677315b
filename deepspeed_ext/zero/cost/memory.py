"""Bytes per rank the hierarchical variant adds: fp32 gradient blocks held for the cross-node hop
and the transient buffers of one hop collective. The planner (``secondary_level: auto``) and the
projection both count them here; ``tests/deepspeed_ext/zero/engine/test_hop_memory.py`` measures them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from deepspeed_ext.zero.config import HierarchicalZeroConfig, InterNodeAlgorithm
from deepspeed_ext.zero.cost.collectives import recursive_schedule
from deepspeed_ext.zero.cost.shape import DPShape
from deepspeed_ext.zero.cost.volume import ShardSpec


def held_bytes(config: HierarchicalZeroConfig, shape: DPShape, model: ShardSpec) -> int:
    """fp32 bytes per rank kept for the cross-node gradient hop: the node-level block summed until
    the boundary (grad_sync) and the error-feedback residual (quantized_gradients)."""
    if shape.nodes == 1:
        return 0
    node_block = model.padded(shape.size) // shape.per_node * 4
    return node_block * ((config.grad_sync == "accumulation_boundary") + (config.grad_bits is not None))


@dataclass(frozen=True)
class HopBuffers:
    """Peak bytes per rank that one hop collective allocates beyond the flat one it replaces
    (computed from the buffers hops.py and quantize.py allocate; tests/deepspeed_ext/zero/engine/test_hop_memory.py measures)."""

    gather: int
    """One parameter all-gather: the innermost hop's input and output (the flat call writes straight
    into DeepSpeed's buffer), with pipelined hops also the cross-node hop's output (computed, an
    upper bound), or the int8 cross-node hop's integers and fp32 values if larger."""
    reduce: int
    """One gradient reduce-scatter: nothing for ring hops (they run in place in DeepSpeed's packed
    bucket); the recursive cross-node hop's receive buffer; the quantized cross-node hop's fp32
    copy, working copy and integers; boundary sync's zeros handed to DeepSpeed."""

    @property
    def total(self) -> int:
        """Both at once: the all-gather and reduce-scatter streams may overlap."""
        return self.gather + self.reduce


NO_BUFFERS = HopBuffers(0, 0)
"""A flat collective's: none beyond DeepSpeed's own."""


def hop_buffers(
    config: HierarchicalZeroConfig, shape: DPShape, model: ShardSpec, gather_elems: int, reduce_elems: int
) -> HopBuffers:
    """The transient buffers of the hop collectives.

    Args:
        config: the ``hierarchical_zero`` section.
        shape: the data-parallel group as nodes x packages x members.
        model: this rank's parameters.
        gather_elems: elements of the largest all-gather DeepSpeed makes (a prefetch bucket).
        reduce_elems: elements of the largest reduce-scatter (a reduce bucket).

    Returns:
        Peak bytes per rank one hop all-gather and one hop reduce-scatter allocate beyond the
        flat collectives they replace.
    """
    sizes = [s for s in (shape.per_package, shape.packages_per_node, shape.nodes) if s > 1]
    if len(sizes) < 2:  # one hop is the flat collective itself (HopSchedule.is_trivial)
        return NO_BUFFERS
    p, wb, gb = shape.size, model.weight_bytes, model.grad_bytes
    gather = gather_elems * wb + gather_elems // sizes[0] * wb
    if config.pipeline_chunks > 1 and shape.nodes > 1:
        # pieces waiting for the next lane hold their cross-node hop's output besides the serial peak
        gather += gather_elems // shape.per_node * wb
    if config.quantized_weights and shape.nodes > 1:
        # int8 hop across nodes on h = G/p elements: input, output, payload, gathered payloads, fp32 values
        h = math.ceil(gather_elems / p)
        gather = max(gather, h * (wb + shape.nodes * (wb + 1 + 4) + 1))
    reduce = 0
    if config.grad_reduce == "hierarchical" and shape.nodes > 1:
        node_elems = math.ceil(reduce_elems / p) * shape.nodes  # the block that crosses nodes
        if config.inter_node_algorithm != InterNodeAlgorithm.RING:
            # distance halving receives the largest step's blocks into one buffer
            most = max(blocks for _, blocks in recursive_schedule(shape.nodes))
            reduce = most * math.ceil(reduce_elems / p) * gb
        if config.grad_sync == "accumulation_boundary":  # zeros handed to DeepSpeed between boundaries
            reduce = max(reduce, math.ceil(reduce_elems / p) * gb)
        if config.grad_bits:
            padded = -(-node_elems // config.quantization_block) * config.quantization_block
            # fp32 copy of the block (the next residual), then 6 bytes per padded element at once
            # (payload, received payload and the fp32 values dequantized from it), the scales sent
            # and received, and the fp32 sum
            scales = 2 * 4 * padded // config.quantization_block
            reduce = max(reduce, node_elems * 4 + padded * 6 + scales + node_elems // shape.nodes * 4)
    return HopBuffers(gather=gather, reduce=reduce)
