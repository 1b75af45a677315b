"""The order in which Megatron-LM hands samples to each data-parallel rank, as pure index generators.

These reproduce ``megatron/training/datasets/data_samplers.py`` (tag core_v0.16.1), which is not on
the package index, so that the stock path and the shared-memory producer can both compute exactly
what every DP rank would have read:

* ``single`` (``MegatronPretrainingSampler``): from ``consumed_samples`` on, the sample indices are
  cut into chunks of ``micro_batch_size * dp_size``; DP rank ``r`` takes positions
  ``[r * mbs, (r + 1) * mbs)`` of each chunk. An incomplete last chunk is dropped unless
  ``drop_last`` is false. One pass, then the stream ends.
* ``random`` (``MegatronPretrainingRandomSampler`` under Megatron's ``cyclic`` loader): each epoch
  is a ``torch.randperm`` drawn from a generator seeded with ``seed + epoch`` (Megatron seeds with the
  epoch alone, so ``seed=0`` is Megatron's order). With data sharding (Megatron's default) every DP
  rank permutes its own contiguous bucket; without it, one permutation of the whole set is dealt
  round-robin. A resume at ``consumed_samples`` starts mid-epoch where the interrupted run stopped.
  Epochs follow one another without end, as ``cyclic_iter`` re-enters the sampler.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import torch

SamplerKind = Literal["single", "random"]


def _check(total_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
    if total_samples <= 0:
        raise ValueError(f"the dataset has {total_samples} samples: nothing to iterate over")
    if micro_batch_size <= 0 or dp_size <= 0:
        raise ValueError(f"micro_batch_size({micro_batch_size}) and dp_size({dp_size}) must be positive")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank({dp_rank}) must lie in [0, dp_size({dp_size}))")


def single_pass_batches(
    total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
    drop_last: bool = True,
) -> Iterator[list[int]]:
    """Micro-batches of sample indices of DP rank ``dp_rank`` in ``MegatronPretrainingSampler`` order."""
    _check(total_samples, micro_batch_size, dp_rank, dp_size)
    if not 0 <= consumed_samples < total_samples:
        raise ValueError(
            f"consumed_samples({consumed_samples}) must lie in [0, {total_samples}): the dataset is used up; "
            "build it with more samples (train_iters * global_batch_size) to resume this far"
        )
    chunk = micro_batch_size * dp_size
    first = dp_rank * micro_batch_size
    start = consumed_samples
    while start + chunk <= total_samples:
        yield list(range(start + first, start + first + micro_batch_size))
        start += chunk
    # Megatron slices the incomplete chunk the same way, so a rank past its end gets an empty batch.
    if not drop_last and start < total_samples:
        yield list(range(min(start + first, total_samples), min(start + first + micro_batch_size, total_samples)))


def random_batches(
    total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
    data_sharding: bool = True, seed: int = 0,
) -> Iterator[list[int]]:
    """Micro-batches of DP rank ``dp_rank`` in ``MegatronPretrainingRandomSampler`` order, epoch after epoch."""
    _check(total_samples, micro_batch_size, dp_rank, dp_size)
    chunk = micro_batch_size * dp_size
    active = total_samples - total_samples % chunk  # samples one epoch consumes
    if active == 0:
        raise ValueError(f"the dataset has {total_samples} samples, fewer than one step's {chunk}")
    consumed = consumed_samples
    while True:
        epoch, in_epoch = divmod(consumed, active)
        if in_epoch % chunk:
            raise ValueError(
                f"consumed_samples({consumed_samples}) is not a whole number of steps of {chunk} samples "
                "(micro_batch_size * dp_size): resume from a step boundary"
            )
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        if data_sharding:
            bucket = (total_samples // chunk) * micro_batch_size
            order = torch.randperm(bucket, generator=generator).tolist()[in_epoch // dp_size:]
            mine = [dp_rank * bucket + i for i in order]
        else:
            whole = (total_samples // micro_batch_size) * micro_batch_size
            mine = torch.randperm(whole, generator=generator).tolist()[in_epoch:][dp_rank::dp_size]
        for i in range(0, len(mine) - micro_batch_size + 1, micro_batch_size):
            # Megatron advances its sample counter by a whole step per micro-batch, on every rank.
            consumed += chunk
            yield mine[i:i + micro_batch_size]


def sampler_batches(
    kind: SamplerKind, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int,
    dp_size: int, *, data_sharding: bool = True, seed: int = 0,
) -> Iterator[list[int]]:
    """The index stream of one DP rank for Megatron's ``single`` or ``cyclic`` (here: ``random``) loader."""
    if kind == "single":
        return single_pass_batches(total_samples, consumed_samples, micro_batch_size, dp_rank, dp_size)
    if kind == "random":
        return random_batches(total_samples, consumed_samples, micro_batch_size, dp_rank, dp_size,
                              data_sharding=data_sharding, seed=seed)
    raise ValueError(f"sampler={kind!r}: expected 'single' (Megatron's default) or 'random' (its cyclic loader)")


class BatchSampler:
    """A re-iterable batch sampler over one DP rank's stream, for ``torch.utils.data.DataLoader``."""

    def __init__(self, kind: SamplerKind, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, *, data_sharding: bool = True, seed: int = 0) -> None:
        self._args = (kind, total_samples, consumed_samples, micro_batch_size, dp_rank, dp_size)
        self._kwargs = {"data_sharding": data_sharding, "seed": seed}
        # Validate now, not at the first next(): a wrong resume point should fail at start-up.
        next(iter(self), None)

    def __iter__(self) -> Iterator[list[int]]:
        return sampler_batches(*self._args, **self._kwargs)
