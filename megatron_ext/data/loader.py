"""The one call a training script makes to get its batches: our node loader or Megatron's path.

``build_batch_iterator`` is collective (every rank of the job calls it with the same settings). It
returns an iterator of this rank's micro-batches, each a dict of tensors keyed tokens, labels,
loss_mask, (attention_mask,) position_ids, identical on both paths; ``.counters`` holds what a
training loop logs and ``.close()`` releases it. A resume passes the checkpoint's consumed_samples.
With pipeline parallelism each stage gets Megatron's keys for it (``batch.StageKeys``); only first-
and last-stage ranks use the node's ring, middle stages only follow the sampler.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import NamedTuple, cast

import torch
import torch.distributed as dist

from mdsp_base.section import ConfigError
from mdsp_base.topology import Topology
from megatron_ext.data.batch import BatchIterator, StageKeys
from megatron_ext.data.config import MEGATRON_SAMPLERS, ShmDataLoaderConfig
from megatron_ext.data.dataset import SampleDataset
from megatron_ext.data.samplers import SamplerKind, SamplerSettings
from megatron_ext.data.shm.node_loader import ShmBatchIterator
from megatron_ext.data.shm.private import check_shm_dir
from megatron_ext.data.shm.ring import check_platform
from megatron_ext.data.shm.segment import new_token, resolve_job_id, segment_path
from megatron_ext.data.stock import StockBatchIterator

# Megatron's --dataloader-type -> the sampler of megatron_ext.data.samplers


class RankRecord(NamedTuple):
    """What each rank tells the others when the loader is built (one all_gather_object)."""

    dp_rank: int
    """Its data-parallel rank."""
    token: str
    """A random token: the node's first reading rank's names the node's segment."""
    reads_batches: bool
    """Whether its pipeline stage reads batches (first or last stage)."""
    job_id: str
    """Its job label; the node's first reading rank's goes into the segment name."""


def indexed_prefixes(dataset: SampleDataset) -> list[str]:
    """The indexed files a dataset reads.

    Args:
        dataset: a megatron-core GPTDataset or BlendedDataset.

    Returns:
        The ``.bin``/``.idx`` path prefixes under it (none for other storage).
    """
    if hasattr(dataset, "datasets"):  # BlendedDataset
        return [p for d in dataset.datasets for p in indexed_prefixes(d)]
    prefix = getattr(getattr(dataset, "dataset", None), "path_prefix", None)
    return [prefix] if prefix else []


def check_slots(config: ShmDataLoaderConfig, pipeline_stages: int) -> None:
    """Refuses a ring shallower than the pipeline: in 1F1B's warm-up the first stage reads
    ``pipeline_stages - 1`` micro-batches before the last stage reads its first, and a slot is
    refilled only once both stages released it, so fewer slots serialise the warm-up.

    Args:
        config: the ``shm_data_loader`` section (nothing is checked when it is disabled).
        pipeline_stages: Megatron's pipeline-parallel size.

    Raises:
        ConfigError: naming the key and the least number of slots.
    """
    if config.enabled and config.slots < pipeline_stages:
        raise ConfigError(
            f"shm_data_loader.slots={config.slots} is below the pipeline's {pipeline_stages} stages "
            f"(--pipeline-model-parallel-size {pipeline_stages}): the first stage reads {pipeline_stages - 1} "
            "micro-batches ahead of the last, and each slot holds one until both have read it; set "
            f"shm_data_loader.slots to at least {pipeline_stages} (--shm-data-loader-slots)"
        )


@dataclass(frozen=True)
class LoaderSettings:
    """What :func:`build_batch_iterator` needs besides the dataset; every rank of the job gives the
    same, but for its own ranks and groups."""

    micro_batch_size: int
    """Samples per micro-batch of one DP rank."""
    consumed_samples: int
    """Samples the job consumed before this start (all DP ranks together): where the order resumes."""
    config: ShmDataLoaderConfig
    """The ``shm_data_loader`` section: enabled, the node loader; otherwise Megatron's stock path."""
    topology: Topology | None
    """The job's rank placement, detected once by the caller; None only with the loader off."""
    tp_group: dist.ProcessGroup | None
    """The group that shares a batch on the stock path (its rank 0 reads)."""
    dp_rank: int
    """This rank's data-parallel rank."""
    dp_size: int
    """Data-parallel ranks of the job."""
    sampler: SamplerKind = "single"
    """Megatron's ``single`` loader or its ``cyclic`` one (``random``)."""
    seed: int = 0
    """random: added to the epoch as the shuffle's seed (0 is Megatron's)."""
    data_sharding: bool = True
    """random: each DP rank shuffles its own bucket (Megatron's default)."""
    create_attention_mask: bool = False
    """Batches carry the dataset's attention mask (Megatron's --create-attention-mask-in-dataloader)."""
    job_id: str | None = None
    """Labels the shared-memory segment; None: Slurm's job id, or a hash of the rendezvous variables."""
    name: str = "train"
    """One per loader of the job (train, valid, test): labels the segment too."""
    device: torch.device | str | None = None
    """Where the tensors go (a CUDA device on GPU jobs); None: the CPU."""
    num_workers: int = 0
    """DataLoader worker processes of the stock path (the node loader reads in its producer)."""
    first_pipeline_stage: bool = True
    """megatron-core's ``is_pipeline_first_stage()`` for this rank."""
    last_pipeline_stage: bool = True
    """megatron-core's ``is_pipeline_last_stage()`` for this rank."""
    pipeline_stages: int = 1
    """Megatron's pipeline-parallel size: the ring needs at least that many slots."""

    @classmethod
    def from_megatron_args(
        cls,
        args: argparse.Namespace,
        config: ShmDataLoaderConfig,
        topology: Topology | None,
        *,
        consumed_samples: int,
        name: str = "train",
        device: torch.device | str | None = None,
    ) -> LoaderSettings:
        """The settings Megatron's flags give, with this rank's groups from megatron-core's parallel
        state: the one mapping, for the main job and the upstream hooks alike.

        Args:
            args: Megatron's arguments (``--micro-batch-size``, ``--dataloader-type`` single or
                cyclic, ``--no-data-sharding``, ``--create-attention-mask-in-dataloader``,
                ``--num-workers``).
            config: the ``shm_data_loader`` section.
            topology: the job's rank placement; None only with the loader off.
            consumed_samples: where the order resumes.
            name: the loader's name (train, valid, test).
            device: where the tensors go; None: the CPU.

        Returns:
            The settings for :func:`build_batch_iterator`.

        Raises:
            ConfigError: a ``--dataloader-type`` the loader does not take.
        """
        from megatron.core import parallel_state as mpu

        sampler = MEGATRON_SAMPLERS.get(args.dataloader_type)
        if sampler is None:
            raise ConfigError(
                f"--dataloader-type {args.dataloader_type}: the plugin loader takes "
                f"{' or '.join(MEGATRON_SAMPLERS)}"
            )
        return cls(
            micro_batch_size=args.micro_batch_size,
            consumed_samples=consumed_samples,
            config=config,
            topology=topology,
            tp_group=mpu.get_tensor_model_parallel_group(),
            dp_rank=mpu.get_data_parallel_rank(),
            dp_size=mpu.get_data_parallel_world_size(),
            sampler=sampler,
            data_sharding=getattr(args, "data_sharding", True),
            create_attention_mask=getattr(args, "create_attention_mask_in_dataloader", False),
            name=name,
            device=device,
            num_workers=getattr(args, "num_workers", 0),
            first_pipeline_stage=mpu.is_pipeline_first_stage(),
            last_pipeline_stage=mpu.is_pipeline_last_stage(),
            pipeline_stages=mpu.get_pipeline_model_parallel_world_size(),
        )


def build_batch_iterator(dataset: SampleDataset, settings: LoaderSettings) -> BatchIterator:
    """This rank's micro-batches in Megatron's sampler order from ``settings.consumed_samples`` on.
    Collective: every rank of the job calls it with the same settings.

    Args:
        dataset: the megatron-core ``GPTDataset`` or ``BlendedDataset``, built on every rank (each
            needs its length and config; with the loader enabled one process per node reads it).
        settings: the sampler, the loader's section and this rank's groups and pipeline stage.

    Returns:
        The iterator: the node loader's when ``settings.config.enabled``, else Megatron's stock
        path. With PP > 1 each batch holds every key, None for those the rank does not get (TP
        rank 0 gets every key, as upstream's ``get_batch_on_this_tp_rank`` leaves it).
    """
    for prefix in indexed_prefixes(dataset):
        # Imported here: where Megatron-DeepSpeed's own megatron package comes first on the path,
        # megatron-core's datasets are absent (and its datasets carry no prefix, so this never runs).
        from megatron_ext.data.indexed import check_indexed_dataset

        check_indexed_dataset(prefix)  # every rank: a corrupt file fails everywhere at once, by name
    tp_source = settings.tp_group is None or dist.get_rank(group=settings.tp_group) == 0
    keys = StageKeys.of(
        settings.first_pipeline_stage, settings.last_pipeline_stage, settings.create_attention_mask, tp_source
    )
    order = SamplerSettings(
        settings.micro_batch_size,
        settings.consumed_samples,
        settings.dp_size,
        settings.sampler,
        settings.data_sharding,
        settings.seed,
    )
    if not settings.config.enabled:
        return StockBatchIterator(
            dataset,
            order,
            tp_group=settings.tp_group,
            dp_rank=settings.dp_rank,
            keys=keys,
            device=settings.device,
            num_workers=settings.num_workers,
        )
    if settings.topology is None:
        raise ValueError(
            "the node loader needs the job's topology: pass "
            "topology=detect_topology(plugin_config.topology, world_size=...) to build_batch_iterator"
        )
    check_platform()  # every rank, before the collective: none is left waiting in it
    check_slots(settings.config, settings.pipeline_stages)
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list[object] = [None] * world  # each a RankRecord's tuple once gathered
    # The one collective: which DP ranks the node holds, whatever the rank order (tp-cp-ep-dp-pp or
    # other), and a random token per rank: that of the node's first rank names the node's segment, so
    # the name appears nowhere another user can read before that rank creates it; with it goes that
    # rank's label, so the name depends on nothing a rank computes for itself. Each rank also
    # says whether its stage reads batches.
    mine = RankRecord(settings.dp_rank, new_token(), bool(keys.returned), resolve_job_id(settings.job_id))
    dist.all_gather_object(gathered, tuple(mine))  # a plain tuple: the receiver unpickles no class of ours
    records = [RankRecord(*cast(tuple, r)) for r in gathered]
    if not keys.returned:  # a middle pipeline stage: no ring, nothing to wait for
        return StockBatchIterator(
            dataset, order, tp_group=None, dp_rank=settings.dp_rank, keys=keys, device=settings.device
        )
    node = settings.topology.node(rank)
    local = [r for r in range(world) if settings.topology.node(r) == node and records[r].reads_batches]
    first = records[local[0]]
    path = segment_path(settings.config.shm_dir, f"{first.job_id}-{settings.name}", node, token=first.token)
    check_shm_dir(
        settings.config.shm_dir
    )  # every rank: the node's ranks fail together, none waits for another
    return ShmBatchIterator(
        dataset,
        order,
        config=settings.config,
        path=path,
        local_index=local.index(rank),
        node_dp_ranks=[records[r].dp_rank for r in local],
        rank=rank,
        keys=keys,
        device=settings.device,
    )
