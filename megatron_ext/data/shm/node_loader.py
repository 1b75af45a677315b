"""The per-rank side of the shared-memory node loader: attach to the node's ring, copy batches out.

Set-up needs no store nor collective: the node's first rank creates the segment, waits until every
rank of the node has registered, removes the names and forks the producer; the others wait for the
name, check it is their user's own and register. Liveness is the kernel's answer about a peer's lock
on the ring file (``segment_file``), and every wait is bounded by ``timeout_s`` and tied to the
peer's life. Per step a rank waits for its slot, copies its stream's ids out (through a pinned
staging buffer, or straight from the ring with ``pinned_ring``), checks the checksum, releases the
slot and derives Megatron's batch on its device. The steps and their reasons:
docs/shm_data_loader.md, "How it works".
"""

from __future__ import annotations

import collections
import os
import time
import warnings
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from megatron_ext.data.batch import LoaderCounters, StageKeys, sequence_length
from megatron_ext.data.config import ShmDataLoaderConfig
from megatron_ext.data.dataset import SampleDataset
from megatron_ext.data.documents import MaskBuilder
from megatron_ext.data.samplers import SamplerSettings
from megatron_ext.data.shm.polling import wait_until
from megatron_ext.data.shm.producer import ProducerProcess
from megatron_ext.data.shm.ring import (
    VERSION,
    Ring,
    RingError,
    RingLayout,
    State,
    Writer,
    check_platform,
)
from megatron_ext.data.shm.segment import (
    abandon_segment,
    create_segment,
    creation_abandoned,
    open_segment,
    remove_segment,
    remove_stale_segments,
    was_abandoned,
)
from megatron_ext.data.token_ids import TextRules, TokenCodec, check_readable, derive_batch

_TORCH_DTYPES = {np.dtype(np.uint16): torch.uint16, np.dtype(np.int32): torch.int32}  # the ring's id types


class _Handle:
    """What closing needs, apart from the iterator, so a finalizer can close it without keeping it alive."""

    def __init__(self, local: int) -> None:
        self.local = local
        self.ring: Ring | None = None
        self.producer: ProducerProcess | None = None
        self.pinned: _PinnedRing | None = None

    def close(self) -> None:
        ring, self.ring = self.ring, None
        if ring is None:
            return
        try:
            if self.pinned is not None:
                self.pinned.close()  # copies in flight finish before the pages are unregistered
        finally:  # whatever CUDA says, the ring is left and the producer stopped
            ring.leave(self.local)
            if self.producer is not None:
                ring.close_for_all()
                self.producer.stop(timeout_s=2)  # past that it is stuck in a read: its work is moot now
            ring.close()  # a map the pinned pages still hold stays mapped (never freed under a copy)


class _PinnedRing:
    """The ring's pages registered as pinned host memory for this rank's CUDA copies, and the
    copies whose slots wait for their event before they are released."""

    def __init__(self, ring: Ring, device: torch.device) -> None:
        self._ring = ring
        self.device = device
        self.stream = torch.cuda.current_stream(device)
        """The stream the copies are queued on and their events recorded on."""
        # pins the map until close
        self._pages: np.ndarray | None = np.frombuffer(ring.segment.mm, dtype=np.uint8)
        self._ptr = self._pages.ctypes.data
        with torch.cuda.device(device):
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self._ptr, self._pages.nbytes, 0))
        self.in_flight: collections.deque[tuple[int, torch.cuda.Event]] = collections.deque()

    def copy(self, step: int, rows: np.ndarray) -> torch.Tensor:
        """Queue the copy of ``rows`` (a slot's ids, in the pinned ring) to the device; the slot is
        released once the event recorded after it has completed."""
        with torch.cuda.stream(self.stream):
            on_device = torch.from_numpy(rows).to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.in_flight.append((step, event))
        return on_device

    def release_copied(self, consumer: int, through: int) -> None:
        """Release, in order, every step whose copy has completed, and every step up to ``through``
        (waiting for its copy: the producer needs that slot back)."""
        while self.in_flight and (self.in_flight[0][0] <= through or self.in_flight[0][1].query()):
            step, event = self.in_flight.popleft()
            event.synchronize()
            self._ring.release(consumer, step)

    def close(self) -> None:
        """Wait for the copies in flight, then unregister the pages. If CUDA cannot say the copies
        are done (a failed context), the pages stay registered and mapped: a copy may still read them."""
        try:
            for _, event in self.in_flight:
                event.synchronize()
        except RuntimeError as e:
            warnings.warn(
                f"copies from the node loader's ring may still be running ({e}): its pages stay registered "
                "and mapped until the process ends",
                RuntimeWarning,
                stacklevel=2,
            )
            return  # _pages stays referenced: the map is never unmapped under a copy
        self.in_flight.clear()
        with torch.cuda.device(self.device):
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self._ptr))
        self._pages = None


class ShmBatchIterator:
    """This rank's micro-batches from its node's ring. ``node_dp_ranks[i]`` is the DP rank of the
    node's i-th consumer; consumers with equal DP ranks read one stream."""

    def __init__(
        self,
        dataset: SampleDataset,
        settings: SamplerSettings,
        *,
        config: ShmDataLoaderConfig,
        path: str,
        local_index: int,
        node_dp_ranks: Sequence[int],
        rank: int,
        keys: StageKeys,
        device: torch.device | str | None = None,
    ) -> None:
        check_platform()  # before anything is created: refuses a machine whose ring it cannot order
        check_readable(dataset)
        self.counters = LoaderCounters()
        self.path = path
        self._keys = keys
        self._handle = _Handle(local_index)
        # Runs when the iterator is collected or at exit, whichever is first; holds no reference to it.
        self._finalizer = weakref.finalize(self, self._handle.close)
        self._timeout = config.timeout_s
        self._workers = config.workers
        self._local = local_index
        self._rank = rank
        self._device = torch.device("cpu" if device is None else device)
        self._rules = TextRules.of(dataset)
        self._codec = TokenCodec.of(dataset)
        self._mask = MaskBuilder(self._device) if self._keys.mask else None
        streams = sorted(set(node_dp_ranks))
        self._stream = streams.index(node_dp_ranks[local_index])
        self._layout = RingLayout(
            config.slots,
            len(streams),
            settings.micro_batch_size,
            sequence_length(dataset),
            len(node_dp_ranks),
            self._codec.token_bytes,
            self._rules.extra_token,
        )
        self._step = 0
        self._ended = False
        self.producer: ProducerProcess | None = None
        self._ring: Ring | None = None
        if local_index == 0:
            self._create_and_start(dataset, streams, settings)
        else:
            self._attach()
        assert self._ring is not None  # either way the ring is open now
        self._rows: list[np.ndarray] = [self._ring.tokens(slot, self._stream) for slot in range(config.slots)]
        if self._device.type == "cuda" and config.pinned_ring:
            self._handle.pinned = _PinnedRing(self._ring, self._device)

    # -- set-up ---------------------------------------------------------------------------------
    def _create_and_start(
        self, dataset: SampleDataset, streams: list[int], settings: SamplerSettings
    ) -> None:
        lay = self._layout
        segment = create_segment(self.path, lay.size, lay.header(os.getpid()), peers=lay.consumers > 1)
        self._ring = self._handle.ring = ring = Ring(segment, lay)
        try:
            remove_stale_segments(os.path.dirname(self.path))
            ring.register(self._local, os.getpid())

            def check() -> None:
                for c in range(1, lay.consumers):  # its own lock is no conflict to itself: skip index 0
                    pid = ring.consumer_pid(c)
                    if pid and not ring.consumer_alive(c):
                        raise RingError(f"local rank {c} (pid {pid}) attached to {self.path} and died")

            wait_until(
                lambda: all(ring.consumer_pid(c) for c in range(lay.consumers)),
                check,
                self._timeout,
                f"rank {self._rank} waited for the {lay.consumers} ranks of its node to attach to {self.path}",
                max_sleep_s=10e-3,
            )
            label = (
                f"the shared-memory producer of {os.path.basename(self.path)} (started by rank {self._rank})"
            )
            # Forked while the ring still has its name: the producer's lock goes on a description
            # opened by that name.
            self.producer = ProducerProcess(ring, dataset, streams, settings, label, self._workers)
            self._handle.producer = self.producer
            remove_segment(self.path)
        except BaseException as e:
            ring.fail(
                f"rank {self._rank}, the first of its node, failed to set up {self.path}: {e}",
                Writer.FIRST_RANK,
            )
            abandon_segment(self.path)  # ranks that have not opened it yet see the marker at once
            self.close()
            raise

    def _attach(self) -> None:
        def try_open() -> bool:
            segment = open_segment(self.path)
            if segment is None:
                return False
            ring = Ring.attach(segment)
            if not ring.is_current_version():
                ring.close()
                raise RingError(f"{self.path} is not a version-{VERSION} loader segment: remove it")
            if ring.state == State.FAILED:
                message = ring.error()
                ring.close()
                raise RingError(message)
            self._ring = self._handle.ring = ring
            ring.register(self._local, os.getpid())
            # Checked after registering, so the creator cannot die unseen in between: its name came
            # from this job's collective, so a creator gone is this job's first rank.
            if not ring.owner_alive():
                self._creator_died(f"pid {ring.owner_pid()}")
            return True

        def creator_alive() -> None:
            if creation_abandoned(self.path) or was_abandoned(self.path):
                self._creator_died("which had begun to create it")

        wait_until(
            try_open,
            creator_alive,
            self._timeout,
            f"rank {self._rank} waited for {self.path}, which the first rank of its node creates: did that "
            "rank fail, or use another job id or shm_dir?",
            max_sleep_s=20e-3,
        )
        assert self._ring is not None  # try_open succeeded
        theirs = self._ring.layout
        if theirs != self._layout:
            self.close()
            raise ValueError(
                f"rank {self._rank} expects ring geometry {self._layout} but {self.path} has {theirs}: every rank "
                "must pass the same settings and dataset"
            )

    def _creator_died(self, who: str) -> None:
        """The node's first rank failed or died before its producer took over: nobody else would
        remove its segment while the job lives, so this rank does, leaving the marker the node's
        other ranks find (the checks refuse anything not this user's)."""
        abandon_segment(
            self.path
        )  # a map stays open: a poll may still read it; close() or the finalizer ends it
        raise RingError(
            f"rank {self._rank}: the first rank of its node ({who}), which creates {self.path}, "
            "failed or died while the node's ranks attached (its own log has the cause); its segment is removed"
        )

    # -- iteration ------------------------------------------------------------------------------
    def _check_producer(self) -> None:
        ring = self._ring
        assert ring is not None  # checked while a step is awaited, with the ring open
        state = ring.state
        if state == State.FAILED:
            raise RingError(ring.error())
        if state == State.CLOSING:
            raise RingError(
                f"the first rank of this node closed the loader of {self.path} while rank {self._rank} "
                "still reads from it"
            )
        if state == State.CREATED:  # not started yet: its parent must be alive
            if not ring.owner_alive():
                self._creator_died(f"pid {ring.owner_pid()}")
            return
        if not ring.producer_alive():
            if ring.state == State.FAILED:  # it recorded its error and then exited: the error wins
                raise RingError(ring.error())
            raise RingError(
                f"the shared-memory producer of {self.path} (pid {ring.producer_pid()} in its PID namespace) "
                "died without a message: killed (out of memory? check dmesg) or its parent rank exited"
            )

    def __iter__(self) -> ShmBatchIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor | None]:
        if self._ended or self._ring is None:
            raise StopIteration
        ring, step, pinned = self._ring, self._step, self._handle.pinned
        slot = step % self._layout.slots
        if pinned is not None:
            pinned.release_copied(self._local, through=step - self._layout.slots)
        waited = wait_until(
            lambda: ring.holds(slot, step),
            self._check_producer,
            self._timeout,
            f"rank {self._rank} waited for step {step} (slot {slot}) of {self.path}",
            max_sleep_s=1e-3,
        )
        start = time.perf_counter()
        if ring.is_end(slot):
            self._ended = True
            raise StopIteration
        if pinned is None:
            ids = self._copy_out(self._rows[slot])
            ring.check_sealed(slot, self._stream, ids.numpy(), step)
            ring.release(self._local, step)
            stored = ids.to(self._device, non_blocking=True)
        else:
            ring.check_sealed(slot, self._stream, self._rows[slot], step)  # read in place, before the copy
            stored = pinned.copy(step, self._rows[slot])
        self._step += 1
        batch = derive_batch(self._codec.decode(stored), self._rules, self._keys.returned, self._mask)
        self.counters.batches += 1
        self.counters.wait_s += waited + time.perf_counter() - start
        if self._local == 0:
            self.counters.samples_read, self.counters.bytes_read = ring.progress()
        return self._keys.batch(batch)

    def _copy_out(self, rows: np.ndarray) -> torch.Tensor:
        """A slot's ids in memory of their own: on the CPU a fresh array; for a CUDA device a pinned
        staging buffer, whose copy to the device is then queued without a host wait (the caching
        host allocator keeps the buffer until that copy has run, so the slot is released at once)."""
        if self._device.type == "cpu":
            # never a view of the map: a tensor read after the map closes would crash the process
            return torch.from_numpy(rows.copy())
        staged = torch.empty(rows.shape, dtype=_TORCH_DTYPES[rows.dtype], pin_memory=True)
        staged.numpy()[...] = rows
        return staged

    def close(self) -> None:
        """Leave the ring. On the node's first rank, also stop the producer."""
        self._ring, self._rows = None, []  # the views first: they pin the map
        self._finalizer()
