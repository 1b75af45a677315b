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
    return span(t, range(j, j + 1), n)


def span(t: torch.Tensor, owners: range, n: int) -> torch.Tensor:
    """The slices of ranks ``owners`` (consecutive, ascending) of ``t``'s sequence split in n equal
    parts: one contiguous view."""
    size = t.shape[0] // n
    return t[owners.start * size : owners.stop * size]


def step_runs(n: int, gemms: int) -> list[range]:
    """The steps 1 .. n-1 of an n-rank exchange cut into runs of consecutive steps, one GEMM each:
    ``gemms - 1`` runs (the own slice is the other GEMM), as equal as possible with the longer ones
    last so that the first GEMMs start early; ``gemms`` 0 or at least n: one step per run."""
    count = n - 1 if gemms == 0 or gemms >= n else gemms - 1
    runs, first = [], 1
    for i in range(count):
        length = (n - 1) // count + (i >= count - (n - 1) % count)
        runs.append(range(first, first + length))
        first += length
    return runs


def owner_spans(owners: list[int]) -> list[range]:
    """Distinct ranks, consecutive modulo n, as ascending runs of rows that do not wrap (one or two)."""
    spans: list[range] = []
    for j in sorted(owners):
        if spans and spans[-1].stop == j:
            spans[-1] = range(spans[-1].start, j + 1)
        else:
            spans.append(range(j, j + 1))
    return spans


def label(owners: range) -> str:
    """A compute slice's name in a trace: ``slice j`` or ``slices a-b``."""
    return f"slice {owners.start}" if len(owners) == 1 else f"slices {owners.start}-{owners.stop - 1}"


def timed(og: OverlapGroup, name: str, fn: Callable[[], T]) -> T:
    """``fn()``, recorded as a compute slice named ``name`` when the group carries a trace."""
    if og.trace is None:
        return fn()
    start = time.perf_counter()
    result = fn()
    og.trace("compute", f"{og.name} {name}", start, time.perf_counter())
    return result


def all_gather_compute(
    shard: torch.Tensor,
    compute: Callable[[range, torch.Tensor], object],
    og: OverlapGroup,
    out: torch.Tensor | None = None,
) -> None:
    """All-gather ``shard`` over ``og.group`` fused with ``compute(owners, block)``.

    ``block`` holds the slices of the consecutive ranks ``owners``: this rank's own first (no wait),
    then the others as they arrive, ``og.compute_slices`` GEMMs in all (0: one per rank). Slices
    must have the same shape on every rank. With ``out`` ([n * rows, ...]) the slices are received
    straight into their rows of it, which then holds the gathered tensor.
    """
    n, r = og.size, og.rank
    runs = step_runs(n, og.compute_slices)
    if out is None and any(len(run) > 1 for run in runs):
        out = shard.new_empty(
            (shard.shape[0] * n, *shard.shape[1:])
        )  # merged slices need their rows together
    if out is not None:
        rows(out, r, n).copy_(shard)
    if n == 1:
        timed(og, "slice 0", lambda: compute(range(1), shard))
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
    timed(og, f"slice {r}", lambda: compute(range(r, r + 1), shard))
    for run in runs:
        for step in run:
            src, _, owner = peers(step)
            link.wait(pending, True, src, f"receive of slice {owner} from rank {src}")
            if step + 1 < n:
                # Keep the next transfer running under this run's compute; ring forwards what just came.
                next_src, next_dst, _ = peers(step + 1)
                outgoing = shard if og.mode == "direct" else buffers[step - 1]
                pending = link.exchange(buffers[step], next_src, outgoing, next_dst, step=step + 1)
        if out is None:  # one step per run: its own buffer
            owner = peers(run[0])[2]
            timed(og, f"slice {owner}", lambda j=owner, b=buffers[run[0] - 1]: compute(range(j, j + 1), b))  # type: ignore[misc]  # mypy infers no lambda with defaults
            continue
        for owners in owner_spans([peers(step)[2] for step in run]):
            timed(og, label(owners), lambda js=owners: compute(js, span(out, js, n)))  # type: ignore[misc]  # mypy infers no lambda with defaults
    link.finish()


def compute_reduce_scatter(compute: Callable[[range], torch.Tensor], og: OverlapGroup) -> torch.Tensor:
    """GEMM + reduce-scatter: ``compute(owners)`` gives this rank's partials of the slices of the
    consecutive ranks ``owners``, stacked; returns the sum over ranks of the partials of this
    rank's own slice.

    Slices owned by other ranks are computed first, ``og.compute_slices - 1`` GEMMs for them (0:
    one per rank), each partial sent as soon as its GEMM is done; the own slice is computed last,
    while the last transfers complete, then the received partials are added.
    """
    n, r = og.size, og.rank
    if n == 1:
        return timed(og, "slice 0", lambda: compute(range(1)))

    def owner_of(step: int) -> int:
        return (r + step) % n if og.mode == "direct" else (r - step) % n

    link: Link | None = None
    incoming: torch.Tensor | None = None  # direct: every peer's partial of the own slice, stacked
    received: list[tuple[Posted, int]] = []
    carried: tuple[torch.Tensor, Posted] | None = None  # ring: the incoming running sum
    for run in step_runs(n, og.compute_slices):
        parts: dict[int, torch.Tensor] = {}
        for owners in owner_spans([owner_of(step) for step in run]):
            block = timed(og, label(owners), lambda js=owners: compute(js).contiguous())  # type: ignore[misc]  # mypy infers no lambda with defaults
            parts.update({j: rows(block, j - owners.start, len(owners)) for j in owners})
        for step in run:
            owner = owner_of(step)
            src, dst = ((r - step) % n, owner) if og.mode == "direct" else ((r - 1) % n, (r + 1) % n)
            part = parts[owner]
            if link is None:
                link = Link(og, part.device, "reduce-scatter")
            if og.mode == "direct":
                incoming = part.new_empty((n - 1, *part.shape)) if incoming is None else incoming
                received.append((link.exchange(incoming[step - 1], src, part, dst, step=step), src))
                continue
            if carried is not None:
                buf, posted = carried
                link.wait(posted, True, src, f"receive of the running sum of slice {owner} from rank {src}")
                part.add_(buf)
            buf = torch.empty_like(part)
            carried = (buf, link.exchange(buf, src, part, dst, step=step))
    own = timed(og, f"slice {r}", lambda: compute(range(r, r + 1)).contiguous())
    assert link is not None  # n > 1: the first step made it
    if og.mode == "ring":
        assert carried is not None  # the last step's running sum
        incoming = carried[0][None]
        received.append((carried[1], (r - 1) % n))
    for posted, src in received:
        link.wait(posted, True, src, f"receive of a partial of slice {r} from rank {src}")
    assert incoming is not None
    own.add_(sum_of_stacked(incoming))
    link.finish()
    return own


def sum_of_stacked(partials: torch.Tensor) -> torch.Tensor:
    """The sum over dim 0 of ``partials`` in one kernel (none for a single one): n - 1 peers'
    partials cost two kernels with the add that follows, not n - 1."""
    return partials[0] if len(partials) == 1 else partials.sum(0)


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
    own = rows(full, r, n)
    incoming = own.new_empty((n - 1, *own.shape))
    posted = []
    for k in range(1, n):
        src, dst = (r - k) % n, (r + k) % n
        posted.append((link.exchange(incoming[k - 1], src, rows(full, dst, n), dst, _SCATTER_TAG + k), src))

    def wait() -> torch.Tensor:
        for p, src in posted:
            link.wait(p, True, src, f"receive of a partial of slice {r} from rank {src}")
        link.finish()
        return own + sum_of_stacked(incoming)

    return wait
