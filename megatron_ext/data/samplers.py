"""The order in which Megatron-LM hands samples to each data-parallel rank, as pure index generators.

They reproduce ``megatron/training/datasets/data_samplers.py`` (tag core_v0.16.1, not on the package
index) so that the stock path and the shared-memory producer compute exactly what every DP rank
would have read: ``single`` (``MegatronPretrainingSampler``, one pass) and ``random``
(``MegatronPretrainingRandomSampler`` under Megatron's ``cyclic`` loader, an epoch's permutation
seeded with ``seed + epoch``, endless), both resuming at ``consumed_samples``. Shuffles stay int32
or int64 tensors sliced per micro-batch, never Python lists (seconds and gigabytes at 100M samples),
and one node's streams share each epoch's permutation (:class:`EpochPermutations`).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
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
    total_samples: int,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    drop_last: bool = True,
) -> Iterator[list[int]]:
    """Micro-batches of sample indices of DP rank ``dp_rank`` in ``MegatronPretrainingSampler`` order:
    from ``consumed_samples`` on, the indices are cut into chunks of ``micro_batch_size * dp_size``
    and DP rank ``r`` takes positions ``[r * mbs, (r + 1) * mbs)`` of each; an incomplete last chunk
    is dropped unless ``drop_last`` is false. One pass, then the stream ends."""
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
        yield list(
            range(min(start + first, total_samples), min(start + first + micro_batch_size, total_samples))
        )


class EpochPermutations:
    """``torch.randperm(n)`` seeded with ``seed``, computed once and shared by the streams that ask.

    Keeps the ``keep`` newest: a node's streams advance in lockstep, so at an epoch boundary all of
    them move to the next permutation within one step and the older one is dropped."""

    def __init__(self, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep({keep}) must be at least 1")
        self._keep = keep
        self._cache: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()

    def get(self, seed: int, n: int) -> torch.Tensor:
        key = (seed, n)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        generator = torch.Generator()
        generator.manual_seed(seed)
        # torch draws the same permutation whatever the dtype: int32 halves the memory.
        perm = torch.randperm(n, generator=generator, dtype=torch.int32 if n < 2**31 else torch.int64)
        self._cache[key] = perm
        while len(self._cache) > self._keep:
            self._cache.popitem(last=False)
        return perm


def random_batches(
    total_samples: int,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    data_sharding: bool = True,
    seed: int = 0,
    permutations: EpochPermutations | None = None,
) -> Iterator[list[int]]:
    """Micro-batches of DP rank ``dp_rank`` in ``MegatronPretrainingRandomSampler`` order, epoch after epoch
    (as ``cyclic_iter`` re-enters the sampler). Each epoch is a ``torch.randperm`` seeded with
    ``seed + epoch`` (Megatron seeds with the epoch alone: ``seed=0`` is its order); with
    ``data_sharding`` every DP rank permutes its own contiguous bucket, without it one permutation of
    the whole set is dealt round-robin. A resume starts mid-epoch where the interrupted run stopped.
    ``permutations``: a cache shared with the other streams of the process (None: a private one)."""
    _check(total_samples, micro_batch_size, dp_rank, dp_size)
    chunk = micro_batch_size * dp_size
    active = total_samples - total_samples % chunk  # samples one epoch consumes
    if active == 0:
        raise ValueError(f"the dataset has {total_samples} samples, fewer than one step's {chunk}")
    if permutations is None:
        permutations = EpochPermutations()
    consumed = consumed_samples
    while True:
        epoch, in_epoch = divmod(consumed, active)
        if in_epoch % chunk:
            raise ValueError(
                f"consumed_samples({consumed_samples}) is not a whole number of steps of {chunk} samples "
                "(micro_batch_size * dp_size): resume from a step boundary"
            )
        if data_sharding:
            bucket = (total_samples // chunk) * micro_batch_size
            mine, base = permutations.get(seed + epoch, bucket)[in_epoch // dp_size :], dp_rank * bucket
        else:
            whole = (total_samples // micro_batch_size) * micro_batch_size
            mine, base = permutations.get(seed + epoch, whole)[in_epoch:][dp_rank::dp_size], 0
        for i in range(0, len(mine) - micro_batch_size + 1, micro_batch_size):
            # Megatron advances its sample counter by a whole step per micro-batch, on every rank.
            consumed += chunk
            yield [base + j for j in mine[i : i + micro_batch_size].tolist()]


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """What fixes Megatron's sample order for a loader; the same on every rank of the job."""

    micro_batch_size: int
    """Samples per micro-batch of one DP rank."""
    consumed_samples: int
    """Samples the job consumed before this start (all DP ranks together): where the order resumes."""
    dp_size: int
    """Data-parallel ranks of the job."""
    kind: SamplerKind = "single"
    """Megatron's ``single`` loader, or its ``cyclic`` one (``random``)."""
    data_sharding: bool = True
    """random: each DP rank shuffles its own bucket (Megatron's --data-sharding default)."""
    seed: int = 0
    """random: added to the epoch as the shuffle's seed (0 is Megatron's order)."""

    def __post_init__(self) -> None:
        if self.kind not in ("single", "random"):
            raise ValueError(
                f"sampler={self.kind!r}: expected 'single' (Megatron's default) or 'random' "
                "(its cyclic loader)"
            )

    def batches(
        self, total_samples: int, dp_rank: int, permutations: EpochPermutations | None = None
    ) -> Iterator[list[int]]:
        """The index stream of DP rank ``dp_rank`` over a dataset of ``total_samples``.
        ``permutations``: shared by the streams of one process, so a node shuffles once per epoch."""
        if self.kind == "single":
            return single_pass_batches(
                total_samples, self.consumed_samples, self.micro_batch_size, dp_rank, self.dp_size
            )
        return random_batches(
            total_samples,
            self.consumed_samples,
            self.micro_batch_size,
            dp_rank,
            self.dp_size,
            data_sharding=self.data_sharding,
            seed=self.seed,
            permutations=permutations,
        )


class BatchSampler:
    """A re-iterable batch sampler over one DP rank's stream, for ``torch.utils.data.DataLoader``."""

    def __init__(self, settings: SamplerSettings, total_samples: int, dp_rank: int) -> None:
        self._settings, self._total, self._dp_rank = settings, total_samples, dp_rank
        # One cache for every pass over this sampler (the check below, the stock path's step counter,
        # the DataLoader's iterator): each epoch is shuffled once, not once per pass.
        self._permutations = EpochPermutations()
        # Validate now, not at the first next(): a wrong resume point should fail at start-up.
        next(iter(self), None)

    def __iter__(self) -> Iterator[list[int]]:
        return self._settings.batches(self._total, self._dp_rank, self._permutations)
