"""The node's producer: reads every sample the node's ranks need, once, into the ring.

The node's first rank forks it (``os.fork``, as torch's DataLoader forks its workers) so that the
dataset's memory maps are shared copy-on-write, the start costs milliseconds and the reads' page
faults never stall a training thread; it touches neither CUDA nor torch.distributed. With
``workers`` > 1 worker ``w`` fills the steps ``s`` with ``s % workers == w``, each in its own slot,
so the ranks still receive every step in Megatron's order. The producer is alive while it holds the
ring's producer lock; a failure is written into the header, where every rank finds and raises it.
Details: docs/shm_data_loader.md, "How it works".
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import sys
import time
import traceback
import warnings
from collections import deque
from collections.abc import Sequence
from typing import cast

import torch

from megatron_ext.data.batch import sample_bytes
from megatron_ext.data.dataset import SampleDataset
from megatron_ext.data.samplers import EpochPermutations, SamplerSettings
from megatron_ext.data.shm.polling import wait_until
from megatron_ext.data.shm.readahead import READ_AHEAD_STEPS, ReadAhead
from megatron_ext.data.shm.ring import Ring, RingError, State, Writer
from megatron_ext.data.token_ids import TextReader, TokenCodec

_MESSAGE_BYTES = 1024  # a worker's failure message, through its pipe (the ring keeps less)
_PR_SET_PDEATHSIG = 1  # prctl option, <linux/prctl.h>
KILL_WAIT_S = 5.0  # SIGKILL takes effect at once unless the process sits in an uninterruptible read


class ProducerProcess:
    """The forked producer, seen from the rank that started it."""

    def __init__(
        self,
        ring: Ring,
        dataset: SampleDataset,
        dp_ranks: Sequence[int],
        settings: SamplerSettings,
        label: str,
        workers: int = 1,
    ) -> None:
        """Fork and run; ``dp_ranks[k]`` is the DP rank whose samples go to stream k. Returns once
        the child holds the producer's lock and the ring says it started."""
        self.exitcode: int | None = None
        lock_fd = ring.segment.new_description()
        try:
            ring.lock_for_producer(lock_fd)
            self.pid = os.fork()
        except BaseException:
            os.close(lock_fd)
            raise
        if self.pid:
            os.close(lock_fd)  # the lock is the child's alone now: it lives exactly as long as the child
            ring.start_producer(self.pid)
            return
        code = 1
        try:  # the child: never returns into the caller's stack
            ring.segment.adopt(lock_fd)
            torch.set_num_threads(1)  # one reader per process; the node's cores belong to training
            _skip_dataset_masks(dataset)
            job = _Job(ring, dataset, dp_ranks, settings, label)
            if workers == 1:
                _produce(job, worker=0, worker_count=1)
            else:
                _supervise(job, workers)
            code = 0
        except BaseException as e:
            if ring.state != State.CLOSING:
                ring.fail(f"{label} failed: {_describe(e)}", Writer.PRODUCER)
            traceback.print_exc()
        finally:
            os._exit(code)  # no atexit handlers or finalizers of the parent's objects (process groups)

    def poll(self) -> int | None:
        """The exit code once the process has ended (and is reaped), else None."""
        if self.exitcode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.exitcode = os.waitstatus_to_exitcode(status)
        return self.exitcode

    def stop(self, timeout_s: float, kill_wait_s: float = KILL_WAIT_S) -> int | None:
        """Wait up to ``timeout_s`` for it to leave (after it was asked to), then kill it and wait up
        to ``kill_wait_s`` more. None: it outlived SIGKILL (a read stuck in the kernel, e.g. on a hung
        filesystem); it is left to be reaped later (``poll``) rather than hang this rank."""
        deadline = time.monotonic() + timeout_s
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.exitcode is None:
            os.kill(self.pid, signal.SIGKILL)
            deadline = time.monotonic() + kill_wait_s
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if self.exitcode is None:
                warnings.warn(
                    f"the shared-memory producer (pid {self.pid}) did not exit within {kill_wait_s:.0f} s "
                    "of SIGKILL (stuck in an uninterruptible read?): leaving it",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return self.exitcode


def _skip_dataset_masks(dataset: SampleDataset) -> None:
    """Stop the dataset from building attention masks in this (forked) process: the ring carries
    none, ranks build theirs on their own device, and a GPTDataset asked for masks would build a
    [1, s, s] one per sample here (s x s bytes: 64 MiB at s=8192)."""
    for d in (dataset, *getattr(dataset, "datasets", ())):
        config = getattr(d, "config", None)
        if config is not None and getattr(config, "create_attention_mask", False):
            config.create_attention_mask = False


@dataclasses.dataclass(frozen=True)
class _Job:
    """What every worker of the producer needs."""

    ring: Ring
    dataset: SampleDataset
    dp_ranks: Sequence[int]
    settings: SamplerSettings
    label: str


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"


def _supervise(job: _Job, workers: int) -> None:
    """Fork the workers and wait for them; the first that fails fails the ring with its message."""
    children: dict[int, tuple[int, int]] = {}  # pid -> (worker, read end of its message pipe)
    parent = os.getpid()
    for w in range(workers):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            _run_worker(job, w, workers, write, parent)
        os.close(write)
        children[pid] = (w, read)
    try:
        while children:
            pid, status = os.waitpid(-1, 0)  # blocks until a worker ends: they end on their own
            w, read = children.pop(pid)
            message = os.read(read, _MESSAGE_BYTES).decode("utf-8", "replace")
            os.close(read)
            code = os.waitstatus_to_exitcode(status)
            if code != 0:
                cause = message or (f"killed by signal {-code}" if code < 0 else f"exit code {code}")
                raise RingError(f"worker {w} of {workers} (pid {pid}) failed: {cause}")
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        for pid in children:
            os.waitpid(pid, 0)


def _run_worker(job: _Job, worker: int, workers: int, message_pipe: int, parent: int) -> None:
    """A worker's whole life: never returns into the producer's stack."""
    code = 1
    try:
        _die_with_parent(parent)
        _produce(job, worker, workers)
        code = 0
    except BaseException as e:
        if job.ring.state != State.CLOSING:
            os.write(message_pipe, _describe(e).encode("utf-8", "replace")[:_MESSAGE_BYTES])
        traceback.print_exc()
    finally:
        os._exit(code)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this worker when the producer dies (Linux); a producer that died already: leave now."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it died before the prctl took effect
        raise _Stop


def _produce(job: _Job, worker: int, worker_count: int) -> None:
    """Fill the steps ``s`` with ``s % worker_count == worker`` until the data ends or the ranks leave."""
    ring, dataset, label = job.ring, job.dataset, job.label
    lay = ring.layout
    shared = EpochPermutations()  # every DP rank shuffles alike: one permutation per epoch for the node
    streams = [job.settings.batches(len(dataset), r, shared) for r in job.dp_ranks]
    rows = [[ring.tokens(slot, k) for k in range(lay.streams)] for slot in range(lay.slots)]
    per_sample = sample_bytes(dataset)
    reader, codec = TextReader(dataset), TokenCodec.of(dataset)
    samples = 0

    def check() -> None:
        if ring.state == State.CLOSING:
            raise _Stop
        for c in range(lay.consumers):
            if not ring.has_left(c) and not ring.consumer_alive(c):
                raise RingError(
                    f"{label}: local rank {c} of the node (pid {ring.consumer_pid(c)} in its PID namespace) "
                    "died without closing the loader; its error is in that rank's log"
                )

    # This worker's steps run READ_AHEAD_STEPS ahead of the one being filled; each step's samples are
    # handed to the kernel as soon as they are drawn, so their reads overlap the steps before them.
    read_ahead = ReadAhead(dataset)
    pending: deque[tuple[int, list[list[int] | None]]] = deque()
    drawn_steps, exhausted = 0, False
    try:
        while True:
            while len(pending) <= READ_AHEAD_STEPS and not exhausted:
                drawn = [next(s, None) for s in streams]
                exhausted = any(b is None for b in drawn)
                if exhausted or drawn_steps % worker_count == worker:  # every worker sees the end
                    if not exhausted:
                        read_ahead.advise(i for b in cast(list[list[int]], drawn) for i in b)
                    pending.append((drawn_steps, drawn))
                drawn_steps += 1
            step, batches = pending.popleft()
            slot = step % lay.slots
            done = step - lay.slots + 1  # every rank must have released this many steps
            wait_until(
                lambda done=done: ring.released_by_all(done),  # type: ignore[misc]  # mypy infers no lambda with defaults
                check,
                None,
                f"{label} waited for the node's ranks to release slot {slot}",
                max_sleep_s=5e-3,
            )
            if all(ring.has_left(c) for c in range(lay.consumers)):
                return
            if any(b is None for b in batches):  # a single-pass sampler ran out: the same step on every rank
                if step % worker_count == worker:
                    ring.publish(slot, step, end=True)
                return
            for k, batch in enumerate(cast(list[list[int]], batches)):  # none is None: returned above
                for j, idx in enumerate(batch):
                    codec.encode(reader.read(idx), rows[slot][k][j], where=f"sample {idx}")
                ring.seal(slot, k)
                samples += len(batch)
            ring.set_progress(worker, samples, samples * per_sample)
            ring.publish(slot, step)
    except _Stop:
        return
    finally:
        read_ahead.close()


class _Stop(Exception):
    """The node's first rank closed the loader: leave quietly."""
