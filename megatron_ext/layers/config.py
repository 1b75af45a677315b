"""The ``flash_overlap`` section of the DeepSpeed JSON."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from mdsp_base.section import Section


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
