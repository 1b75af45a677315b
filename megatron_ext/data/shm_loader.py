"""The per-rank side of the shared-memory node loader: attach to the node's ring, copy batches out.

Set-up, without any store or collective: the node's first rank removes dead jobs' segments, checks
the space, creates the segment (a private 0700 directory with an unguessable name holding the 0600
ring, header first, then renamed into place), registers itself and waits until every rank of the
node has registered; it then removes the names (the mappings stay valid, so neither a normal exit
nor a kill leaves a file behind) and forks the producer. The other ranks wait for the name to
appear, refuse anything that is not their user's own (``shm_segment``) or whose owner is dead, and
register. Every wait is bounded by ``timeout_s`` and tied to the first rank's life: a rank that finds
it dead removes its segment (its name came from this job's collective, so it is this job's) and
raises at once. x86-64 and aarch64 run it (``ordering``).

With pipeline parallelism only first- and last-stage ranks are consumers (``loader`` leaves middle
stages out); each copies out the keys of its stage (``keys``). A loader dropped without ``close()``
is closed by its finalizer when it is collected, so its producer never outlives it.

Per step, a rank waits for its slot's sequence word, copies its stream into fresh tensors (a tensor
must never view the map: reading it after the map closes would crash), builds the attention mask
when asked, and releases the slot.
"""

from __future__ import annotations

import dataclasses
import os
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megatron_ext.data.batch import (
    STORED_KEYS,
    LoaderCounters,
    StageKeys,
    sequence_length,
)
from megatron_ext.data.config import ShmDataLoaderConfig
from megatron_ext.data.documents import MaskBuilder, separates_documents
from megatron_ext.data.producer import ProducerProcess
from megatron_ext.data.ring import (
    VERSION,
    Ring,
    RingError,
    RingLayout,
    State,
    Writer,
    check_platform,
    wait_until,
)
from megatron_ext.data.samplers import SamplerSettings
from megatron_ext.data.shm_segment import (
    create_segment,
    is_alive,
    open_segment,
    process_start_time,
    remove_segment,
    remove_stale_segments,
)

_DTYPES = {**dict(STORED_KEYS), "documents": torch.int32}


class _Handle:
    """What closing needs, apart from the iterator, so a finalizer can close it without keeping it alive."""

    def __init__(self, local: int) -> None:
        self.local = local
        self.ring: Ring | None = None
        self.producer: ProducerProcess | None = None

    def close(self) -> None:
        ring, self.ring = self.ring, None
        if ring is None:
            return
        ring.leave(self.local)
        if self.producer is not None:
            ring.close_for_all()
            self.producer.stop(timeout_s=2)  # past that it is stuck in a read: its work is moot now
        try:
            ring.mm.close()
        except BufferError:  # a caller still holds a view of the map: it is unmapped when that dies
            pass


class ShmBatchIterator:
    """This rank's micro-batches from its node's ring. ``node_dp_ranks[i]`` is the DP rank of the
    node's i-th consumer; consumers with equal DP ranks read one stream. ``creator``: pid and start
    time of the node's first consumer, which creates the ring (None: judged by the ring's header only)."""

    def __init__(
        self,
        dataset: Any,
        settings: SamplerSettings,
        *,
        config: ShmDataLoaderConfig,
        path: str,
        local_index: int,
        node_dp_ranks: Sequence[int],
        rank: int,
        keys: StageKeys,
        device: torch.device | str | None = None,
        creator: tuple[int, int] | None = None,
    ) -> None:
        check_platform()  # before anything is created: refuses a machine whose ring it cannot order
        self.counters = LoaderCounters()
        self.path = path
        self._keys = keys
        self._creator = creator
        self._handle = _Handle(local_index)
        # Runs when the iterator is collected or at exit, whichever is first; holds no reference to it.
        self._finalizer = weakref.finalize(self, self._handle.close)
        self._timeout = config.timeout_s
        self._workers = config.workers
        self._local = local_index
        self._rank = rank
        self._device = torch.device("cpu" if device is None else device)
        self._mask = MaskBuilder(self._device) if self._keys.mask else None
        self._documents = self._keys.mask and separates_documents(dataset)  # else the mask is causal only
        streams = sorted(set(node_dp_ranks))
        self._stream = streams.index(node_dp_ranks[local_index])
        self._layout = RingLayout(
            config.slots,
            len(streams),
            settings.micro_batch_size,
            sequence_length(dataset),
            len(node_dp_ranks),
        )
        self._step = 0
        self._ended = False
        self.producer: ProducerProcess | None = None
        self._ring: Ring | None = None
        if local_index == 0:
            self._create_and_start(dataset, streams, settings)
        else:
            self._attach()
        copied = set(self._keys.returned) | ({"documents"} if self._documents else set())
        self._views = [
            {k: v for k, v in self._ring.arrays(slot, self._stream).items() if k in copied}
            for slot in range(config.slots)
        ]

    # -- set-up ---------------------------------------------------------------------------------
    def _register(self) -> None:
        self._ring.register(self._local, os.getpid(), process_start_time(os.getpid()))

    def _create_and_start(self, dataset: Any, streams: list[int], settings: SamplerSettings) -> None:
        remove_stale_segments(os.path.dirname(self.path))
        lay = self._layout
        mm = create_segment(self.path, lay.size, lay.header(os.getpid(), process_start_time(os.getpid())))
        self._ring = self._handle.ring = ring = Ring(mm, lay)
        try:
            self._register()

            def check() -> None:
                for c in range(lay.consumers):
                    pid, start = ring.consumer(c)
                    if pid and not is_alive(pid, start):
                        raise RingError(f"local rank {c} (pid {pid}) attached to {self.path} and died")

            wait_until(
                lambda: all(ring.consumer(c)[0] for c in range(lay.consumers)),
                check,
                self._timeout,
                f"rank {self._rank} waited for the {lay.consumers} ranks of its node to attach to {self.path}",
                max_sleep_s=10e-3,
            )
            remove_segment(self.path)
            label = (
                f"the shared-memory producer of {os.path.basename(self.path)} (started by rank {self._rank})"
            )
            self.producer = ProducerProcess(ring, dataset, streams, settings, label, self._workers)
            self._handle.producer = self.producer
            ring.start_producer(self.producer.pid, process_start_time(self.producer.pid) or -1)
        except BaseException as e:
            ring.fail(
                f"rank {self._rank}, the first of its node, failed to set up {self.path}: {e}",
                Writer.FIRST_RANK,
            )
            remove_segment(self.path)
            self.close()
            raise

    def _attach(self) -> None:
        def try_open() -> bool:
            mm = open_segment(self.path)
            if mm is None:
                return False
            ring = Ring.attach(mm)
            if not ring.is_current_version():
                mm.close()
                raise RingError(f"{self.path} is not a version-{VERSION} loader segment: remove it")
            if ring.state == State.FAILED:
                message = ring.error()
                mm.close()
                raise RingError(message)
            self._ring = self._handle.ring = ring
            self._register()
            # Checked after registering, so the creator cannot die unseen in between: its name came
            # from this job's collective, so a dead owner is this job's first rank.
            owner = ring.owner()
            if not is_alive(*owner):
                self._creator_died(owner[0])
            return True

        def creator_alive() -> None:
            if self._creator is not None and not is_alive(*self._creator):
                self._creator_died(self._creator[0])

        wait_until(
            try_open,
            creator_alive,
            self._timeout,
            f"rank {self._rank} waited for {self.path}, which the first rank of its node creates: did that "
            "rank fail, or use another job id or shm_dir?",
            max_sleep_s=20e-3,
        )
        theirs = dataclasses.astuple(self._ring.layout)
        if theirs != dataclasses.astuple(self._layout):
            self.close()
            raise ValueError(
                f"rank {self._rank} expects ring geometry {self._layout} but {self.path} has "
                f"(slots, streams, mbs, seq_length, ranks) = {theirs}: every rank must pass the same settings"
            )

    def _creator_died(self, pid: int) -> None:
        """The node's first rank died before its producer took over: nobody else would remove its
        segment while the job lives, so this rank does (the checks refuse anything not this user's)."""
        remove_segment(
            self.path
        )  # the map stays open: a poll may still read it; close() or the finalizer ends it
        raise RingError(
            f"rank {self._rank}: the first rank of its node (pid {pid}), which creates {self.path}, "
            "died while the node's ranks attached (its own log has the cause); its segment is removed"
        )

    # -- iteration ------------------------------------------------------------------------------
    def _check_producer(self) -> None:
        ring = self._ring
        state = ring.state
        if state == State.FAILED:
            raise RingError(ring.error())
        if state == State.CLOSING:
            raise RingError(
                f"the first rank of this node closed the loader of {self.path} while rank {self._rank} "
                "still reads from it"
            )
        pid, start = ring.producer()
        if not pid:  # not started yet: its parent must be alive
            pid, start = ring.owner()
            if not is_alive(pid, start):
                self._creator_died(pid)
        if not is_alive(pid, start):
            raise RingError(
                f"the shared-memory producer of {self.path} (pid {pid}) died without a message: "
                "killed (out of memory? check dmesg) or its parent rank exited"
            )

    def __iter__(self) -> ShmBatchIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor | None]:
        if self._ended or self._ring is None:
            raise StopIteration
        ring, step = self._ring, self._step
        slot = step % self._layout.slots
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
        batch = {key: self._copy_out(view, _DTYPES[key]) for key, view in self._views[slot].items()}
        ring.release(self._local, step)
        self._step += 1
        if self._mask is not None:
            documents = batch.pop("documents", None)
            batch["attention_mask"] = self._mask.build(
                self._layout.micro_batch_size, self._layout.seq_length, documents
            )  # on the device
        self.counters.batches += 1
        self.counters.wait_s += waited + time.perf_counter() - start
        if self._local == 0:
            self.counters.samples_read, self.counters.bytes_read = ring.progress()
        return self._keys.batch(batch)

    def _copy_out(self, view: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        if self._device.type == "cpu":
            return torch.from_numpy(view.copy())
        # Pinned staging: the host-to-device copy is queued on the current stream without a host
        # wait (a pageable source would synchronise the stream). The caching host allocator keeps the
        # buffer until that copy has run, so the slot can be released at once.
        staged = torch.empty(view.shape, dtype=dtype, pin_memory=True)
        staged.numpy()[...] = view
        return staged.to(self._device, non_blocking=True)

    def close(self) -> None:
        """Leave the ring. On the node's first rank, also stop the producer."""
        self._ring, self._views = None, []  # the views first: they pin the map
        self._finalizer()
