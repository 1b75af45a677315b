"""Megatron-LM's own data path: TP rank 0 reads, then broadcasts each key to its TP group.

This is the baseline the shared-memory loader is checked against and the main job's default. It
does what ``build_pretraining_data_loader`` + ``get_batch_on_this_tp_rank`` do (tag core_v0.16.1):
the first rank of each TP group iterates a ``torch.utils.data.DataLoader`` over its DP rank's
sampler, then one ``broadcast`` per key (tokens, labels, loss_mask, attention_mask when asked,
position_ids) feeds the other TP ranks. Unlike Megatron, every TP rank also walks the (cheap) index
stream, so all of them stop together when a single-pass sampler runs out instead of hanging in a
broadcast. With pipeline parallelism (``keys``) a stage's TP group broadcasts only its stage's keys,
as Megatron does, and a middle stage reads nothing: it only walks the index stream.
"""

from __future__ import annotations

import time
from typing import cast

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from megatron_ext.data.batch import (
    STORED_KEYS,
    LoaderCounters,
    StageKeys,
    sample_bytes,
    sequence_length,
)
from megatron_ext.data.dataset import SampleDataset
from megatron_ext.data.samplers import BatchSampler, SamplerSettings


class StockBatchIterator:
    """Micro-batches of this rank, read on TP rank 0 and broadcast over ``tp_group``."""

    def __init__(
        self,
        dataset: SampleDataset,
        settings: SamplerSettings,
        *,
        tp_group: dist.ProcessGroup | None,
        dp_rank: int,
        keys: StageKeys,
        device: torch.device | str | None = None,
        num_workers: int = 0,
    ) -> None:
        self.counters = LoaderCounters()
        self._keys = keys
        self._dataset = dataset
        self._group = tp_group
        self._src = dist.get_global_rank(tp_group, 0) if tp_group is not None else dist.get_rank()
        self._is_src = dist.get_rank() == self._src
        self._shape = (settings.micro_batch_size, sequence_length(dataset))
        self._mask = self._keys.mask
        self._device = torch.device("cpu" if device is None else device)
        self._sample_bytes = sample_bytes(dataset)
        batches = BatchSampler(settings, len(dataset), dp_rank)
        self._steps = iter(batches)
        self._loader = (
            iter(
                DataLoader(
                    cast(Dataset, dataset),  # megatron-core's datasets are torch Datasets
                    batch_sampler=batches,
                    num_workers=num_workers,
                    persistent_workers=num_workers > 0,
                    pin_memory=self._device.type == "cuda",
                )
            )
            if self._is_src and self._keys.stage
            else None  # a middle stage reads nothing
        )

    def __iter__(self) -> StockBatchIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor | None]:
        start = time.perf_counter()
        next(self._steps)  # raises StopIteration on every TP rank at the same step
        if self._loader is not None:
            data = next(self._loader)
            batch = {key: data[key].to(dtype) for key, dtype in STORED_KEYS}
            # Megatron's get_batch: pinned batches, copied with cuda(non_blocking=True).
            batch = {key: t.to(self._device, non_blocking=True) for key, t in batch.items()}
            if self._mask:
                if "attention_mask" not in data:  # Megatron's get_batch would fail with a KeyError
                    raise ValueError(
                        "an attention mask was asked for but the dataset built none: set create_attention_mask=True "
                        "in its GPTDatasetConfig (Megatron builds it from --create-attention-mask-in-dataloader)"
                    )
                batch["attention_mask"] = data["attention_mask"].to(self._device, non_blocking=True)
            self.counters.samples_read += self._shape[0]
            self.counters.bytes_read += self._shape[0] * self._sample_bytes
        else:
            batch = {
                key: torch.empty(self._shape, dtype=dtype, device=self._device)
                for key, dtype in STORED_KEYS
                if key in self._keys.stage
            }
            if self._mask:
                mbs, s = self._shape
                batch["attention_mask"] = torch.empty((mbs, 1, s, s), dtype=torch.bool, device=self._device)
        if self._group is not None:
            for key in self._keys.stage:
                dist.broadcast(batch[key], self._src, group=self._group)
        self.counters.batches += 1
        self.counters.wait_s += time.perf_counter() - start
        return self._keys.batch(batch)

    def close(self) -> None:
        """Drop the DataLoader (and its workers, if any)."""
        self._loader = None
