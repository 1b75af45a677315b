"""The ``shm_data_loader`` section of the DeepSpeed JSON."""

from __future__ import annotations

from pydantic import Field

from megatron_ext.data.ring import MAX_WORKERS
from plugin_base.section import Section


class ShmDataLoaderConfig(Section):
    enabled: bool = False
    """Feed batches through one producer per node and a ring in shared memory."""
    slots: int = Field(default=4, ge=1, le=1024)
    """Ring slots, each holding one step's micro-batches for the node: the prefetch depth."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Seconds a rank waits for its next batch before raising; the producer waits for live ranks
    as long as they live and raises as soon as one dies."""
    workers: int = Field(default=1, ge=1, le=MAX_WORKERS)
    """Processes that read and assemble the node's steps (each a step at a time, in turn); the
    ranks receive them in order whatever the number. Raise it where one process cannot keep up."""
    shm_dir: str = "/dev/shm"
    """Directory of the shared-memory segments (a tmpfs)."""
    pinned_ring: bool = False
    """CUDA: copy each step's ids straight from the ring, registered as pinned memory, instead of through a pinned staging buffer (not yet run on a GPU)."""
