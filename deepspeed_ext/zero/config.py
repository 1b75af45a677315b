"""The ``hierarchical_zero`` section of the DeepSpeed JSON."""

from __future__ import annotations

import argparse
from enum import StrEnum
from typing import Annotated

from pydantic import Field, model_validator

from mdsp_base.section import ConfigError, Section
from mdsp_base.topology import LinkClass


class SecondaryLevel(StrEnum):
    """Where the secondary 16-bit weight copy lives."""

    AUTO = "auto"
    """The fastest level whose memory fits the budget (the planner's choice)."""
    PACKAGE = "package"
    """Partitioned over the ranks of one package (the GCD pair of an MI250X)."""
    NODE = "node"
    """Partitioned over the ranks of one node."""


class GradReduce(StrEnum):
    """How gradients are reduce-scattered."""

    HIERARCHICAL = "hierarchical"
    """In hops: package, then across the node's packages, then across nodes."""
    FLAT = "flat"
    """One reduce-scatter over the data-parallel group, as ZeRO-3."""


class GradSync(StrEnum):
    """When gradients cross nodes."""

    EVERY_MICRO_BATCH = "every_micro_batch"
    """Every micro-batch, as ZeRO-3."""
    ACCUMULATION_BOUNDARY = "accumulation_boundary"
    """Once per optimizer step, summed per node in fp32 until then."""


class GradientQuantization(StrEnum):
    """The gradient hop across nodes on the wire."""

    NONE = "none"
    """The communication dtype."""
    INT8 = "int8"
    """Blockwise int8 with error feedback."""
    INT4 = "int4"
    """Blockwise int4 with error feedback."""


class SequenceParallelGradients(StrEnum):
    """The gradient the optimizer gets under Ulysses sequence parallelism (SP > 1)."""

    DEEPSPEED = "deepspeed"
    """DeepSpeed ZeRO-3's: the mean over sequence x data-parallel ranks, 1/SP of what SP=1 gets."""
    MEAN = "mean"
    """The mean over data-parallel replicas: the gradient SP=1 gets, so clipping acts as at SP=1."""


def check_zero_stage(stage: int) -> None:
    """The variant is a ZeRO-3 engine: any other stage is refused, naming the fix."""
    if stage != 3:
        raise ConfigError(
            f"hierarchical_zero.enabled=true needs zero_optimization.stage 3, got stage {stage}: "
            'set "zero_optimization": {"stage": 3} or disable hierarchical_zero'
        )


class InterNodeAlgorithm(StrEnum):
    """How a hop across nodes moves its blocks."""

    AUTO = "auto"
    """Per call, the algorithm the probe profile (``profile``) measured faster at that message size;
    without a profile, ring: the point-to-point steps run only where measured on this cluster."""
    RING = "ring"
    """The backend's own collective (NCCL/RCCL rings; gloo's algorithm on CPU)."""
    RECURSIVE = "recursive"
    """Distance doubling (all-gather) / halving (reduce-scatter) over point-to-point transfers:
    ceil(log2 nodes) steps for any node count, the same bytes as a ring."""


class HierarchicalZeroConfig(Section):
    enabled: bool = False
    """Use the hierarchical ZeRO-3 variant (needs zero_optimization.stage 3)."""
    secondary_level: SecondaryLevel = SecondaryLevel.AUTO
    """Level of the secondary 16-bit weight partition; auto picks the fastest one that fits the budget."""
    secondary_memory_budget_gb: float = Field(default=8.0, gt=0)
    """Extra memory per rank (GB) for the secondary weight copy, held gradient blocks and hop buffers when secondary_level is auto."""
    grad_reduce: GradReduce = GradReduce.HIERARCHICAL
    """Gradient reduce-scatter in hops package -> node -> global, or one flat reduce-scatter."""
    link_bandwidth_gbps: dict[LinkClass, Annotated[float, Field(gt=0, allow_inf_nan=False)]] | None = None
    """GB/s per link class for the cost model: package and node per rank, inter_node the node's NICs together; null keeps the documented figures (Frontier's where packages hold two ranks, else H100's NCCL)."""
    grad_sync: GradSync = GradSync.EVERY_MICRO_BATCH
    """When gradients cross nodes: every micro-batch (as ZeRO-3) or once per step, summed per node in fp32 until then."""
    quantized_weights: bool = False
    """All-gather weights across nodes as blockwise int8 (forward gathers of the primary partition)."""
    quantized_gradients: GradientQuantization = GradientQuantization.NONE
    """Reduce gradients across nodes as blockwise int8 or int4, with error feedback."""
    quantization_block: int = Field(default=256, ge=2, multiple_of=2)
    """Elements per quantization scale (one fp32 scale each) in the quantized hops."""
    inter_node_algorithm: InterNodeAlgorithm = InterNodeAlgorithm.AUTO
    """Algorithm of the hops across nodes: recursive (log-latency P2P), ring (the backend's collective) or auto (per call, the faster in the profile; ring without one)."""
    profile: str | None = None
    """Path of a profile measured on this cluster by python -m deepspeed_ext.zero.probe: auto and the planner read it (null: ring everywhere, documented costs for the planner)."""
    sequence_parallel_gradients: SequenceParallelGradients = SequenceParallelGradients.DEEPSPEED
    """Under Ulysses (SP > 1): deepspeed (stock ZeRO-3's gradient, 1/SP of SP=1's) or mean (SP=1's gradient, so gradient_clipping clips as at SP=1)."""
    pipeline_chunks: int = Field(default=1, ge=1, le=64)
    """Pieces each unquantized hop gather / reduce-scatter is cut into so that its levels run at once (a thread or stream per group); 1 (the default) runs them one after another on the caller's stream."""

    @property
    def grad_bits(self) -> int | None:
        """Bits of the quantized gradient hop (None: not quantized)."""
        return {"int8": 8, "int4": 4}.get(self.quantized_gradients)

    def check_megatron_args(self, args: argparse.Namespace) -> None:
        """Refuses, at start-up, a Megatron job that trains without DeepSpeed.

        Args:
            args: Megatron's parsed arguments.

        Raises:
            ConfigError: naming the flag to change.
        """
        if self.enabled and not getattr(args, "deepspeed", False):
            raise ConfigError(
                "hierarchical_zero is a DeepSpeed ZeRO-3 variant: pass --deepspeed (Megatron-DeepSpeed); "
                "Megatron-LM trains without DeepSpeed, so disable hierarchical_zero there"
            )

    @model_validator(mode="after")
    def _hops_across_nodes(self) -> HierarchicalZeroConfig:
        if self.grad_reduce == "flat" and (self.grad_sync != "every_micro_batch" or self.grad_bits):
            raise ConfigError(
                f"hierarchical_zero.grad_sync={self.grad_sync} / quantized_gradients={self.quantized_gradients} "
                "change the cross-node gradient hop, which grad_reduce=flat does not have: set grad_reduce "
                "to hierarchical or leave both at their defaults"
            )
        return self
