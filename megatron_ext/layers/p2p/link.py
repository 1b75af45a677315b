"""The transfer layer under the Flash-Overlap schedules: the TP group, the P2P link, and its waits.

Each step posts its receive before its send (gloo writes only once the peer's receive is posted).
On CUDA a wait only orders the compute stream after the transfer, so the host runs ahead and CUDA
graphs can capture the layer; a dead peer is the process group's watchdog's to report. On gloo the
transfers are posted from one background thread and every wait is bounded by ``timeout_s``: a
silent peer raises :class:`PeerTimeoutError` naming the peer and the layer. Details:
docs/flash_overlap.md."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from mdsp_base import dispatch
from megatron_ext.layers.config import Mode

DEFAULT_TIMEOUT_S = 300.0
# torch's switch that makes NCCL's work.wait() block the host (the second name is its older spelling).
BLOCKING_WAIT_VARS = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")


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
    mode: Mode = Mode.DIRECT
    """``direct``: step k exchanges with the ranks k away; ``ring``: always with the neighbours."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Seconds any single wait may take on gloo before :class:`PeerTimeoutError`. Not used on NCCL,
    whose waits only order the compute stream: the process group's own timeout applies there."""
    name: str = "flash_overlap"
    """Layer name used in error messages."""
    trace: Trace | None = None
    """Optional recorder of compute slices and waits (benchmarks)."""
    compute_slices: int = 0
    """GEMMs each fused all-gather or reduce-scatter is computed in: 0, one per rank's slice (the
    finest overlap); 2 .. TP-1 merge the slices of consecutive steps into fewer, larger GEMMs."""

    def __post_init__(self) -> None:
        if self.mode not in tuple(Mode):
            raise ValueError(
                f"P2P mode '{self.mode}' of layer {self.name!r} is unknown: use one of {', '.join(Mode)}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} of layer {self.name!r} must be positive")
        if self.compute_slices < 0 or self.compute_slices == 1:
            raise ValueError(
                f"compute_slices={self.compute_slices} of layer {self.name!r}: one GEMM leaves nothing to "
                "overlap; use 0 (one GEMM per rank's slice) or 2 and up"
            )

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size()

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank()


def cuda_backend(group: dist.ProcessGroup) -> str:
    """The group's backend for CUDA tensors ("nccl", "gloo", ...; "cpu:gloo,cuda:nccl" gives "nccl")."""
    name = str(dist.get_backend(group))
    per_device = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
    return per_device.get("cuda", name)


def run_device(weight: torch.Tensor | None) -> torch.device:
    """Where a layer's GEMMs will run: its weight's accelerator, or the current CUDA device for
    weights initialised on the CPU (``use_cpu_initialization``) or not allocated, else the CPU."""
    if weight is not None and weight.device.type not in ("cpu", "meta"):
        return weight.device
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def check_nccl_waits(og: OverlapGroup, device: torch.device, env: Mapping[str, str] = os.environ) -> None:
    """Warn, by name, about a setting that makes the CUDA waits block the host: the schedules rely on
    ``work.wait()`` only ordering the compute stream (the host queues the next GEMMs meanwhile and
    CUDA graphs can capture the layer); with blocking waits the host stops at every transfer and
    capture fails. Called where the layers are built; nothing to check off CUDA or NCCL."""
    if og.group is None or device.type != "cuda" or cuda_backend(og.group) != "nccl":
        return
    for name in BLOCKING_WAIT_VARS:
        if env.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off"):
            warnings.warn(
                f"{name}={env[name]} makes every wait of layer {og.name!r} block the host until its "
                "transfer ends: the host no longer queues work ahead of the transfers and CUDA graphs "
                f"cannot capture the layer; unset {name} (the NCCL watchdog still reports a dead peer "
                "after the process group's timeout)",
                RuntimeWarning,
                stacklevel=3,
            )


_posters: dict[int, ThreadPoolExecutor] = {}


def _poster() -> ThreadPoolExecutor:
    """The thread that posts gloo transfers. A send whose receiver already waits is written to the
    socket inside the posting call (milliseconds on a slow link), so the compute thread must not be
    the one posting. One per process id: a forked child does not inherit the parent's thread."""
    pid = os.getpid()
    if pid not in _posters:
        _posters[pid] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flash-overlap-p2p")
    return _posters[pid]


def shutdown_posters() -> None:
    """Stop this process's posting thread after the transfers it holds (the next P2P step starts a
    new one); the one process-wide thing the Flash-Overlap layers create."""
    poster = _posters.pop(os.getpid(), None)
    if poster is not None:
        poster.shutdown(wait=True)


class Posted:
    """One step's batch of P2P ops; its works exist once the batch has been issued."""

    def __init__(self, works: Future, receives: int, ops: int) -> None:
        self.works, self.receives, self.ops = works, receives, ops

    def guards(self, receive: bool, timeout_s: float) -> list[dist.Work]:
        """The works guarding the receive (or the send) of the step."""
        works = self.works.result(timeout=timeout_s)
        if len(works) != self.ops:  # coalescing backends (NCCL): one work for the whole batch
            return works
        return works[: self.receives] if receive else works[self.receives :]


class Link:
    """Issues one step's receive + send and waits on it: stream-ordered on CUDA, within the timeout
    on CPU (posted by the posting thread)."""

    def __init__(self, og: OverlapGroup, device: torch.device, what: str) -> None:
        self.og = og
        self.what = what
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute_stream = torch.cuda.current_stream(device)
        self.sends: list[tuple[Posted, int]] = []

    def _global(self, group_rank: int) -> int:
        assert self.og.group is not None  # a link joins ranks of a group
        return dist.get_global_rank(self.og.group, group_rank)

    def exchange(
        self, recv_buf: torch.Tensor | None, src: int, send_buf: torch.Tensor | None, dst: int, step: int
    ) -> Posted:
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
            # one thread: batches stay in order; under the caller's modes that follow work (an
            # emulated device makes a send wait for the kernel that writes its buffer, as NCCL's does)
            works = _poster().submit(dispatch.carried(dist.batch_isend_irecv), ops)
        posted = Posted(works, int(recv_buf is not None), len(ops))
        if send_buf is not None:
            self.sends.append((posted, dst))
        return posted

    def wait(self, posted: Posted, receive: bool, peer: int, label: str) -> None:
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
            raise PeerTransferError(
                f"{context}: posting the transfer took over {self.og.timeout_s:g} s"
            ) from e
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
