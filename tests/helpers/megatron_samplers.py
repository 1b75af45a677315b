"""Megatron's two samplers (core_v0.16.1, ``megatron/training/datasets/data_samplers.py``) rewritten
here from their documented rules, so that tests compare the plugins with upstream's order and not
with the project's own sampler module. Each yields one DP rank's micro-batches of sample indices."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def pretraining_sampler(total: int, consumed: int, mbs: int, dp_rank: int, dp: int) -> Iterator[list[int]]:
    """MegatronPretrainingSampler with drop_last: indices from ``consumed`` on gathered into global
    batches of mbs * dp, each rank taking its slice; a single pass."""
    batch = []
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == mbs * dp:
            yield batch[dp_rank * mbs : (dp_rank + 1) * mbs]
            batch = []


def random_sampler(
    total: int, consumed: int, mbs: int, dp_rank: int, dp: int, sharding: bool = True
) -> Iterator[list[int]]:
    """MegatronPretrainingRandomSampler under Megatron's cyclic loader (a new ``__iter__`` per epoch,
    from the samples consumed so far). Each epoch is a ``torch.randperm`` seeded with the epoch
    number, as a Python list; with data sharding each rank shuffles its own contiguous bucket."""
    active = total - total % (mbs * dp)  # the last, partial global batch is never used
    while True:
        epoch, into_epoch = divmod(consumed, active)
        assert into_epoch % (mbs * dp) == 0, "Megatron resumes only at a global-batch boundary"
        g = torch.Generator()
        g.manual_seed(epoch)
        if sharding:
            bucket = (total // (mbs * dp)) * mbs
            order = torch.randperm(bucket, generator=g).tolist()[into_epoch // dp :]
            indices = [dp_rank * bucket + x for x in order]
        else:
            full = (total // mbs) * mbs
            indices = torch.randperm(full, generator=g).tolist()[into_epoch:][dp_rank::dp]
        for start in range(0, len(indices) - mbs + 1, mbs):
            consumed += mbs * dp
            yield indices[start : start + mbs]


def megatron_order(
    sampler: str, total: int, consumed: int, mbs: int, dp_rank: int, dp: int
) -> Iterator[list[int]]:
    """The order of Megatron's ``single`` or ``cyclic`` loader (random sampler, data sharding on)."""
    if sampler == "single":
        return pretraining_sampler(total, consumed, mbs, dp_rank, dp)
    return random_sampler(total, consumed, mbs, dp_rank, dp)
