"""Megatron-LM's sampler order (tag core_v0.16.1), checked on hand-worked cases and on the properties
a resume relies on: a resumed stream is the tail of the uninterrupted one."""

import itertools

import pytest
import torch
from torch.utils.data import DataLoader

from megatron_ext.data.samplers import (
    BatchSampler,
    EpochPermutations,
    SamplerSettings,
    random_batches,
    single_pass_batches,
)
from tests.helpers.megatron_samplers import random_sampler


def test_single_pass_gives_each_rank_its_slice_of_each_full_global_batch():
    # 10 samples, mbs 2, dp 2: steps of 4 samples; the incomplete chunk [8, 9] is dropped
    assert list(single_pass_batches(10, 0, 2, 0, 2)) == [[0, 1], [4, 5]]
    assert list(single_pass_batches(10, 0, 2, 1, 2)) == [[2, 3], [6, 7]]
    assert list(single_pass_batches(10, 4, 2, 1, 2)) == [[6, 7]]
    # without drop_last the partial chunk is sliced like a full one
    assert list(single_pass_batches(10, 4, 2, 0, 2, drop_last=False)) == [[4, 5], [8, 9]]
    assert list(single_pass_batches(10, 4, 2, 1, 2, drop_last=False)) == [[6, 7], []]


def test_single_pass_resume_is_the_tail():
    fresh = list(single_pass_batches(103, 0, 3, 2, 4))
    assert list(single_pass_batches(103, 5 * 12, 3, 2, 4)) == fresh[5:]


def test_single_pass_rejects_a_used_up_dataset():
    with pytest.raises(ValueError, match=r"consumed_samples\(10\) must lie in \[0, 10\)"):
        next(single_pass_batches(10, 10, 2, 0, 2))


def _epoch_of(total, mbs, dp, sharding, seed=0):
    steps = total // (mbs * dp)
    return [
        list(itertools.islice(random_batches(total, 0, mbs, r, dp, sharding, seed), steps)) for r in range(dp)
    ]


def test_random_sharded_buckets_follow_the_epoch_seeded_permutation():
    total, mbs, dp = 50, 2, 3  # 8 steps of 6 samples per epoch, 2 samples left over
    bucket = (total // (mbs * dp)) * mbs
    for epoch in (0, 1):
        perm = torch.randperm(bucket, generator=torch.Generator().manual_seed(epoch)).tolist()
        for r in range(dp):
            got = list(itertools.islice(random_batches(total, epoch * 48, mbs, r, dp), 8))
            assert got == [[r * bucket + i for i in perm[k : k + mbs]] for k in range(0, bucket, mbs)]


@pytest.mark.parametrize("sharding", [True, False])
def test_random_epoch_is_a_disjoint_cover(sharding):
    epoch = _epoch_of(50, 2, 3, sharding)
    seen = [i for rank in epoch for batch in rank for i in batch]
    assert len(seen) == len(set(seen)) == 48 and max(seen) < 50


@pytest.mark.parametrize("sharding", [True, False])
def test_random_resume_mid_epoch_and_across_epochs(sharding):
    for r in range(3):
        fresh = list(itertools.islice(random_batches(50, 0, 2, r, 3, sharding), 30))
        for done in (3, 8, 11):  # mid first epoch, at the boundary, mid second epoch
            resumed = list(itertools.islice(random_batches(50, done * 6, 2, r, 3, sharding), 30 - done))
            assert resumed == fresh[done:]
    assert fresh[:8] != fresh[8:16]  # a new permutation per epoch


def test_random_seed_shifts_the_epoch_seed():
    assert _epoch_of(50, 2, 3, True, seed=1)[0][:8] == list(
        itertools.islice(random_batches(50, 48, 2, 0, 3), 8)
    )


def test_random_rejects_a_resume_inside_a_step():
    with pytest.raises(ValueError, match="not a whole number of steps of 6"):
        next(random_batches(50, 7, 2, 0, 3))


def test_batch_sampler_drives_a_dataloader_and_restarts():
    sampler = BatchSampler(SamplerSettings(2, 0, 2, "single"), 12, 1)
    loader = DataLoader(list(range(100, 112)), batch_sampler=sampler)
    expected = [[102, 103], [106, 107], [110, 111]]
    assert [b.tolist() for b in loader] == expected
    assert [b.tolist() for b in loader] == expected
    with pytest.raises(ValueError, match="expected 'single'"):
        SamplerSettings(2, 0, 1, "cyclic")


@pytest.mark.parametrize("sharding", [True, False])
def test_lazy_shuffle_is_megatrons_list_order(sharding):
    total, mbs, dp = 200_003, 4, 3  # large enough that a wrong slice or dtype would show
    steps = total // (mbs * dp)
    shared = EpochPermutations()
    streams = [random_batches(total, 0, mbs, r, dp, sharding, permutations=shared) for r in range(dp)]
    for epoch in (0, 1):
        got = [[next(s) for _ in range(steps)] for s in streams]
        for r in range(dp):
            upstream = random_sampler(total, epoch * steps * mbs * dp, mbs, r, dp, sharding)
            assert got[r] == list(itertools.islice(upstream, steps))
            assert all(type(i) is int for b in got[r][:3] for i in b)


def test_streams_share_one_int32_permutation_per_epoch():
    shared = EpochPermutations()
    streams = [random_batches(1000, 0, 2, r, 4, permutations=shared) for r in range(4)]
    for s in streams:
        next(s)
    perms = list(shared._cache.values())
    assert len(perms) == 1 and perms[0].dtype == torch.int32 and perms[0].numel() == 250
    for s in streams:
        for _ in range(250):  # 125 steps per epoch: through epoch 1 into epoch 2; epoch 0's is dropped
            next(s)
    assert list(shared._cache) == [(1, 250), (2, 250)]
    with pytest.raises(ValueError, match="keep"):
        EpochPermutations(keep=0)


def test_batch_sampler_shuffles_each_epoch_once_for_all_its_passes(monkeypatch):
    calls = []
    real = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    sampler = BatchSampler(SamplerSettings(2, 0, 3, "random"), 50, 1)  # validates by drawing a first batch
    passes = [iter(sampler), iter(sampler)]  # e.g. the stock path's step counter and its DataLoader
    assert [next(p) for p in passes] == [next(iter(sampler))] * 2
    assert calls == [16]  # one epoch-0 permutation of the 16-sample bucket
