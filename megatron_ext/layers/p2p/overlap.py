"""Point-to-point schedules that overlap a sequence all-gather or reduce-scatter with its GEMM.

Flash-Overlap (CommFuse, arXiv 2604.24013) replaces the ring collectives of tensor/sequence
parallelism by P2P transfers ordered so that the last computation never waits:
:func:`all_gather_compute` computes on the local slice first, then on each other rank's as it
arrives; :func:`compute_reduce_scatter` computes the slices other ranks own first, sending each when
ready, and its own last. :func:`start_all_gather` and :func:`start_reduce_scatter` post a whole
collective and return its wait, for a GEMM to run under (megatron-core's asynchronous collectives,
as P2P). Patterns (``direct``, ``ring``) and their cost: docs/flash_overlap.md."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

from megatron_ext.layers.p2p.link import Link, OverlapGroup, Posted

T = TypeVar("T")


def rows(t: torch.Tensor, j: int, n: int) -> torch.Tensor:
    """Rank j's slice of the sequence (dim 0) of ``t``, split in n equal parts (a contiguous view)."""
    size = t.shape[0] // n
    return t[j * size : (j + 1) * size]


def timed(og: OverlapGroup, label: str, fn: Callable[[], T]) -> T:
    """``fn()``, recorded as a compute slice named ``label`` when the group carries a trace."""
    if og.trace is None:
        return fn()
    start = time.perf_counter()
    result = fn()
    og.trace("compute", f"{og.name} {label}", start, time.perf_counter())
    return result


def all_gather_compute(
    shard: torch.Tensor,
    compute: Callable[[int, torch.Tensor], object],
    og: OverlapGroup,
    out: torch.Tensor | None = None,
) -> None:
    """All-gather ``shard`` over ``og.group`` fused with ``compute(owner_rank, slice)``.

    ``compute`` is called once per rank's slice: this rank's own first (no wait), then the others
    in arrival order. Slices must have the same shape on every rank. With ``out`` ([n * rows, ...]),
    the slices are received straight into their rows of it, which then holds the gathered tensor.
    """
    n, r = og.size, og.rank
    if out is not None:
        rows(out, r, n).copy_(shard)
    if n == 1:
        timed(og, "slice 0", lambda: compute(0, shard))
        return
    shard = shard.contiguous()
    link = Link(og, shard.device, "all-gather")

    def peers(step: int) -> tuple[int, int, int]:
        """(source, destination, owner of the received slice) of ``step`` (1-based)."""
        if og.mode == "direct":
            return (r - step) % n, (r + step) % n, (r - step) % n
        return (r - 1) % n, (r + 1) % n, (r - step) % n

    buffers = [
        torch.empty_like(shard) if out is None else rows(out, peers(step)[2], n) for step in range(1, n)
    ]
    src, dst, _ = peers(1)
    pending = link.exchange(buffers[0], src, shard, dst, step=1)
    timed(og, f"slice {r}", lambda: compute(r, shard))
    for step in range(1, n):
        src, _, owner = peers(step)
        link.wait(pending, True, src, f"receive of slice {owner} from rank {src}")
        if step + 1 < n:
            # Keep the next transfer running under this slice's compute; ring forwards what just came.
            next_src, next_dst, _ = peers(step + 1)
            outgoing = shard if og.mode == "direct" else buffers[step - 1]
            pending = link.exchange(buffers[step], next_src, outgoing, next_dst, step=step + 1)
        received = buffers[step - 1]
        timed(og, f"slice {owner}", lambda owner=owner, received=received: compute(owner, received))  # type: ignore[misc]  # mypy infers no lambda with defaults
    link.finish()


def compute_reduce_scatter(compute: Callable[[int], torch.Tensor], og: OverlapGroup) -> torch.Tensor:
    """GEMM + reduce-scatter: ``compute(j)`` gives this rank's partial of rank j's slice; returns
    the sum over ranks of the partials of this rank's own slice.

    Slices owned by other ranks are computed first and sent as soon as each is ready; the own
    slice is computed last, while the last transfers complete, then the received partials are added.
    """
    n, r = og.size, og.rank
    if n == 1:
        return timed(og, "slice 0", lambda: compute(0))
    link: Link | None = None
    received: list[tuple[torch.Tensor, Posted, int]] = []
    carried: tuple[torch.Tensor, Posted] | None = None  # ring: the incoming running sum
    for step in range(1, n):
        if og.mode == "direct":
            owner, src, dst = (r + step) % n, (r - step) % n, (r + step) % n
        else:
            owner, src, dst = (r - step) % n, (r - 1) % n, (r + 1) % n
        part = timed(og, f"slice {owner}", lambda owner=owner: compute(owner).contiguous())  # type: ignore[misc]  # mypy infers no lambda with defaults
        if link is None:
            link = Link(og, part.device, "reduce-scatter")
        if og.mode == "ring" and carried is not None:
            buf, posted = carried
            link.wait(posted, True, src, f"receive of the running sum of slice {owner} from rank {src}")
            part.add_(buf)
        buf = torch.empty_like(part)
        posted = link.exchange(buf, src, part, dst, step=step)
        if og.mode == "direct":
            received.append((buf, posted, src))
        else:
            carried = (buf, posted)
    own = timed(og, f"slice {r}", lambda: compute(r).contiguous())
    assert link is not None  # n > 1: the first step made it
    if og.mode == "ring":
        assert carried is not None  # the last step's running sum
        received.append((*carried, (r - 1) % n))
    for buf, posted, src in received:
        link.wait(posted, True, src, f"receive of a partial of slice {r} from rank {src}")
        own.add_(buf)
    link.finish()
    return own


# Tags of the collectives posted whole: clear of the fused schedules' steps (1 .. n-1), so that a
# gather and a reduce-scatter in flight together between two ranks never match each other on gloo.
_GATHER_TAG, _SCATTER_TAG = 1 << 20, 2 << 20


def start_all_gather(shard: torch.Tensor, og: OverlapGroup, out: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Post a sequence all-gather of ``shard`` into ``out`` (rank j's slice at its rows, direct
    pattern); the returned function waits for it and returns ``out``."""
    n, r = og.size, og.rank
    shard = shard.contiguous()
    rows(out, r, n).copy_(shard)
    if n == 1:
        return lambda: out
    link = Link(og, shard.device, "all-gather")
    posted = [
        (
            link.exchange(rows(out, (r - k) % n, n), (r - k) % n, shard, (r + k) % n, _GATHER_TAG + k),
            (r - k) % n,
        )
        for k in range(1, n)
    ]

    def wait() -> torch.Tensor:
        for p, src in posted:
            link.wait(p, True, src, f"receive of slice {src} from rank {src}")
        link.finish()
        return out

    return wait


def start_reduce_scatter(full: torch.Tensor, og: OverlapGroup) -> Callable[[], torch.Tensor]:
    """Post a sequence reduce-scatter of ``full`` (each rank j gets the sum of every rank's rows j,
    direct pattern); the returned function waits and returns this rank's summed slice."""
    n, r = og.size, og.rank
    full = full.contiguous()
    if n == 1:
        return lambda: full
    link = Link(og, full.device, "reduce-scatter")
    incoming = []
    for k in range(1, n):
        src, dst = (r - k) % n, (r + k) % n
        buf = torch.empty_like(rows(full, r, n))
        incoming.append((buf, link.exchange(buf, src, rows(full, dst, n), dst, _SCATTER_TAG + k), src))

    def wait() -> torch.Tensor:
        own = rows(full, r, n).clone()
        for buf, p, src in incoming:
            link.wait(p, True, src, f"receive of a partial of slice {r} from rank {src}")
            own.add_(buf)
        link.finish()
        return own

    return wait
