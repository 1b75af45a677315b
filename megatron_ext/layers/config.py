"""The ``flash_overlap`` section of the DeepSpeed JSON."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from deepspeed_ext.section import Section

LAYER_NAMES = ("qkv", "proj", "fc1", "fc2")


class FlashOverlapConfig(Section):
    enabled: bool = False
    """Replace megatron-core's TP linears by the overlapped ones through the GPT layer spec (needs sequence parallelism)."""
    layers: list[Literal["qkv", "proj", "fc1", "fc2"]] = Field(default_factory=lambda: list(LAYER_NAMES))
    """Which linears of each transformer layer are replaced."""
    mode: Literal["direct", "ring"] = "direct"
    """P2P pattern: direct (each step a different peer) or ring (neighbours only)."""
    backend: Literal["auto", "p2p", "symm_mem"] = "p2p"
    """p2p: our P2P schedules (megatron-core's activation memory); auto: torch's symmetric-memory fused ops where they run (NCCL on CUDA or ROCm gfx942/950, TP group in one node, peer access), else p2p; symm_mem forces them. The fused ops keep qkv's and fc1's gathered inputs for backward: TP times p2p's memory for those."""
    timeout_s: float = Field(default=300.0, gt=0)
    """Seconds a gloo wait for a peer's transfer may take before raising; on NCCL the process group's own timeout applies."""
