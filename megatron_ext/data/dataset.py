"""What the loaders read of a dataset: megatron-core's ``GPTDataset`` or a ``BlendedDataset`` of them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np


class DatasetConfig(Protocol):
    """The fields of megatron-core's ``GPTDatasetConfig`` every dataset has (the optional ones are
    read where present)."""

    @property
    def sequence_length(self) -> int: ...
    @property
    def add_extra_token_to_sequence(self) -> bool: ...


class SampleDataset(Protocol):
    """A ``GPTDataset`` or ``BlendedDataset``: its length, its samples and its config. Its index
    arrays and the datasets it blends are read where present."""

    @property
    def config(self) -> DatasetConfig: ...
    def __len__(self) -> int: ...
    def __getitem__(self, idx: int, /) -> Mapping[str, object]: ...


SampleQuery = Callable[[int], tuple[np.ndarray, np.ndarray]]
"""``GPTDataset._query_document_sample_shuffle_indices``: a sample's token ids and its documents."""
