"""Point-to-point schedules that overlap a sequence all-gather or reduce-scatter with its GEMM.

Flash-Overlap (CommFuse, arXiv 2604.24013) replaces the ring collectives of tensor/sequence
parallelism by P2P transfers ordered by rank so that the last computation never waits:

* all-gather + GEMM (:func:`all_gather_compute`): compute on the locally held sequence slice first,
  then on each other rank's slice as its transfer arrives;
* GEMM + reduce-scatter (:func:`compute_reduce_scatter`): compute the slices that other ranks own
  first and send each as soon as it is ready, compute this rank's own slice last, then add the
  partials received meanwhile.

With N ranks, per-slice compute c and per-slice transfer p a schedule takes c + (N-1)*max(c, p):
communication is fully hidden when p <= c. Every rank sends N-1 slices, as many bytes as a ring
collective. Two patterns: ``direct`` (step k talks to the ranks k away) and ``ring`` (always the
neighbours; all-gather forwards what arrived, reduce-scatter passes a running sum along).

Transfers: each step posts its receive before its send (gloo writes only once the peer's receive
is posted) and keeps one step in flight ahead of the compute. On CUDA they are issued from the
compute stream and run on the process group's own stream; on gloo they are asynchronous work
items, posted from one background thread so that the compute thread never writes to a socket.
On gloo every wait is bounded by ``timeout_s`` and a silent peer raises :class:`PeerTimeoutError`
naming the peer and the layer; after such an error the process group is unusable (gloo closes the
pair). On CUDA a wait only orders the compute stream after the transfer (a timed ``work.wait`` would
block the host until the transfer ends, so the host could not run ahead and CUDA graphs could not
capture the layer); a dead peer is then reported by the process group's watchdog, within the
timeout the group was created with.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Protocol

import torch
import torch.distributed as dist

Mode = Literal["direct", "ring"]
MODES: tuple[Mode, ...] = ("direct", "ring")
DEFAULT_TIMEOUT_S = 300.0


class PeerTransferError(RuntimeError):
    """A transfer with a tensor-parallel peer failed (peer died or the connection broke)."""


class PeerTimeoutError(PeerTransferError, TimeoutError):
    """A tensor-parallel peer did not complete a transfer within the timeout."""


class Trace(Protocol):
    """Receives one record per compute slice and per wait: kind ("compute"/"wait"), label, start, end
    (``time.perf_counter`` seconds on the host; on CUDA these are issue times, not kernel times)."""

    def __call__(self, kind: str, label: str, start: float, end: float) -> None: ...


@dataclass(frozen=True)
class OverlapGroup:
    """Where and how a schedule talks: the TP group, the P2P pattern, the wait bound, names for errors."""

    group: dist.ProcessGroup | None
    """Tensor-parallel group; None means a single rank (no communication)."""
    mode: Mode = "direct"
    """``direct``: step k exchanges with the ranks k away; ``ring``: always with the neighbours."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Seconds any single wait may take before :class:`PeerTimeoutError`."""
    name: str = "flash_overlap"
    """Layer name used in error messages."""
    trace: Trace | None = None
    """Optional recorder of compute slices and waits (benchmarks)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"P2P mode {self.mode!r} of layer {self.name!r} is unknown: use one of {MODES}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} of layer {self.name!r} must be positive")

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size()

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank()


_posters: dict[int, ThreadPoolExecutor] = {}


def _poster() -> ThreadPoolExecutor:
    """The thread that posts gloo transfers. A send whose receiver already waits is written to the
    socket inside the posting call (milliseconds on a slow link), so the compute thread must not be
    the one posting. One per process id: a forked child does not inherit the parent's thread."""
    pid = os.getpid()
    if pid not in _posters:
        _posters[pid] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flash-overlap-p2p")
    return _posters[pid]


class _Posted:
    """One step's batch of P2P ops; its works exist once the batch has been issued."""

    def __init__(self, works: Future, receives: int, ops: int) -> None:
        self.works, self.receives, self.ops = works, receives, ops

    def guards(self, receive: bool, timeout_s: float) -> list[dist.Work]:
        """The works guarding the receive (or the send) of the step."""
        works = self.works.result(timeout=timeout_s)
        if len(works) != self.ops:  # coalescing backends (NCCL): one work for the whole batch
            return works
        return works[: self.receives] if receive else works[self.receives :]


class _Link:
    """Issues one step's receive + send and waits on it: stream-ordered on CUDA, within the timeout
    on CPU (posted by the posting thread)."""

    def __init__(self, og: OverlapGroup, device: torch.device, what: str) -> None:
        self.og = og
        self.what = what
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute_stream = torch.cuda.current_stream(device)
        self.sends: list[tuple[_Posted, int]] = []

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.og.group, group_rank)

    def exchange(self, recv_buf: torch.Tensor | None, src: int, send_buf: torch.Tensor | None, dst: int, step: int) -> _Posted:
        """Post the receive (first) and the send of one step."""
        ops = []
        if recv_buf is not None:
            ops.append(dist.P2POp(dist.irecv, recv_buf, self._global(src), self.og.group, tag=step))
        if send_buf is not None:
            ops.append(dist.P2POp(dist.isend, send_buf, self._global(dst), self.og.group, tag=step))
        if self.cuda:
            # Issued from the compute stream: NCCL's own stream waits for the work queued so far (the
            # send buffer is written) and keeps the buffers alive until it is done with them; a side
            # stream of ours would add an event and nothing else.
            works: Future = Future()
            works.set_result(dist.batch_isend_irecv(ops))
        else:
            works = _poster().submit(dist.batch_isend_irecv, ops)  # one thread: batches stay in order
        posted = _Posted(works, int(recv_buf is not None), len(ops))
        if send_buf is not None:
            self.sends.append((posted, dst))
        return posted

    def wait(self, posted: _Posted, receive: bool, peer: int, label: str) -> None:
        """Order the compute stream after the step's receive (or send). On gloo this blocks until the
        work completes, at most ``timeout_s`` per work; on CUDA the host does not wait."""
        start = time.perf_counter()
        context = (
            f"layer {self.og.name!r}, {self.what} ({self.og.mode} mode), {label}: tensor-parallel rank {peer} "
            f"(global rank {self._global(peer)})"
        )
        timeout = timedelta(seconds=self.og.timeout_s)
        try:
            works = posted.guards(receive, self.og.timeout_s)
            for work in works:
                if self.cuda:
                    with torch.cuda.stream(self.compute_stream):
                        work.wait()  # stream-ordered: the compute stream waits, the host does not
                else:
                    work.wait(timeout=timeout)
        except FutureTimeout as e:
            raise PeerTransferError(f"{context}: posting the transfer took over {self.og.timeout_s:g} s") from e
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise PeerTimeoutError(
                    f"{context} did not answer within {self.og.timeout_s:g} s: it died, hangs, or did not "
                    "run this layer (all ranks of the group must call it in the same order); raise "
                    "flash_overlap.timeout_s if the link is only slow"
                ) from e
            raise PeerTransferError(f"{context} failed: {e}") from e
        if self.og.trace is not None:
            self.og.trace("wait", f"{self.og.name} {label}", start, time.perf_counter())

    def finish(self) -> None:
        """Wait for every send, so buffers may be reused and a dead receiver is reported here."""
        for posted, dst in self.sends:
            self.wait(posted, False, dst, f"send to rank {dst}")
        self.sends.clear()


def _timed(og: OverlapGroup, label: str, fn: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
    if og.trace is None:
        return fn()
    start = time.perf_counter()
    result = fn()
    og.trace("compute", f"{og.name} {label}", start, time.perf_counter())
    return result


def all_gather_compute(shard: torch.Tensor, compute: Callable[[int, torch.Tensor], None], og: OverlapGroup) -> None:
    """All-gather ``shard`` over ``og.group`` fused with ``compute(owner_rank, slice)``.

    ``compute`` is called once per rank's slice: this rank's own first (no wait), then the others
    in arrival order. Slices must have the same shape on every rank.
    """
    n, r = og.size, og.rank
    if n == 1:
        _timed(og, "slice 0", lambda: compute(0, shard))
        return
    shard = shard.contiguous()
    link = _Link(og, shard.device, "all-gather")
    buffers = [torch.empty_like(shard) for _ in range(n - 1)]

    def peers(step: int) -> tuple[int, int, int]:
        """(source, destination, owner of the received slice) of ``step`` (1-based)."""
        if og.mode == "direct":
            return (r - step) % n, (r + step) % n, (r - step) % n
        return (r - 1) % n, (r + 1) % n, (r - step) % n

    src, dst, _ = peers(1)
    pending = link.exchange(buffers[0], src, shard, dst, step=1)
    _timed(og, f"slice {r}", lambda: compute(r, shard))
    for step in range(1, n):
        src, _, owner = peers(step)
        link.wait(pending, True, src, f"receive of slice {owner} from rank {src}")
        if step + 1 < n:
            # Keep the next transfer running under this slice's compute; ring forwards what just came.
            next_src, next_dst, _ = peers(step + 1)
            outgoing = shard if og.mode == "direct" else buffers[step - 1]
            pending = link.exchange(buffers[step], next_src, outgoing, next_dst, step=step + 1)
        received = buffers[step - 1]
        _timed(og, f"slice {owner}", lambda owner=owner, received=received: compute(owner, received))
    link.finish()


def compute_reduce_scatter(compute: Callable[[int], torch.Tensor], og: OverlapGroup) -> torch.Tensor:
    """GEMM + reduce-scatter: ``compute(j)`` gives this rank's partial of rank j's slice; returns
    the sum over ranks of the partials of this rank's own slice.

    Slices owned by other ranks are computed first and sent as soon as each is ready; the own
    slice is computed last, while the last transfers complete, then the received partials are added.
    """
    n, r = og.size, og.rank
    if n == 1:
        return _timed(og, "slice 0", lambda: compute(0))
    link: _Link | None = None
    received: list[tuple[torch.Tensor, _Posted, int]] = []
    carried: tuple[torch.Tensor, _Posted] | None = None  # ring: the incoming running sum
    for step in range(1, n):
        if og.mode == "direct":
            owner, src, dst = (r + step) % n, (r - step) % n, (r + step) % n
        else:
            owner, src, dst = (r - step) % n, (r - 1) % n, (r + 1) % n
        part = _timed(og, f"slice {owner}", lambda owner=owner: compute(owner).contiguous())
        if link is None:
            link = _Link(og, part.device, "reduce-scatter")
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
    own = _timed(og, f"slice {r}", lambda: compute(r).contiguous())
    if og.mode == "ring":
        received.append((*carried, (r - 1) % n))
    for buf, posted, src in received:
        link.wait(posted, True, src, f"receive of a partial of slice {r} from rank {src}")
        own.add_(buf)
    link.finish()
    return own
