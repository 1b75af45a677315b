"""The multi-rank harness itself: results per rank, a failing rank's traceback, a hang's timeout."""

import time

import pytest
import torch
import torch.distributed as dist
from multirank import RankError


def _sum_of_ranks() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _rank_one_fails() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


def _rank_zero_hangs() -> None:
    if dist.get_rank() == 0:
        time.sleep(60)


def test_every_rank_returns_its_result(run_ranks):
    assert run_ranks(4, _sum_of_ranks) == [6.0] * 4


def test_failing_rank_traceback_is_shown_and_pool_recovers(run_ranks):
    with pytest.raises(RankError, match="(?s)rank 1 of 2 failed.*boom on rank one"):
        run_ranks(2, _rank_one_fails, timeout=30)
    assert run_ranks(2, _sum_of_ranks) == [1.0, 1.0]


def test_hung_rank_times_out_and_pool_recovers(run_ranks):
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 2 gave no answer within 2s"):
        run_ranks(2, _rank_zero_hangs, timeout=2)
    assert run_ranks(2, _sum_of_ranks) == [1.0, 1.0]
