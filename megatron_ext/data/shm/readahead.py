"""Read-ahead for the node's producer: the kernel fetches the next steps' samples while it copies.

A miss on the memory-mapped ``.bin`` is a synchronous page fault taken with the GIL held, and the
kernel's read-around cannot follow a shuffled order, so ``posix_fadvise(WILLNEED)`` on the byte
ranges of the samples a few steps ahead starts those reads in the kernel. The ranges come from the
dataset's own index arrays, as ``GPTDataset`` reads them (megatron-core 0.16). Read-ahead is advice:
a dataset it cannot see into gets none, and reading stays correct.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from megatron_ext.data.dataset import SampleDataset

READ_AHEAD_STEPS = 2  # steps ahead of the one being copied: covers a disk read while the slot fills


# Any: it reads GPTDataset's and BlendedDataset's own index arrays, where present.
def sample_ranges(dataset: Any, idx: int) -> list[tuple[str, int, int]]:
    """(``.bin`` path, byte offset, byte length) of every stretch of tokens sample ``idx`` reads,
    in order; [] when the dataset is not one whose files we can see or its indices are not loaded."""
    if hasattr(dataset, "dataset_index"):  # BlendedDataset
        if dataset.dataset_index is None:
            return []
        inner = dataset.datasets[int(dataset.dataset_index[idx])]
        return sample_ranges(inner, int(dataset.dataset_sample_index[idx]))
    indexed = getattr(dataset, "dataset", None)
    index = getattr(indexed, "index", None)
    prefix = getattr(indexed, "path_prefix", None)
    if getattr(dataset, "shuffle_index", None) is None or index is None or not prefix:
        return []  # mapped at the first read under defer_npy_index_mmap: read-ahead starts after it
    itemsize = np.dtype(index.dtype).itemsize
    extra = int(dataset.config.add_extra_token_to_sequence)
    i = int(dataset.shuffle_index[idx])
    (first, first_offset), (last, last_offset) = dataset.sample_index[i], dataset.sample_index[i + 1]
    ranges = []
    for j in range(int(first), int(last) + 1):
        doc = int(dataset.document_index[j])
        start = int(first_offset) if j == first else 0
        stop = int(last_offset) + extra if j == last else int(index.sequence_lengths[doc])
        ranges.append(
            (prefix + ".bin", int(index.sequence_pointers[doc]) + start * itemsize, (stop - start) * itemsize)
        )
    return ranges


class ReadAhead:
    """Advises the kernel to read samples soon needed; one read-only descriptor per ``.bin`` file."""

    def __init__(self, dataset: SampleDataset) -> None:
        self._dataset = dataset
        self._fds: dict[str, int] = {}
        self.advised_bytes = 0
        self.enabled = hasattr(os, "posix_fadvise")

    def advise(self, indices: Iterable[int]) -> None:
        if not self.enabled:
            return
        try:
            for idx in indices:
                for path, offset, length in sample_ranges(self._dataset, idx):
                    fd = self._fds.get(path)
                    if fd is None:
                        fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
                    self.advised_bytes += length
        except OSError:
            # Advice only: a file system that refuses it reads as before, through the map.
            self.enabled = False

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
