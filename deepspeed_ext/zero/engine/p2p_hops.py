"""All-gather and reduce-scatter in ``ceil(log2 p)`` point-to-point steps, for any group size ``p``.

The log-latency algorithms PCCL (arXiv 2504.18658) runs across nodes in place of the library's
rings, in Bruck et al.'s form that needs no power of two (distance doubling for the all-gather,
halving for the reduce-scatter). Each member sends the bytes of a ring in ``ceil(log2 p)`` steps
instead of ``p - 1``. The steps: docs/hierarchical_zero_modules.md."""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepspeed_ext.zero.cost.collectives import recursive_schedule
from mdsp_base import comm


def _pieces(first: int, count: int, p: int) -> list[tuple[int, int]]:
    """Blocks ``first .. first+count-1`` (mod ``p``) as contiguous [begin, end) ranges."""
    first %= p
    end = first + count
    return [(first, end)] if end <= p else [(first, p), (0, end - p)]


def all_gather(out: torch.Tensor, block: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``out`` ([p * n] elements) = every member's ``block`` ([n]) in group-rank order."""
    p, me = dist.get_world_size(group), dist.get_rank(group)
    comm.count_launch("all_gather", "recursive", out.numel() * out.element_size(), group)
    blocks = out.view(p, -1)
    blocks[me].copy_(block.reshape(-1))
    for d, c in recursive_schedule(p):
        sends = [(blocks[a:b], (me - d) % p) for a, b in _pieces(me, c, p)]
        recvs = [(blocks[a:b], (me + d) % p) for a, b in _pieces(me + d, c, p)]
        comm.send_recv(sends, recvs, group, "gather")


def reduce_scatter(held: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over the group of ``held`` ([p * n] elements), computed in place: returns this member's
    block ``held.view(p, -1)[rank]``, as a flat reduce-scatter into that view would leave it."""
    p, me = dist.get_world_size(group), dist.get_rank(group)
    comm.count_launch("reduce_scatter", "recursive", held.numel() * held.element_size(), group)
    blocks = held.view(p, -1)
    steps = recursive_schedule(p)
    inbox = torch.empty_like(blocks[: max((c for _, c in steps), default=0)])  # serves every step
    for d, c in reversed(steps):
        sends = [(blocks[a:b], (me + d) % p) for a, b in _pieces(me + d, c, p)]
        received, at = [], 0
        for a, b in _pieces(me, c, p):
            received.append((blocks[a:b], inbox[at : at + b - a]))
            at += b - a
        comm.send_recv(sends, [(buf, (me - d) % p) for _, buf in received], group, "reduce")
        for mine, buf in received:
            mine.add_(buf)
    return blocks[me]
