"""The data-loader benchmarks' synthetic corpus and where their files go: the repository root, the
folder of raw outputs (corpus, dataset cache, rank logs), the folder of results, the environment
that quiets the ranks, writing the corpus and dropping it from the page cache."""

from __future__ import annotations

import os

import numpy as np

ROOT: str = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The repository root."""
RAW: str = os.path.join(ROOT, "benchmarks", "results", "raw", "data_loader")
"""Corpus, dataset cache and rank logs: written by the runs, not kept in git."""
OUT: str = os.path.join(ROOT, "benchmarks", "results", "data_loader")
"""Default folder of the results (JSON and markdown)."""
QUIET: dict[str, str] = {"PYTHONWARNINGS": "ignore"}
"""Environment of the rank processes: megatron-core's import warnings, printed once per rank, would
bury the progress lines."""

EOD = 256
"""End-of-document token: the ByteTokenizer's id after the 256 byte values."""


def make_corpus(prefix: str, tokens: int, seed: int = 0) -> None:
    """Write ``prefix.bin`` / ``prefix.idx`` (megatron-core's indexed dataset, uint16): random byte
    tokens (the ByteTokenizer's vocabulary) in documents of 500-4000 tokens, each ended by ``EOD``,
    at least ``tokens`` in all. Does nothing if ``prefix.idx`` exists. Syncs the file system at the
    end: dirty pages cannot be dropped from the page cache."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if os.path.exists(prefix + ".idx"):
        return
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    written = 0
    while written < tokens:
        doc = rng.integers(0, 256, size=int(rng.integers(500, 4000)), dtype=np.uint16)
        doc[-1] = EOD
        builder.add_document(doc, [doc.size])
        written += doc.size
    builder.finalize(prefix + ".idx")
    os.sync()


def drop_cache(prefix: str) -> None:
    """Drop the corpus ``prefix.bin`` / ``prefix.idx`` from the page cache
    (``posix_fadvise(POSIX_FADV_DONTNEED)``), so that the next reads go to the device."""
    for path in (prefix + ".bin", prefix + ".idx"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
