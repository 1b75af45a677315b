"""Point-to-point all-to-alls fused with the GEMM that produces or consumes them (Flash-Overlap's UP
case, arXiv 2604.24013: Ulysses sequence parallelism).

An all-to-all over n ranks, as n-1 P2P steps (step k: send to rank r+k, receive from rank r-k):
:func:`compute_all_to_all` computes the blocks other ranks receive first, each sent when ready, and
its own last; :func:`all_to_all_compute` posts every block at once and consumes its own first, then
each as it arrives. Every rank sends the bytes of one all-to-all; the pattern is ``direct`` whatever
``flash_overlap.mode`` says (a ring would forward each block n/2 hops on average)."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from megatron_ext.layers.p2p.link import Link, OverlapGroup, Posted
from megatron_ext.layers.p2p.overlap import timed

# Tags clear of the other schedules' (steps 1 .. n-1, and the whole-collective tags 1 << 20 and
# 2 << 20): an all-to-all in flight never matches another schedule's transfer on gloo.
_PRODUCE_TAG, _CONSUME_TAG = 3 << 20, 4 << 20


def compute_all_to_all(compute: Callable[[int], torch.Tensor], og: OverlapGroup) -> list[torch.Tensor]:
    """GEMM + all-to-all: ``compute(j)`` gives the block this rank sends to rank j; returns the
    blocks this rank receives, element i from rank i (its own at ``og.rank``).

    Remote blocks are computed first (rank r+1 first), each sent as soon as it is ready, and the own
    block last; blocks must have the same shape and dtype on every rank."""
    n, r = og.size, og.rank
    if n == 1:
        return [timed(og, "block 0", lambda: compute(0))]
    link: Link | None = None
    received: list[torch.Tensor | None] = [None] * n
    pending = []
    for step in range(1, n):
        dst, src = (r + step) % n, (r - step) % n
        block = timed(og, f"block for rank {dst}", lambda dst=dst: compute(dst).contiguous())  # type: ignore[misc]  # mypy infers no lambda with defaults
        if link is None:
            link = Link(og, block.device, "all-to-all")
        received[src] = torch.empty_like(block)
        pending.append((link.exchange(received[src], src, block, dst, step=_PRODUCE_TAG + step), src))
    received[r] = timed(og, f"block for rank {r}", lambda: compute(r))
    assert link is not None  # n > 1: the first step made it
    for posted, src in pending:
        link.wait(posted, True, src, f"receive of block {r} from rank {src}")
    link.finish()
    return cast(list[torch.Tensor], received)  # every rank's block is set by now


def _post_blocks(
    blocks: list[torch.Tensor], og: OverlapGroup, into: list[torch.Tensor] | None = None
) -> tuple[Link, list[tuple[torch.Tensor, Posted, int]]]:
    """Post every remote block of an all-to-all at once: (link, [(receive buffer, transfer, source)]);
    each received block lands in ``into[source]`` when given, else in a new buffer."""
    n, r = og.size, og.rank
    link = Link(og, blocks[r].device, "all-to-all")
    pending = []
    for step in range(1, n):
        dst, src = (r + step) % n, (r - step) % n
        buf = torch.empty_like(blocks[r]) if into is None else into[src]
        pending.append(
            (buf, link.exchange(buf, src, blocks[dst].contiguous(), dst, step=_CONSUME_TAG + step), src)
        )
    return link, pending


def all_to_all_compute(
    blocks: list[torch.Tensor], compute: Callable[[int, torch.Tensor], None], og: OverlapGroup
) -> None:
    """All-to-all + GEMM: sends ``blocks[j]`` to rank j and calls ``compute(i, block)`` with the
    block rank i sent here: this rank's own first, then the others in step order as each arrives.
    Blocks must have the same shape and dtype on every rank."""
    n, r = og.size, og.rank
    if n == 1:
        timed(og, "block 0", lambda: compute(0, blocks[0]))
        return
    link, pending = _post_blocks(blocks, og)
    timed(og, f"block from rank {r}", lambda: compute(r, blocks[r]))
    for buf, posted, src in pending:
        link.wait(posted, True, src, f"receive of block {r} from rank {src}")
        timed(og, f"block from rank {src}", lambda src=src, buf=buf: compute(src, buf))  # type: ignore[misc]  # mypy infers no lambda with defaults
    link.finish()


def start_all_to_all(output: torch.Tensor, tensor: torch.Tensor, og: OverlapGroup) -> Callable[[], None]:
    """A whole all-to-all of dim 0's n even blocks (``all_to_all_single``'s layout) posted as P2P
    steps; returns the wait that completes it into ``output``."""
    n, r = og.size, og.rank
    blocks, into = list(tensor.contiguous().chunk(n)), list(output.chunk(n))
    into[r].copy_(blocks[r])
    if n == 1:
        return lambda: None
    link, pending = _post_blocks(blocks, og, into)

    def wait() -> None:
        for _, posted, src in pending:
            link.wait(posted, True, src, f"receive of block {r} from rank {src}")
        link.finish()

    return wait
