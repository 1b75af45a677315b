"""The one call a training script makes to get its batches: our node loader or Megatron's path.

``build_batch_iterator`` is collective (every rank of the job calls it with the same settings). It
returns an iterator of this rank's micro-batches, each a dict of tensors keyed tokens, labels,
loss_mask, (attention_mask,) position_ids, identical on both paths; ``.counters`` holds what a
training loop logs and ``.close()`` releases it. A resume passes the checkpoint's consumed_samples.
With pipeline parallelism each stage gets Megatron's keys for it (``batch.StageKeys``); only first-
and last-stage ranks use the node's ring, middle stages only follow the sampler.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.data.batch import BatchIterator, StageKeys
from megatron_ext.data.config import ShmDataLoaderConfig
from megatron_ext.data.ring import check_platform
from megatron_ext.data.samplers import SamplerKind, SamplerSettings
from megatron_ext.data.shm_loader import ShmBatchIterator
from megatron_ext.data.shm_segment import new_token, process_start_time, resolve_job_id, segment_path
from megatron_ext.data.stock import StockBatchIterator
from plugin_base.section import ConfigError
from plugin_base.topology import Topology


def indexed_prefixes(dataset: Any) -> list[str]:
    """The ``.bin``/``.idx`` prefixes under a megatron-core GPTDataset or BlendedDataset."""
    if hasattr(dataset, "datasets"):  # BlendedDataset
        return [p for d in dataset.datasets for p in indexed_prefixes(d)]
    prefix = getattr(getattr(dataset, "dataset", None), "path_prefix", None)
    return [prefix] if prefix else []


def check_slots(config: ShmDataLoaderConfig, pipeline_stages: int) -> None:
    """Refuse a ring shallower than the pipeline: in 1F1B's warm-up the first stage reads
    ``pipeline_stages - 1`` micro-batches before the last stage reads its first, and a slot is
    refilled only once both stages released it; with fewer slots the first stage waits for the last
    every step and the warm-up runs serialised."""
    if config.enabled and config.slots < pipeline_stages:
        raise ConfigError(
            f"shm_data_loader.slots={config.slots} is below the pipeline's {pipeline_stages} stages "
            f"(--pipeline-model-parallel-size {pipeline_stages}): the first stage reads {pipeline_stages - 1} "
            "micro-batches ahead of the last, and each slot holds one until both have read it; set "
            f"shm_data_loader.slots to at least {pipeline_stages} (--shm-data-loader-slots)"
        )


def build_batch_iterator(
    dataset: Any,
    *,
    micro_batch_size: int,
    consumed_samples: int,
    config: ShmDataLoaderConfig,
    topology: Topology | None,
    tp_group: dist.ProcessGroup | None,
    dp_rank: int,
    dp_size: int,
    sampler: SamplerKind = "single",
    seed: int = 0,
    data_sharding: bool = True,
    create_attention_mask: bool = False,
    job_id: str | None = None,
    name: str = "train",
    device: torch.device | str | None = None,
    num_workers: int = 0,
    first_pipeline_stage: bool = True,
    last_pipeline_stage: bool = True,
    pipeline_stages: int = 1,
) -> BatchIterator:
    """This rank's micro-batches in Megatron's sampler order from ``consumed_samples`` on.

    ``dataset``: the megatron-core ``GPTDataset`` (built on every rank: each needs its length and
    config; only one process per node reads from it when ``config.enabled``). ``sampler``: Megatron's
    ``single`` or its ``cyclic`` loader (``random``; ``seed=0`` and ``data_sharding=True`` are
    Megatron's own settings). ``topology`` (the job's, detected once by the caller; None only with
    the loader off) places ranks on nodes; ``tp_group`` is the group that shares a batch on the
    stock path; ``job_id`` (None: Slurm's, or a hash of the rendezvous variables) and ``name`` (one
    per loader of the job, e.g. train, valid) label the shared-memory segment, whose name also
    carries a random token no other user can guess.
    ``device``: where the tensors go (a CUDA device on GPU jobs).
    ``num_workers``: DataLoader worker processes of the stock path (Megatron's ``--num-workers``);
    the node loader reads in its producer process instead.
    ``first_pipeline_stage``/``last_pipeline_stage``: megatron-core's ``is_pipeline_first_stage()`` /
    ``is_pipeline_last_stage()`` (both true without pipeline parallelism). With PP > 1 the dict holds
    every key, None for those the rank does not get (TP rank 0 gets every key, as upstream's
    ``get_batch_on_this_tp_rank`` leaves it); a middle stage gets None for all. ``pipeline_stages``:
    Megatron's pipeline-parallel size; the ring needs at least that many slots.
    """
    for prefix in indexed_prefixes(dataset):
        # Imported here: where Megatron-DeepSpeed's own megatron package comes first on the path,
        # megatron-core's datasets are absent (and its datasets carry no prefix, so this never runs).
        from megatron_ext.data.gpt_dataset import check_indexed_dataset

        check_indexed_dataset(prefix)  # every rank: a corrupt file fails everywhere at once, by name
    tp_source = tp_group is None or dist.get_rank(group=tp_group) == 0
    keys = StageKeys.of(first_pipeline_stage, last_pipeline_stage, create_attention_mask, tp_source)
    settings = SamplerSettings(micro_batch_size, consumed_samples, dp_size, sampler, data_sharding, seed)
    if not config.enabled:
        return StockBatchIterator(
            dataset,
            settings,
            tp_group=tp_group,
            dp_rank=dp_rank,
            keys=keys,
            device=device,
            num_workers=num_workers,
        )
    if topology is None:
        raise ValueError(
            "the node loader needs the job's topology: pass "
            "topology=detect_topology(plugin_config.topology, world_size=...) to build_batch_iterator"
        )
    check_platform()  # every rank, before the collective: none is left waiting in it
    check_slots(config, pipeline_stages)
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list[Any] = [None] * world
    # The one collective: which DP ranks the node holds, whatever the rank order (tp-cp-ep-dp-pp or
    # other), and a random token per rank: that of the node's first rank names the node's segment, so
    # the name appears nowhere another user can read before that rank creates it; with it goes that
    # rank's label, so the name depends on nothing a rank computes for itself. Each rank also
    # says whether its stage reads batches, and who it is, so that peers can tell its death.
    pid = os.getpid()
    dist.all_gather_object(
        gathered,
        (dp_rank, new_token(), bool(keys.returned), pid, process_start_time(pid), resolve_job_id(job_id)),
    )
    if not keys.returned:  # a middle pipeline stage: no ring, nothing to wait for
        return StockBatchIterator(dataset, settings, tp_group=None, dp_rank=dp_rank, keys=keys, device=device)
    node = topology.node(rank)
    local = [r for r in range(world) if topology.node(r) == node and gathered[r][2]]
    first = gathered[local[0]]
    path = segment_path(config.shm_dir, f"{first[5]}-{name}", node, token=first[1])
    if not os.path.isdir(config.shm_dir):
        raise FileNotFoundError(
            f"shm_data_loader.shm_dir={config.shm_dir!r} is not a directory: point it at a tmpfs"
        )
    return ShmBatchIterator(
        dataset,
        settings,
        config=config,
        path=path,
        local_index=local.index(rank),
        node_dp_ranks=[gathered[r][0] for r in local],
        rank=rank,
        keys=keys,
        device=device,
        creator=(first[3], first[4]),
    )
