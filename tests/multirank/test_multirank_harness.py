"""The multi-rank harness itself (``multirank``): results per rank, a failing rank's traceback, a hang's
timeout, for the tests' worker pool and for the benchmarks' process launcher."""

import time

import pytest
import torch
import torch.distributed as dist

from multirank import RankError, launch_ranks


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


# The benchmarks' launcher: one process per rank of a command, results through write_result.
def test_launched_ranks_rendezvous_and_return_their_results():
    code = (
        "import os, torch, torch.distributed as dist; from multirank import write_result; "
        "dist.init_process_group('gloo'); t = torch.tensor([float(dist.get_rank())]); dist.all_reduce(t); "
        "write_result([os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['LOCAL_WORLD_SIZE'], t.item()]); "
        # a gloo group left to the interpreter's finalization can abort the rank after it succeeded
        "dist.destroy_process_group()"
    )
    assert launch_ranks(["-c", code], world_size=2, timeout=60, ranks_per_node=1) == [
        ["0", "0", "1", 1.0],
        ["1", "0", "1", 1.0],
    ]


def test_a_failing_launched_rank_stops_the_others():
    # Rank 0 would sleep 10x past the launch's 60 s timeout: a RankError, not a TimeoutError, shows
    # that the launcher killed it when rank 1 failed instead of waiting for it.
    code = "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(600)"
    with pytest.raises(RankError, match=r"ranks \[1\] of 2 exited with \[3\]"):
        launch_ranks(["-c", code], world_size=2, timeout=60)


def test_launched_ranks_time_out_and_a_rank_without_result_is_named():
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 still running after 1 s"):
        launch_ranks(["-c", "import time; time.sleep(60)"], world_size=2, timeout=1)
    with pytest.raises(RankError, match=r"ranks \[0\] of 1 exited 0 without write_result"):
        launch_ranks(["-c", "pass"], world_size=1, timeout=30)
