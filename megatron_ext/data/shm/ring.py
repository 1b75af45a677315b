"""Layout of the node's ring in shared memory, and the polling waits of both sides.

One segment per node: a header, one entry per consumer rank, one per slot, then the slots. A slot
holds one step: per DP rank of the node (a *stream*) its micro-batch's token ids, narrow, after a
checksum; ranks derive everything else from them. Synchronisation is by single-writer counters read
and written as aligned 8-byte words (release/acquire through ``ordering``), no locks; liveness is a
lock on one byte of the ring file per process (``segment``). A rank waiting for data gives up after
``timeout_s``; the producer waits for slots as long as the ranks live. Every failure is a flag of its
own writer, never cleared, so the first error reaches every rank. Why each rule holds:
docs/shm_data_loader.md, "How it works".
"""

from __future__ import annotations

import dataclasses
import enum
import zlib

import numpy as np

from megatron_ext.data.ordering import Fences, fences_for
from megatron_ext.data.shm.segment import MAGIC
from megatron_ext.data.shm.segment_file import OWNER_LOCK, SegmentFile, take_lock

VERSION = 4  # 2: document ids; 3: a flag per state writer; 4: token ids only, liveness by locks
MAX_WORKERS = 8  # producer workers with a progress entry in the header

# Words of the layout (8-byte indices); only Ring's methods below read or write them.
# header words
_MAGIC, _OWNER_PID, _VERSION, _PRODUCER_FAILED, _PRODUCER_PID, _RANK_FAILED, _CLOSING = range(7)
_SLOTS, _STREAMS, _MBS, _SEQ_LENGTH, _CONSUMERS, _TOKEN_BYTES, _EXTRA_TOKEN = range(7, 14)
_GEOMETRY = (_SLOTS, _STREAMS, _MBS, _SEQ_LENGTH, _CONSUMERS, _TOKEN_BYTES, _EXTRA_TOKEN)
_PROGRESS = 16  # per worker: samples read, bytes of the .bin they span
_ERROR_OFFSET, _ERROR_BYTES = 256, 896  # per failure flag: a message, UTF-8, NUL padded
_CONSUMERS_OFFSET = _ERROR_OFFSET + 2 * _ERROR_BYTES
_CONSUMER_WORDS = 3
_PID, _RELEASED, _CLOSED = range(_CONSUMER_WORDS)  # a consumer entry: who (0: not yet), how far it got
_SLOT_WORDS = 2
_STEP, _END = range(_SLOT_WORDS)  # a slot entry: the step it holds (-1: none yet), whether it is the end
_CHECKSUM_BYTES = 8  # a stream's region starts with the CRC-32 of its token ids
# Bytes of the ring file whose locks say who is alive (the creator's, OWNER_LOCK, is taken at creation).
_PRODUCER_LOCK = OWNER_LOCK + 1
_CONSUMER_LOCK = OWNER_LOCK + 2  # + the consumer's index


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
    """The node's first rank, while it sets the ring up or when its producer exits unannounced."""


_FAILED_FLAG = {Writer.PRODUCER: _PRODUCER_FAILED, Writer.FIRST_RANK: _RANK_FAILED}


class RingError(RuntimeError):
    """The other side of the ring died, failed or did not answer in time."""


def check_platform() -> None:
    """Refuse, by name, a machine whose ring words this code cannot order (``ordering``)."""
    fences_for()


@dataclasses.dataclass(frozen=True)
class RingLayout:
    slots: int
    """Steps the ring holds at once."""
    streams: int
    """Distinct DP ranks on the node: one region per slot each."""
    micro_batch_size: int
    """Samples per stream and step."""
    seq_length: int
    """Tokens per sample the model sees."""
    consumers: int
    """Ranks of the node that read from the ring."""
    token_bytes: int = 4
    """Bytes per stored token id: 2 (uint16) where the vocabulary fits, else 4 (int32)."""
    extra_token: int = 1
    """GPTDataset's add_extra_token_to_sequence: each sample stores seq_length + 1 ids."""

    @property
    def text_length(self) -> int:
        """Token ids stored per sample."""
        return self.seq_length + self.extra_token

    @property
    def token_dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.token_bytes == 2 else np.int32)

    @property
    def region_bytes(self) -> int:
        payload = self.micro_batch_size * self.text_length * self.token_bytes
        return -(-(_CHECKSUM_BYTES + payload) // 64) * 64

    @property
    def slot_table_offset(self) -> int:
        return _CONSUMERS_OFFSET + 8 * _CONSUMER_WORDS * self.consumers

    @property
    def data_offset(self) -> int:
        return -(-(self.slot_table_offset + 8 * _SLOT_WORDS * self.slots) // 4096) * 4096

    @property
    def size(self) -> int:
        return self.data_offset + self.slots * self.streams * self.region_bytes

    def header(self, owner_pid: int) -> bytes:
        """Everything before the slots' data, as the creator writes it (every word at its "not yet")."""
        buf = bytearray(self.data_offset)
        words = memoryview(buf).cast("q")
        for word, value in {
            _MAGIC: MAGIC,
            _OWNER_PID: owner_pid,
            _VERSION: VERSION,
            **dict(zip(_GEOMETRY, dataclasses.astuple(self))),
        }.items():
            words[word] = value
        for slot in range(self.slots):
            words[self.slot_table_offset // 8 + _SLOT_WORDS * slot + _STEP] = -1  # no step held yet
        words.release()
        return bytes(buf)


class Ring:
    """The protocol over a mapped segment: each method reads or writes the words one step of it
    needs, in the order that step needs, with the fences that order them against their payloads.
    Its int64 view of the map is released by :meth:`close`, which then closes the segment."""

    def __init__(self, segment: SegmentFile, layout: RingLayout, fences: Fences | None = None) -> None:
        self.segment = segment
        self.layout = layout
        self.fences = fences_for() if fences is None else fences
        self._bytes = memoryview(segment.mm)
        self._words = self._bytes.cast("q")

    @classmethod
    def attach(cls, segment: SegmentFile, fences: Fences | None = None) -> Ring:
        """Read the layout from a mapped segment's header."""
        with memoryview(segment.mm) as raw, raw[: 8 * (max(_GEOMETRY) + 1)].cast("q") as words:
            geometry = [words[w] for w in _GEOMETRY]
        return cls(segment, RingLayout(*geometry), fences)

    def close(self) -> None:
        """Release the views of the map, then unmap it and drop this process's locks."""
        self._words.release()
        self._bytes.release()
        self.segment.close()

    def _get(self, word: int) -> int:
        return self._words[word]

    def _set(self, word: int, value: int) -> None:
        self._words[word] = value

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
        self._bytes[offset : offset + _ERROR_BYTES] = data.ljust(_ERROR_BYTES, b"\0")
        self._publish(_FAILED_FLAG[writer], 1)  # after the message: a reader that sees the flag finds it

    def error(self) -> str:
        """The recorded failures, the producer's first."""
        messages = []
        for writer, flag in _FAILED_FLAG.items():
            if self._observe(flag):
                offset = _ERROR_OFFSET + writer * _ERROR_BYTES
                text = bytes(self._bytes[offset : offset + _ERROR_BYTES]).rstrip(b"\0")
                messages.append(text.decode("utf-8", "replace"))
        return "\nthen: ".join(messages)

    def owner_pid(self) -> int:
        """The creator's pid in its own PID namespace: for messages, never for liveness."""
        return self._get(_OWNER_PID)

    def owner_alive(self) -> bool:
        """The rank that created the segment still holds its lock."""
        return self.segment.held(OWNER_LOCK)

    def producer_pid(self) -> int:
        """The producer's pid (for messages); 0 before it started."""
        return self._observe(_PRODUCER_PID)

    def producer_alive(self) -> bool:
        """The producer (or one of its workers) still holds the producer's lock."""
        return self.segment.held(_PRODUCER_LOCK)

    def lock_for_producer(self, fd: int) -> None:
        """Take the producer's lock through ``fd``, a descriptor of this file the producer will own."""
        if not take_lock(fd, _PRODUCER_LOCK):
            raise RingError("another process holds this ring's producer lock: a second producer was started")

    def start_producer(self, pid: int) -> None:
        """Record the forked producer, once it holds its lock. Writes no state: a failure it already
        recorded stays."""
        self._publish(_PRODUCER_PID, pid)

    def progress(self) -> tuple[int, int]:
        """Samples the producer's workers have read, and the bytes of the ``.bin`` they span."""
        words = [self._get(_PROGRESS + i) for i in range(2 * MAX_WORKERS)]
        return sum(words[0::2]), sum(words[1::2])

    def set_progress(self, worker: int, samples: int, nbytes: int) -> None:
        self._set(_PROGRESS + 2 * worker, samples)
        self._set(_PROGRESS + 2 * worker + 1, nbytes)

    # -- consumers ------------------------------------------------------------------------------
    def register(self, consumer: int, pid: int) -> None:
        """Take consumer ``consumer``'s lock, then announce it (its pid only names it in messages)."""
        if not self.segment.lock(_CONSUMER_LOCK + consumer):
            raise RingError(
                f"local index {consumer} of this node's ring is held by another live process: two ranks "
                "claim the same place on the node (do all ranks pass the same topology?)"
            )
        self._publish(self._consumer(consumer, _PID), pid)

    def consumer_pid(self, consumer: int) -> int:
        """The consumer's pid (for messages); 0 before it registered."""
        return self._observe(self._consumer(consumer, _PID))

    def consumer_alive(self, consumer: int) -> bool:
        """The consumer still holds its lock (read it after it registered, from another process: a
        process's own lock never conflicts with itself)."""
        return self.segment.held(_CONSUMER_LOCK + consumer)

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

    def _region(self, slot: int, stream: int) -> int:
        lay = self.layout
        return lay.data_offset + (slot * lay.streams + stream) * lay.region_bytes

    def tokens(self, slot: int, stream: int) -> np.ndarray:
        """View of one stream's token ids in one slot, [mbs, text_length]. It pins the map: drop
        it before closing the ring."""
        lay = self.layout
        return np.frombuffer(
            self.segment.mm,
            dtype=lay.token_dtype,
            count=lay.micro_batch_size * lay.text_length,
            offset=self._region(slot, stream) + _CHECKSUM_BYTES,
        ).reshape(lay.micro_batch_size, lay.text_length)

    def seal(self, slot: int, stream: int) -> None:
        """Store the checksum of the stream's token ids, once they are written (before publishing)."""
        self._set(self._region(slot, stream) // 8, zlib.crc32(self.tokens(slot, stream)))  # type: ignore[arg-type]  # numpy declares the buffer protocol on 3.12+ only

    def check_sealed(self, slot: int, stream: int, ids: np.ndarray, step: int) -> None:
        """Raise :class:`RingError` when ``ids`` (a copy of the stream's ids) are not what was sealed."""
        sealed, got = self._get(self._region(slot, stream) // 8), zlib.crc32(ids)  # type: ignore[arg-type]  # numpy declares the buffer protocol on 3.12+ only
        if sealed != got:
            raise RingError(
                f"slot {slot} (step {step}) of stream {stream} is corrupt: its token ids have CRC-32 {got:#010x}, "
                f"the producer sealed {sealed:#010x}; something else wrote into this job's shared-memory ring "
                "(another process of this user mapping it, or failing memory)"
            )
