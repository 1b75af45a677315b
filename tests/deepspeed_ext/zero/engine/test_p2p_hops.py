"""The log-latency all-gather and reduce-scatter hand every member what gloo's own collectives do,
for group sizes that are and are not powers of two, in ceil(log2 p) steps of point-to-point sends
that carry (p - 1)/p of the buffer, the bytes of a ring."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from deepspeed_ext.zero.cost.collectives import recursive_schedule
from deepspeed_ext.zero.engine import p2p_hops
from mdsp_base import comm
from mdsp_base.topology import Topology

WORLD = 6
# Whole groups, strided groups (as the hops' cross-node groups are) and sizes 2..6.
GROUPS = ([0, 1], [0, 2, 4], [1, 3, 5], [0, 1, 2, 3], [1, 2, 3, 4, 5], list(range(WORLD)))


def _against_gloo(block_elems: int) -> list[dict]:
    groups = [dist.new_group(members) for members in GROUPS]
    me = dist.get_rank()
    out = []
    steps: list[int] = []
    original = comm.send_recv

    def counted(*args, **kwargs):
        steps.append(1)
        return original(*args, **kwargs)

    for members, group in zip(GROUPS, groups):
        if me not in members:
            continue
        p = len(members)
        # integer-valued floats: every summation order gives the same sum, so equality is exact
        block = torch.arange(block_elems, dtype=torch.float32) + 1000 * me
        gathered, expected = torch.empty(p * block_elems), torch.empty(p * block_elems)
        dist.all_gather_into_tensor(expected, block, group=group)
        counter = comm.CommCounter(Topology(world_size=WORLD, ranks_per_node=1, ranks_per_package=1))
        steps.clear()
        comm.send_recv = counted
        try:
            with comm.counting(counter):
                p2p_hops.all_gather(gathered, block, group)
                full = torch.randint(-50, 50, (p * block_elems,), generator=torch.Generator().manual_seed(me))
                reference = torch.empty(block_elems, dtype=torch.float32)
                dist.reduce_scatter_tensor(reference, full.float().clone(), group=group)
                mine = p2p_hops.reduce_scatter(full.float(), group)
        finally:
            comm.send_recv = original
        out.append(
            dict(
                p=p,
                gather_equal=torch.equal(gathered, expected),
                reduce_equal=torch.equal(mine, reference),
                steps=len(steps),
                sent=counter.per_link()["inter_node"],
            )
        )
    return out


@pytest.mark.parametrize("block_elems", [1, 37])
def test_recursive_collectives_equal_gloo_for_every_group_size(run_ranks, block_elems):
    for rank_results in run_ranks(WORLD, _against_gloo, block_elems):
        for r in rank_results:
            p = r["p"]
            assert r["gather_equal"] and r["reduce_equal"], r
            assert r["steps"] == 2 * math.ceil(math.log2(p))  # gather steps + reduce steps
            # each sends (p - 1) blocks of 4-byte elements per collective: a ring's bytes
            assert r["sent"] == 2 * (p - 1) * block_elems * 4


def test_schedule_steps_and_blocks():
    assert recursive_schedule(1) == []
    assert recursive_schedule(2) == [(1, 1)]
    assert recursive_schedule(6) == [(1, 1), (2, 2), (4, 2)]  # 1 + 2 + 2 = 5 blocks
    assert recursive_schedule(8) == [(1, 1), (2, 2), (4, 4)]  # recursive doubling's 1 + 2 + 4
