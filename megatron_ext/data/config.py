"""The ``shm_data_loader`` section of the DeepSpeed JSON."""

from __future__ import annotations

import os

from pydantic import Field

from mdsp_base.section import ConfigError, Section
from megatron_ext.data.shm.ring import MAX_WORKERS


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


def check_shm_dir_at_start(config: ShmDataLoaderConfig) -> list[str]:
    """What needs no model about ``shm_dir``, checked when the job starts (before any model,
    engine or collective): it exists, is a directory no other user can slip files into (raises
    :class:`~mdsp_base.section.ConfigError` naming the key); returns a warning when it is not a
    tmpfs (the ring then lives on a disk's page cache, and a full disk fails late)."""
    from megatron_ext.data.shm.private import ShmSecurityError, check_shm_dir

    if not config.enabled:
        return []
    try:
        check_shm_dir(config.shm_dir)
    except (FileNotFoundError, ShmSecurityError) as exc:
        raise ConfigError(str(exc)) from None
    kind = _filesystem(config.shm_dir)
    if kind is not None and kind != "tmpfs":
        return [
            f"shm_data_loader.shm_dir={config.shm_dir!r} is on {kind}, not a tmpfs: the ring lives in the page "
            "cache of a disk; point it at /dev/shm or another tmpfs"
        ]
    return []


def _filesystem(path: str) -> str | None:
    """The type of the file system holding ``path`` (the longest mount point above it), None where
    /proc/mounts cannot be read."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best = max(
        (m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
        key=lambda m: len(m[0]),
        default=None,
    )
    return None if best is None else best[1]


def check_shm_space_at_start(
    config: ShmDataLoaderConfig,
    ranks_per_node: int,
    tp: int,
    micro_batch: int,
    seq_length: int,
    vocab_size: int,
) -> None:
    """The node's ring (``slots`` steps of every DP rank of the node's micro-batch) against the free
    space of ``shm_dir``, when the job starts: a ring that cannot fit fails here, before any model,
    with the numbers and what to change, not when the first rank creates it."""
    from megatron_ext.data.shm.ring import RingLayout
    from megatron_ext.data.shm.segment import free_bytes, space_message

    if not config.enabled:
        return
    token_bytes = 2 if vocab_size <= 2**16 - 1 else 4  # as the ring stores ids: uint16 where they fit
    layout = RingLayout(
        config.slots, max(1, ranks_per_node // tp), micro_batch, seq_length, ranks_per_node, token_bytes
    )
    available = free_bytes(config.shm_dir)
    if layout.size > available:
        raise ConfigError(space_message(config.shm_dir, layout.size, available))
