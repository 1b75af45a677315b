"""The ``shm_data_loader`` section of the DeepSpeed JSON."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from pydantic import Field

from mdsp_base.section import ConfigError, Section
from megatron_ext.data.shm.ring import MAX_WORKERS

if TYPE_CHECKING:  # the samplers import torch; the configuration is read without it
    from megatron_ext.data.samplers import SamplerKind

MEGATRON_SAMPLERS: dict[str, SamplerKind] = {"single": "single", "cyclic": "random"}
"""Megatron's ``--dataloader-type`` values the loader takes, and the sampler each one selects."""
# Megatron flags the loader cannot be combined with.
_EXCLUSIVE_FLAGS = (
    "full_validation",
    "sft",
    "hybrid_context_parallel",
    "data_efficiency_curriculum_learning",
)


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

    def check_megatron_args(self, args: argparse.Namespace) -> None:
        """Refuses, at start-up, the Megatron settings the loader cannot feed (either upstream).

        Args:
            args: Megatron's parsed arguments.

        Raises:
            ConfigError: naming the flag to change.
        """
        if not self.enabled:
            return
        if getattr(args, "pipeline_model_parallel_size", 1) > 1:
            if getattr(args, "virtual_pipeline_model_parallel_size", None) is not None:
                raise ConfigError(
                    "shm_data_loader does not feed virtual pipeline stages (one iterator per model "
                    "chunk): drop --num-layers-per-virtual-pipeline-stage or disable shm_data_loader"
                )
            if getattr(args, "mtp_num_layers", None):
                raise ConfigError(
                    "shm_data_loader with pipeline parallelism gives the last stage labels and loss "
                    "mask only, multi-token prediction needs its tokens too: drop --mtp-num-layers "
                    "or disable shm_data_loader"
                )
        for flag in _EXCLUSIVE_FLAGS:
            if getattr(args, flag, False):
                raise ConfigError(
                    f"shm_data_loader cannot be combined with --{flag.replace('_', '-')}: drop one of them"
                )
        if getattr(args, "dataloader_type", "single") not in MEGATRON_SAMPLERS:
            raise ConfigError(
                f"--dataloader-type {args.dataloader_type} with shm_data_loader: the plugin loader "
                "replaces the data loader; choose its order with --dataloader-type single or cyclic"
            )
        if getattr(args, "ds_sequence_parallel_size", 1) > 1:
            raise ConfigError(
                "shm_data_loader does not support --ds-sequence-parallel-size > 1: disable one of them"
            )


def check_shm_dir_at_start(config: ShmDataLoaderConfig) -> list[str]:
    """Checks ``shm_dir`` when the job starts, before any model, engine or collective.

    Args:
        config: the ``shm_data_loader`` section (nothing is checked when it is disabled).

    Returns:
        Warnings: one when ``shm_dir`` is not a tmpfs (the ring then lives in a disk's page cache,
        and a full disk fails late).

    Raises:
        ConfigError: ``shm_dir`` is missing, not a directory, or one another user can slip files into.
    """
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
    """Checks the node's ring against the free space of ``shm_dir`` when the job starts, so that a
    ring that cannot fit fails before any model, not when the first rank creates it.

    Args:
        config: the ``shm_data_loader`` section (nothing is checked when it is disabled).
        ranks_per_node: ranks of one node.
        tp: tensor-parallel size (TP peers share a stream).
        micro_batch: samples per micro-batch of one DP rank.
        seq_length: tokens per sample.
        vocab_size: the tokenizer's vocabulary (ids are stored in 2 bytes where it fits).

    Raises:
        ConfigError: with the sizes and what to change.
    """
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
