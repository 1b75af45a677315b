"""What a micro-batch holds, shared by the stock path and the shared-memory loader.

Keys, dtypes and order are those of Megatron-LM's ``get_batch_on_this_tp_rank``: tokens and labels
int64, loss_mask float32, position_ids int64, each ``[micro_batch_size, seq_length]``; the attention
mask, when asked for, is ``[micro_batch_size, 1, s, s]`` bool with True where attention is masked.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np
import torch

# (key, dtype) in the order Megatron broadcasts them; the attention mask goes between loss_mask
# and position_ids in that order and is built, never stored.
STORED_KEYS: tuple[tuple[str, torch.dtype], ...] = (
    ("tokens", torch.int64), ("labels", torch.int64), ("loss_mask", torch.float32), ("position_ids", torch.int64),
)
BROADCAST_ORDER = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


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
    def __next__(self) -> dict[str, torch.Tensor]: ...
    def close(self) -> None: ...


def sequence_length(dataset: Any) -> int:
    """Tokens per sample of a megatron-core ``GPTDataset`` (or anything with its ``config``)."""
    config = getattr(dataset, "config", None)
    if config is None or not hasattr(config, "sequence_length"):
        raise TypeError(f"{type(dataset).__name__} has no config.sequence_length: pass a megatron-core GPTDataset")
    return int(config.sequence_length)


def sample_bytes(dataset: Any) -> int:
    """Bytes of the ``.bin`` file one sample spans: seq_length (+1 extra label token) tokens."""
    extra = int(getattr(dataset.config, "add_extra_token_to_sequence", True))
    index = getattr(getattr(dataset, "dataset", None), "index", None)
    itemsize = np.dtype(index.dtype).itemsize if index is not None else 8  # unknown storage: count int64
    return (sequence_length(dataset) + extra) * itemsize


def build_attention_mask(tokens: torch.Tensor, dataset: Any) -> torch.Tensor:
    """The causal mask GPTDataset would have built for these tokens, batched: True = masked.
    Documents are kept apart as well when the dataset's config sets ``reset_attention_mask``.

    Built where ``tokens`` live, without a host round trip: on a GPU the mask never crosses PCIe
    and the training thread does no per-element work (a [4, 1, 8192, 8192] mask is 268 MB)."""
    mbs, s = tokens.shape
    causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).triu_(1)
    config = dataset.config
    if not getattr(config, "reset_attention_mask", False):
        return causal.expand(mbs, 1, s, s).clone()
    # Upstream masks rows after each EOD at i from columns <= i. Equivalently, a query and a key
    # in different documents are masked, a document being the run of tokens after the previous EOD.
    is_eod = tokens == config.tokenizer.eod
    document = is_eod.cumsum(dim=1) - is_eod.long()  # EODs strictly before each position
    return (causal | (document[:, :, None] != document[:, None, :]))[:, None]
