"""Read-ahead of the node's producer: the byte ranges it advises are exactly the tokens a sample
reads (plain and blended datasets), and each one reaches posix_fadvise."""

import dataclasses
import os

import numpy as np
import pytest
import torch

from megatron_ext.data.shm import readahead
from megatron_ext.data.shm.readahead import ReadAhead, sample_ranges
from megatron_ext.trainer.corpus import (
    build_train_dataset,
    gpt_dataset_config,
    synthetic_documents,
    write_indexed_dataset,
)
from tests.helpers.megatron_samplers import megatron_order


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("readahead")
    prefixes = [str(root / "a"), str(root / "b")]
    write_indexed_dataset(prefixes[0], synthetic_documents(40))
    write_indexed_dataset(prefixes[1], synthetic_documents(25, seed=7))
    return prefixes, str(root / "cache")


def _text_from_ranges(ranges, dtype):
    parts = [
        np.fromfile(path, dtype=dtype, count=length // np.dtype(dtype).itemsize, offset=offset)
        for path, offset, length in ranges
    ]
    return np.concatenate(parts)


def _check_every_sample(dataset, dtype):
    dataset[0]  # with defer_npy_index_mmap GPTDataset maps its indices at its first read
    for idx in range(len(dataset)):
        ranges = sample_ranges(dataset, idx)
        assert ranges, f"no ranges for sample {idx}"
        text = _text_from_ranges(ranges, dtype)
        sample = dataset[idx]
        full = torch.cat([sample["tokens"], sample["labels"][-1:]]).numpy()  # seq_length + 1 tokens
        assert np.array_equal(text, full[: len(text)]), f"sample {idx}"
        assert len(text) == len(full) or (full[len(text) :] == full[-1]).all()  # only padding is not read


def test_ranges_are_the_tokens_each_sample_reads(corpora):
    (prefix, _), cache = corpora
    dataset = build_train_dataset(prefix, 32, 10, 1234, cache)
    _check_every_sample(dataset, dataset.dataset.index.dtype)


def _blended_ranges(prefixes, cache):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    config = dataclasses.replace(
        gpt_dataset_config(prefixes[0], 32, 1234, cache), blend=(prefixes, [0.6, 0.4])
    )
    blended = BlendedMegatronDatasetBuilder(GPTDataset, [200, 0, 0], lambda: True, config).build()[0]
    for inner in blended.datasets:
        inner[0]  # map each inner dataset's indices
    _check_every_sample(blended, blended.datasets[0].dataset.index.dtype)
    return sorted({int(i) for i in blended.dataset_index}), len(blended)


def test_ranges_of_a_blended_dataset(run_ranks, corpora):
    # megatron-core builds a blend's indices on rank 0 of a process group: one gloo rank here
    ((sources, samples),) = run_ranks(1, _blended_ranges, *corpora, timeout=120)
    assert sources == [0, 1] and samples >= 200


def test_advice_reaches_the_kernel_for_every_range(corpora, monkeypatch):
    (prefix, _), cache = corpora
    dataset = build_train_dataset(prefix, 32, 10, 1234, cache)
    dataset[0]
    calls = []
    monkeypatch.setattr(
        readahead.os,
        "posix_fadvise",
        lambda fd, off, n, advice: calls.append((os.readlink(f"/proc/self/fd/{fd}"), off, n, advice)),
    )
    ahead = ReadAhead(dataset)
    ahead.advise([3, 5, 8])
    expected = [
        (os.path.realpath(p), off, n, os.POSIX_FADV_WILLNEED)
        for i in (3, 5, 8)
        for p, off, n in sample_ranges(dataset, i)
    ]
    assert calls == expected and ahead.advised_bytes == sum(c[2] for c in calls) > 0
    ahead.close()


def test_the_producer_advises_the_samples_of_the_steps_ahead(corpora, tmp_path, monkeypatch, shm_path):
    from megatron_ext.data.batch import ALL_KEYS
    from megatron_ext.data.config import ShmDataLoaderConfig
    from megatron_ext.data.samplers import SamplerSettings
    from megatron_ext.data.shm.node_loader import ShmBatchIterator

    (prefix, _), cache = corpora
    dataset = build_train_dataset(prefix, 32, 10, 1234, cache)
    log = tmp_path / "advised"

    def record(fd, offset, length, advice):  # runs in the forked producer: a file carries it back
        with open(log, "a") as f:
            f.write(f"{offset} {length}\n")

    monkeypatch.setattr(readahead.os, "posix_fadvise", record)
    it = ShmBatchIterator(
        dataset,
        SamplerSettings(2, 0, 1, kind="random"),
        keys=ALL_KEYS,
        path=shm_path,
        config=ShmDataLoaderConfig(enabled=True, slots=2, timeout_s=30),
        local_index=0,
        node_dp_ranks=[0],
        rank=0,
    )
    for _ in range(6):
        next(it)
    it.close()
    advised = {tuple(map(int, line.split())) for line in log.read_text().splitlines()}
    order = megatron_order("random", len(dataset), 0, 2, 0, 1)  # Megatron's, not the plugin's sampler
    steps = [next(order) for _ in range(6)]
    for idx in (i for batch in steps for i in batch):  # the indices are mapped when the dataset is built
        assert {(off, n) for _, off, n in sample_ranges(dataset, idx)} <= advised, f"sample {idx} not advised"
