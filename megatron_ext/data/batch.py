"""What a micro-batch holds, shared by the stock path and the shared-memory loader.

Keys, dtypes and order are those of Megatron-LM's ``get_batch_on_this_tp_rank``: tokens and labels
int64, loss_mask float32, position_ids int64, each ``[micro_batch_size, seq_length]``; the attention
mask, when asked for, ``[micro_batch_size, 1, s, s]`` bool, True where masked. With pipeline
parallelism (:class:`StageKeys`) a stage's TP group gets the keys Megatron broadcasts to it and the
dict holds every key, None where the rank gets nothing, as Megatron's does.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from megatron_ext.data.dataset import SampleDataset

# (key, dtype) in the order Megatron broadcasts them; the attention mask goes between loss_mask
# and position_ids in that order and is built, never stored.
STORED_KEYS: tuple[tuple[str, torch.dtype], ...] = (
    ("tokens", torch.int64),
    ("labels", torch.int64),
    ("loss_mask", torch.float32),
    ("position_ids", torch.int64),
)
BROADCAST_ORDER = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
# get_batch_on_this_tp_rank's broadcasts per pipeline stage when PP > 1, in its order.
FIRST_STAGE_KEYS = ("tokens", "attention_mask", "position_ids")
LAST_STAGE_KEYS = ("labels", "loss_mask", "attention_mask")


@dataclasses.dataclass(frozen=True)
class StageKeys:
    """Which keys a rank's pipeline stage shares over its TP group, and which its dict holds."""

    stage: tuple[str, ...]
    """The keys the stage's TP group shares, in Megatron's broadcast order."""
    returned: tuple[str, ...]
    """The keys this rank's dict holds tensors for: the stage's, or every key on TP rank 0."""
    mask: bool
    """The attention mask is among them (built from the tokens, which are then read even where not returned)."""
    pipelined: bool
    """PP > 1: the dict carries every key, None for those this rank does not get."""
    listed: tuple[str, ...]
    """The dict's keys when pipelined: all of Megatron's, the attention mask when asked for."""

    @classmethod
    def of(
        cls, first_stage: bool, last_stage: bool, attention_mask: bool, tp_source: bool = True
    ) -> StageKeys:
        """``first_stage``/``last_stage``: megatron-core's ``is_pipeline_first_stage()`` and
        ``is_pipeline_last_stage()`` for this rank (both true without pipeline parallelism);
        ``tp_source``: this rank is its TP group's rank 0, which reads the whole batch (upstream's
        ``get_batch_on_this_tp_rank`` leaves it every key) and broadcasts the stage's keys."""
        if first_stage and last_stage:
            keys: tuple[str, ...] = BROADCAST_ORDER
        else:
            keys = (FIRST_STAGE_KEYS if first_stage else ()) + (LAST_STAGE_KEYS if last_stage else ())
        listed = tuple(k for k in BROADCAST_ORDER if attention_mask or k != "attention_mask")
        stage = tuple(k for k in BROADCAST_ORDER if k in keys and k in listed)
        returned = (
            listed if tp_source and stage else stage
        )  # a middle stage reads nothing, TP rank 0 included
        return cls(stage, returned, "attention_mask" in returned, not (first_stage and last_stage), listed)

    def batch(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        """The dict ``get_batch`` sees, in Megatron's key order."""
        if not self.pipelined:
            return {key: tensors[key] for key in BROADCAST_ORDER if key in self.returned}
        return {key: tensors[key] if key in self.returned else None for key in self.listed}


ALL_KEYS = StageKeys.of(True, True, attention_mask=False)  # no pipeline parallelism, no attention mask


@dataclasses.dataclass
class LoaderCounters:
    """Figures a training loop can log; summed over ranks they give the job's totals."""

    batches: int = 0
    """Micro-batches this rank has received."""
    wait_s: float = 0.0
    """Seconds this rank spent blocked in ``next()``."""
    samples_read: int = 0
    """Samples read from the dataset by this rank (stock path) or by this node's producer (its first rank)."""
    bytes_read: int = 0
    """Token bytes those samples span in the ``.bin`` file(s)."""

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class BatchIterator(Protocol):
    """What :func:`megatron_ext.data.loader.build_batch_iterator` returns, on either path."""

    counters: LoaderCounters

    def __iter__(self) -> BatchIterator: ...
    def __next__(self) -> dict[str, torch.Tensor | None]: ...
    def close(self) -> None: ...


def sequence_length(dataset: SampleDataset) -> int:
    """Tokens per sample of a megatron-core ``GPTDataset`` (or anything with its ``config``)."""
    config = getattr(dataset, "config", None)
    if config is None or not hasattr(config, "sequence_length"):
        raise TypeError(
            f"{type(dataset).__name__} has no config.sequence_length: pass a megatron-core GPTDataset"
        )
    return int(config.sequence_length)


def sample_bytes(dataset: SampleDataset) -> int:
    """Bytes of the ``.bin`` file one sample spans: seq_length (+1 extra label token) tokens."""
    extra = int(getattr(dataset.config, "add_extra_token_to_sequence", True))
    index = getattr(getattr(dataset, "dataset", None), "index", None)
    itemsize = np.dtype(index.dtype).itemsize if index is not None else 8  # unknown storage: count int64
    return (sequence_length(dataset) + extra) * itemsize
