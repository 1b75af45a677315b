"""Layout of the node's ring in shared memory, and the polling waits of both sides.

One segment per node: a header, a table with one entry per rank of the node (consumer), a table
with one entry per slot, then the slots. A slot holds one step: for each distinct DP rank on the
node (a *stream*) its micro-batch of tokens, labels, position_ids, loss_mask and document ids. Ranks that share
a DP rank (TP and CP peers) read the same stream.

Synchronisation is by counters only, no locks: the producer fills slot ``step % slots`` and then
writes ``step`` into the slot's sequence word; a consumer waits for that word, copies its stream
out and then stores ``step + 1`` into its own release word; the producer reuses a slot once every
consumer's release word has passed it. Each word has a single writer and is an aligned 8-byte
native store (``struct`` native format, one ``memcpy``), so a reader never sees it torn. Every word
that announces a payload (a slot's step, a release, a consumer's or the producer's pid, a failure)
is stored after a release fence, and read before an acquire fence (``ordering``): free on x86-64,
real barriers on aarch64. Every wait polls with a short, growing sleep and checks the other side's
liveness (pid plus start time, which also catches zombies and reused pids). A rank waiting for data
gives up after ``timeout_s``; the producer waiting for ranks to release a slot waits as long as they
live, because a live rank may rightly stop reading for long (a validation loader between
evaluations, a checkpoint save): it stops when one of them dies (and raises) or when all have closed.

The ring's state is not one word that several processes overwrite but one flag per writer, never
cleared: the producer's failure, the first rank's failure, the first rank's close, the producer's
pid. A failure therefore always wins, whoever writes last, and each writer's message has its own
area, so the producer's first error reaches every rank even when its parent fails too.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import time
from collections.abc import Callable

import numpy as np

from megatron_ext.data.ordering import Fences, fences_for
from megatron_ext.data.shm_segment import MAGIC

VERSION = 3  # 2: document ids beside the tokens; 3: a flag per state writer, progress per worker
_WORD = struct.Struct("q")  # native: one aligned 8-byte store or load
MAX_WORKERS = 8  # producer workers with a progress entry in the header

# Words of the layout; only Ring's methods below read or write them.
# header words
_MAGIC, _OWNER_PID, _OWNER_START, _VERSION, _PRODUCER_FAILED, _PRODUCER_PID, _PRODUCER_START = range(7)
_RANK_FAILED, _CLOSING, _SLOTS, _STREAMS, _MBS, _SEQ_LENGTH, _CONSUMERS = range(7, 14)
_GEOMETRY = (_SLOTS, _STREAMS, _MBS, _SEQ_LENGTH, _CONSUMERS)
_PROGRESS = 16  # per worker: samples read, bytes of the .bin they span
_ERROR_OFFSET, _ERROR_BYTES = 256, 896  # per failure flag: a message, UTF-8, NUL padded
_CONSUMERS_OFFSET = _ERROR_OFFSET + 2 * _ERROR_BYTES
_CONSUMER_WORDS = 4
_PID, _START, _RELEASED, _CLOSED = range(_CONSUMER_WORDS)  # a consumer entry: who, and how far it got
_SLOT_WORDS = 2
_STEP, _END = range(_SLOT_WORDS)  # a slot entry: the step it holds, and whether that step is end-of-data


class State(enum.IntEnum):
    """Life of a ring, as its header's flags give it (a failure outranks everything)."""

    CREATED = 0
    """The first rank made it; the node's ranks are attaching."""
    RUNNING = 1
    """The producer is filling slots."""
    FAILED = 2
    """Someone wrote a failure message; every rank raises it."""
    CLOSING = 3
    """The first rank closed the loader; the producer leaves."""


class Writer(enum.IntEnum):
    """Who reports a failure: each has its own flag and message area in the header."""

    PRODUCER = 0
    """The producer process (or one of its workers, through it)."""
    FIRST_RANK = 1
    """The node's first rank, while it sets the ring up."""


_FAILED_FLAG = {Writer.PRODUCER: _PRODUCER_FAILED, Writer.FIRST_RANK: _RANK_FAILED}

# (key, numpy dtype): int64 arrays first so every array stays aligned. "documents" holds the
# document ids masks are built from (documents.py), written only with reset_attention_mask.
STREAM_ARRAYS = (
    ("tokens", np.int64),
    ("labels", np.int64),
    ("position_ids", np.int64),
    ("loss_mask", np.float32),
    ("documents", np.int32),
)


class RingError(RuntimeError):
    """The other side of the ring died, failed or did not answer in time."""


def check_platform() -> None:
    """Refuse, by name, a machine whose ring words this code cannot order (``ordering``)."""
    fences_for()


@dataclasses.dataclass(frozen=True)
class RingLayout:
    slots: int
    streams: int
    micro_batch_size: int
    seq_length: int
    consumers: int

    @property
    def region_bytes(self) -> int:
        per_token = sum(np.dtype(dt).itemsize for _, dt in STREAM_ARRAYS)
        return -(-self.micro_batch_size * self.seq_length * per_token // 64) * 64

    @property
    def slot_table_offset(self) -> int:
        return _CONSUMERS_OFFSET + 8 * _CONSUMER_WORDS * self.consumers

    @property
    def data_offset(self) -> int:
        return -(-(self.slot_table_offset + 8 * _SLOT_WORDS * self.slots) // 4096) * 4096

    @property
    def size(self) -> int:
        return self.data_offset + self.slots * self.streams * self.region_bytes

    def header(self, owner_pid: int, owner_start: int) -> bytes:
        """Everything before the slots' data, as the creator writes it."""
        buf = bytearray(self.data_offset)
        words = {
            _MAGIC: MAGIC,
            _OWNER_PID: owner_pid,
            _OWNER_START: owner_start,
            _VERSION: VERSION,
            **dict(zip(_GEOMETRY, dataclasses.astuple(self))),
        }
        for word, value in words.items():
            _WORD.pack_into(buf, 8 * word, value)
        for slot in range(self.slots):
            _WORD.pack_into(buf, self.slot_table_offset + 8 * _SLOT_WORDS * slot, -1)  # no step held yet
        return bytes(buf)


class Ring:
    """The protocol over a mapped segment: each method reads or writes the words one step of it
    needs, in the order that step needs, with the fences that order them against their payloads.
    Holds no buffer exports, so the map can always be closed."""

    def __init__(self, mm, layout: RingLayout, fences: Fences | None = None) -> None:
        self.mm = mm
        self.layout = layout
        self.fences = fences_for() if fences is None else fences

    @classmethod
    def attach(cls, mm, fences: Fences | None = None) -> Ring:
        """Read the layout from a mapped segment's header."""
        return cls(mm, RingLayout(*(_WORD.unpack_from(mm, 8 * w)[0] for w in _GEOMETRY)), fences)

    def _get(self, word: int) -> int:
        return _WORD.unpack_from(self.mm, 8 * word)[0]

    def _set(self, word: int, value: int) -> None:
        _WORD.pack_into(self.mm, 8 * word, value)

    def _publish(self, word: int, value: int) -> None:
        """Store a word that announces what was written before it."""
        self.fences.release()
        self._set(word, value)

    def _observe(self, word: int) -> int:
        """Load a word that announces a payload, before reading that payload."""
        value = self._get(word)
        self.fences.acquire()
        return value

    def _consumer(self, consumer: int, field: int) -> int:
        return _CONSUMERS_OFFSET // 8 + _CONSUMER_WORDS * consumer + field

    def _slot(self, slot: int, field: int) -> int:
        return self.layout.slot_table_offset // 8 + _SLOT_WORDS * slot + field

    # -- header ---------------------------------------------------------------------------------
    def is_current_version(self) -> bool:
        """The segment is a loader ring of this code's layout version."""
        return self._get(_MAGIC) == MAGIC and self._get(_VERSION) == VERSION

    @property
    def state(self) -> State:
        if any(self._observe(flag) for flag in _FAILED_FLAG.values()):
            return State.FAILED
        if self._get(_CLOSING):
            return State.CLOSING
        return State.RUNNING if self._get(_PRODUCER_PID) else State.CREATED

    def close_for_all(self) -> None:
        """The first rank leaves: the producer stops (a recorded failure still wins)."""
        self._set(_CLOSING, 1)

    def fail(self, message: str, writer: Writer) -> None:
        """Record ``writer``'s failure; the first message of each writer is kept."""
        if self._get(_FAILED_FLAG[writer]):
            return
        offset = _ERROR_OFFSET + writer * _ERROR_BYTES
        data = message.encode("utf-8", errors="replace")[: _ERROR_BYTES - 1]
        self.mm[offset : offset + _ERROR_BYTES] = data.ljust(_ERROR_BYTES, b"\0")
        self._publish(_FAILED_FLAG[writer], 1)  # after the message: a reader that sees the flag finds it

    def error(self) -> str:
        """The recorded failures, the producer's first."""
        messages = []
        for writer, flag in _FAILED_FLAG.items():
            if self._observe(flag):
                offset = _ERROR_OFFSET + writer * _ERROR_BYTES
                text = bytes(self.mm[offset : offset + _ERROR_BYTES]).rstrip(b"\0")
                messages.append(text.decode("utf-8", "replace"))
        return "\nthen: ".join(messages)

    def owner(self) -> tuple[int, int]:
        """Pid and start time of the rank that created the segment."""
        return self._get(_OWNER_PID), self._get(_OWNER_START)

    def producer(self) -> tuple[int, int]:
        """Pid and start time of the producer; pid 0 before it started."""
        return self._observe(_PRODUCER_PID), self._get(_PRODUCER_START)

    def start_producer(self, pid: int, start: int) -> None:
        """Record the forked producer. Writes no state: a failure it already recorded stays."""
        self._set(_PRODUCER_START, start)
        self._publish(_PRODUCER_PID, pid)  # after its start time: a reader that sees the pid can check it

    def progress(self) -> tuple[int, int]:
        """Samples the producer's workers have read, and the bytes of the ``.bin`` they span."""
        words = [self._get(_PROGRESS + i) for i in range(2 * MAX_WORKERS)]
        return sum(words[0::2]), sum(words[1::2])

    def set_progress(self, worker: int, samples: int, nbytes: int) -> None:
        self._set(_PROGRESS + 2 * worker, samples)
        self._set(_PROGRESS + 2 * worker + 1, nbytes)

    # -- consumers ------------------------------------------------------------------------------
    def register(self, consumer: int, pid: int, start: int) -> None:
        self._set(self._consumer(consumer, _START), start)
        self._publish(self._consumer(consumer, _PID), pid)  # last: marks the entry complete

    def consumer(self, consumer: int) -> tuple[int, int]:
        """Pid and start time of a consumer; pid 0 before it registered."""
        return self._observe(self._consumer(consumer, _PID)), self._get(self._consumer(consumer, _START))

    def release(self, consumer: int, step: int) -> None:
        """The consumer is done with ``step`` (its copies are made): its slot may be refilled."""
        self._publish(self._consumer(consumer, _RELEASED), step + 1)

    def leave(self, consumer: int) -> None:
        """The consumer reads no more: the producer no longer waits for it."""
        self._publish(self._consumer(consumer, _CLOSED), 1)

    def has_left(self, consumer: int) -> bool:
        return self._get(self._consumer(consumer, _CLOSED)) != 0

    def released_by_all(self, steps: int) -> bool:
        """Every consumer has released ``steps`` steps or left (then the slot may be overwritten)."""
        done = all(
            self.has_left(c) or self._get(self._consumer(c, _RELEASED)) >= steps
            for c in range(self.layout.consumers)
        )
        if done:
            self.fences.acquire()  # the refill's stores stay after the consumers' copies
        return done

    # -- slots ----------------------------------------------------------------------------------
    def publish(self, slot: int, step: int, end: bool = False) -> None:
        """Hand ``slot`` (filled with ``step``, or marking the end of the data) to the consumers."""
        self._set(self._slot(slot, _END), int(end))
        self._publish(self._slot(slot, _STEP), step)  # last: publishes the payload and the end mark

    def holds(self, slot: int, step: int) -> bool:
        """``slot`` has been published with ``step`` (its payload may be read once this is true)."""
        held = self._get(self._slot(slot, _STEP)) == step
        if held:
            self.fences.acquire()
        return held

    def is_end(self, slot: int) -> bool:
        """The published slot marks the end of the data."""
        return self._get(self._slot(slot, _END)) != 0

    def arrays(self, slot: int, stream: int) -> dict[str, np.ndarray]:
        """Views of one stream of one slot. They pin the map: drop them before closing it."""
        lay = self.layout
        offset = lay.data_offset + (slot * lay.streams + stream) * lay.region_bytes
        shape = (lay.micro_batch_size, lay.seq_length)
        views = {}
        for key, dtype in STREAM_ARRAYS:
            views[key] = np.frombuffer(
                self.mm, dtype=dtype, count=shape[0] * shape[1], offset=offset
            ).reshape(shape)
            offset += views[key].nbytes
        return views


def wait_until(
    ready: Callable[[], bool],
    check: Callable[[], None],
    timeout_s: float | None,
    what: str,
    max_sleep_s: float,
) -> float:
    """Poll ``ready`` until true; ``check`` (which raises on a dead or failed peer) runs every
    ~50 ms. Returns the seconds waited; raises :class:`RingError` after ``timeout_s``. None: no
    clock limit, for a wait that ``check`` bounds by the life of the processes it waits for."""
    if ready():
        return 0.0
    start = time.monotonic()
    next_check = start
    sleep = 20e-6
    while True:
        now = time.monotonic()
        if now >= next_check:
            try:
                check()
            except Exception:
                # The peer may have published what we wait for and then left (the first rank
                # reads its last batch and closes): what it wrote before leaving still counts.
                if ready():
                    return time.monotonic() - start
                raise
            next_check = now + 0.05
        if ready():
            return time.monotonic() - start
        if timeout_s is not None and now - start > timeout_s:
            raise RingError(
                f"{what}: nothing after {timeout_s:.0f} s (shm_data_loader.timeout_s); the peer is alive but stuck, "
                "or a pause (checkpoint save, evaluation) lasts longer than the timeout: raise timeout_s"
            )
        time.sleep(sleep)
        sleep = min(sleep * 2, max_sleep_s)
