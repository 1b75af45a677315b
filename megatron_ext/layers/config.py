"""The ``flash_overlap`` section of the DeepSpeed JSON."""

from __future__ import annotations

import argparse
from enum import StrEnum

from pydantic import Field, field_validator

from mdsp_base.section import ConfigError, Section


class Mode(StrEnum):
    """The P2P pattern of a layer's exchanges."""

    DIRECT = "direct"
    """Each step a different peer."""
    RING = "ring"
    """Neighbours only."""


class Requested(StrEnum):
    """The backend a layer is asked for."""

    AUTO = "auto"
    """torch's fused symmetric-memory ops where they run, else our P2P schedules."""
    P2P = "p2p"
    """Our P2P schedules."""
    SYMM_MEM = "symm_mem"
    """torch's fused symmetric-memory ops, refused where they cannot run."""


class LayerName(StrEnum):
    """The TP linears of a transformer layer."""

    QKV = "qkv"
    """The attention's query-key-value projection (column parallel)."""
    PROJ = "proj"
    """The attention's output projection (row parallel)."""
    FC1 = "fc1"
    """The MLP's first linear (column parallel)."""
    FC2 = "fc2"
    """The MLP's second linear (row parallel)."""


class FlashOverlapConfig(Section):
    enabled: bool = False
    """Replace megatron-core's TP linears by the overlapped ones through the GPT layer spec (needs sequence parallelism)."""
    layers: list[LayerName] = Field(default_factory=lambda: list[LayerName](LayerName))
    """Which linears of each transformer layer are replaced."""
    mode: Mode = Mode.DIRECT
    """P2P pattern: direct (each step a different peer) or ring (neighbours only)."""
    backend: Requested = Requested.P2P
    """p2p: our P2P schedules (megatron-core's activation memory); auto: torch's symmetric-memory fused ops where they run (NCCL on CUDA or ROCm gfx942/950, TP group in one node, peer access), else p2p; symm_mem forces them. The fused ops keep qkv's and fc1's gathered inputs for backward: TP times p2p's memory for those."""
    timeout_s: float = Field(default=300.0, gt=0)
    """Seconds a gloo wait for a peer's transfer may take before raising; on NCCL the process group's own timeout applies."""
    compute_slices: int = Field(default=0, ge=0)
    """GEMMs each overlapped all-gather or reduce-scatter is computed in (p2p backend): 0, one per TP rank's slice (the finest overlap); 2 and up merge the slices of consecutive steps into fewer, larger GEMMs, for slices too small for the device to run efficiently (docs/flash_overlap.md)."""

    @field_validator("compute_slices")
    @classmethod
    def _overlaps_something(cls, value: int) -> int:
        if value == 1:
            raise ValueError(
                "one GEMM leaves nothing to overlap: use 0 (one per TP rank's slice) or 2 and up"
            )
        return value

    def check_megatron_args(self, args: argparse.Namespace) -> None:
        """Refuses, at start-up, what megatron-core's layers built through the layer spec cannot
        overlap (the layers refuse it too; here the message names Megatron's flag).

        Args:
            args: Megatron's parsed arguments.

        Raises:
            ConfigError: naming the flag to change.
        """
        if not self.enabled:
            return
        if getattr(args, "tensor_model_parallel_size", 1) > 1 and not getattr(
            args, "sequence_parallel", False
        ):
            raise ConfigError(
                "flash_overlap overlaps the sequence-parallel collectives: pass --sequence-parallel"
            )

    def check_legacy_model_args(self, args: argparse.Namespace) -> None:
        """Refuses, at start-up, what Megatron-DeepSpeed's legacy model cannot overlap: its Ulysses
        attention at TP=1, its TP/SP linears at TP > 1.

        Args:
            args: Megatron-DeepSpeed's parsed arguments.

        Raises:
            ConfigError: listing every setting to change.
        """
        if not self.enabled:
            return
        tp = getattr(args, "tensor_model_parallel_size", 1)
        ulysses = getattr(args, "ds_sequence_parallel_size", 1) > 1
        refused = []
        if ulysses and tp > 1:
            refused.append(
                f"its Ulysses attention runs at TP=1 (this job: TP={tp} with --ds-sequence-parallel-size > 1): "
                "use --tensor-model-parallel-size 1"
            )
        if not ulysses and tp == 1:
            refused.append(
                "at TP=1 without Ulysses there is nothing to overlap: pass --ds-sequence-parallel-size > 1, "
                "or --tensor-model-parallel-size > 1 with --sequence-parallel"
            )
        if tp > 1 and not getattr(args, "sequence_parallel", False):
            refused.append(
                f"its TP linears overlap the sequence-parallel all-gather/reduce-scatter: pass --sequence-parallel (TP={tp})"
            )
        if tp > 1 and getattr(args, "enable_zbh1_pipeline", False):
            refused.append(
                "the zero-bubble pipeline defers the linears' weight gradients: drop --enable-zbh1-pipeline"
            )
        if tp > 1 and (getattr(args, "fp8_e4m3", False) or getattr(args, "fp8_hybrid", False)):
            refused.append(
                "fp8 GEMMs are TransformerEngine's, not these linears': drop --fp8-e4m3/--fp8-hybrid"
            )
        if tp > 1 and self.backend == Requested.SYMM_MEM:
            refused.append('backend "symm_mem" runs in megatron-core\'s linears only: use "p2p" or "auto"')
        if refused:
            raise ConfigError(
                "flash_overlap on Megatron-DeepSpeed: " + "; ".join(refused) + " (or drop --flash-overlap)"
            )
