"""Layout of the node's ring in shared memory, and the polling waits of both sides.

One segment per node: a header, a table with one entry per rank of the node (consumer), a table
with one entry per slot, then the slots. A slot holds one step: for each distinct DP rank on the
node (a *stream*) its micro-batch of tokens, labels, position_ids, loss_mask and document ids. Ranks that share
a DP rank (TP and CP peers) read the same stream.

Synchronisation is by counters only, no locks: the producer fills slot ``step % slots`` and then
writes ``step`` into the slot's sequence word; a consumer waits for that word, copies its stream
out and then stores ``step + 1`` into its own release word; the producer reuses a slot once every
consumer's release word has passed it. Each word has a single writer and is an aligned 8-byte
native store (``struct`` native format, one ``memcpy``), so a reader never sees it torn, and
x86-64 keeps stores in program order (and loads too), so data written before a sequence word is
visible once the word is. Python offers no acquire/release barrier, so on weakly ordered machines
(aarch64, POWER) a rank could see the word before the data: :func:`check_platform` refuses them. Every wait polls with a short, growing sleep and checks the other side's liveness (pid
plus start time, which also catches zombies and reused pids). A rank waiting for data gives up
after ``timeout_s``; the producer waiting for ranks to release a slot waits as long as they live,
because a live rank may rightly stop reading for long (a validation loader between evaluations, a
checkpoint save): it stops when one of them dies (and raises) or when all have closed.
"""

from __future__ import annotations

import dataclasses
import platform
import struct
import time
from collections.abc import Callable

import numpy as np

from deepspeed_ext.config import ConfigError
from megatron_ext.data.shm_segment import MAGIC

VERSION = 2  # 2: document ids beside the tokens
_WORD = struct.Struct("q")  # native: one aligned 8-byte store or load

# header words
MAGIC_W, OWNER_PID, OWNER_START, VERSION_W, STATE, PRODUCER_PID, PRODUCER_START = range(7)
SAMPLES_READ, BYTES_READ, SLOTS_W, STREAMS_W, MBS_W, SEQ_W, CONSUMERS_W = range(7, 14)
GEOMETRY = (SLOTS_W, STREAMS_W, MBS_W, SEQ_W, CONSUMERS_W)
ERROR_OFFSET, ERROR_BYTES = 256, 1792  # a failure message, UTF-8, NUL padded
CONSUMERS_OFFSET = ERROR_OFFSET + ERROR_BYTES
CONSUMER_WORDS = 4
PID, START, RELEASED, CLOSED = range(CONSUMER_WORDS)  # a consumer entry: who, and how far it got
SLOT_WORDS = 2
SEQ, END = range(SLOT_WORDS)  # a slot entry: the step it holds, and whether that step is end-of-data

# states
CREATED, RUNNING, FAILED, CLOSING = range(4)

# (key, numpy dtype): int64 arrays first so every array stays aligned. "documents" holds the
# document ids masks are built from (documents.py), written only with reset_attention_mask.
STREAM_ARRAYS = (("tokens", np.int64), ("labels", np.int64), ("position_ids", np.int64), ("loss_mask", np.float32),
                 ("documents", np.int32))


class RingError(RuntimeError):
    """The other side of the ring died, failed or did not answer in time."""


class UnsupportedPlatformError(ConfigError):
    """The ring's plain stores are not ordered on this machine."""


ORDERED_MACHINES = ("x86_64", "AMD64")  # platform.machine() of x86-64 (Linux, Windows): total store order


def check_platform() -> None:
    """Refuse to run where the ring's publish/consume/release words need barriers we cannot issue."""
    machine = platform.machine()
    if machine not in ORDERED_MACHINES:
        raise UnsupportedPlatformError(
            f"the shared-memory data loader runs on x86-64 only, and this machine is {machine!r}: its ring publishes "
            "each batch with plain 8-byte stores and no memory barriers, which only x86-64's total store order keeps "
            f"in program order; on {machine} a rank could read a stale or half-written batch. Set "
            "shm_data_loader.enabled=false (drop --shm-data-loader) to use Megatron's loader on this machine"
        )


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
        return CONSUMERS_OFFSET + 8 * CONSUMER_WORDS * self.consumers

    @property
    def data_offset(self) -> int:
        return -(-(self.slot_table_offset + 8 * SLOT_WORDS * self.slots) // 4096) * 4096

    @property
    def size(self) -> int:
        return self.data_offset + self.slots * self.streams * self.region_bytes

    def header(self, owner_pid: int, owner_start: int) -> bytes:
        """Everything before the slots' data, as the creator writes it."""
        buf = bytearray(self.data_offset)
        words = {MAGIC_W: MAGIC, OWNER_PID: owner_pid, OWNER_START: owner_start, VERSION_W: VERSION,
                 **dict(zip(GEOMETRY, dataclasses.astuple(self)))}
        for word, value in words.items():
            _WORD.pack_into(buf, 8 * word, value)
        for slot in range(self.slots):
            _WORD.pack_into(buf, self.slot_table_offset + 8 * SLOT_WORDS * slot, -1)  # no step held yet
        return bytes(buf)


class Ring:
    """Typed access to a mapped segment. Holds no buffer exports, so the map can always be closed."""

    def __init__(self, mm, layout: RingLayout) -> None:
        self.mm = mm
        self.layout = layout

    @classmethod
    def attach(cls, mm) -> Ring:
        """Read the layout from a mapped segment's header."""
        values = [_WORD.unpack_from(mm, 8 * w)[0] for w in GEOMETRY]
        return cls(mm, RingLayout(*values))

    def get(self, word: int) -> int:
        return _WORD.unpack_from(self.mm, 8 * word)[0]

    def set(self, word: int, value: int) -> None:
        _WORD.pack_into(self.mm, 8 * word, value)

    def consumer_word(self, consumer: int, field: int) -> int:
        return (CONSUMERS_OFFSET // 8) + CONSUMER_WORDS * consumer + field

    def slot_word(self, slot: int, field: int) -> int:
        return self.layout.slot_table_offset // 8 + SLOT_WORDS * slot + field

    def fail(self, message: str) -> None:
        data = message.encode("utf-8", errors="replace")[: ERROR_BYTES - 1]
        self.mm[ERROR_OFFSET: ERROR_OFFSET + ERROR_BYTES] = data.ljust(ERROR_BYTES, b"\0")
        self.set(STATE, FAILED)  # after the message: a reader that sees FAILED finds the text

    def error(self) -> str:
        return bytes(self.mm[ERROR_OFFSET: ERROR_OFFSET + ERROR_BYTES]).rstrip(b"\0").decode("utf-8", "replace")

    def arrays(self, slot: int, stream: int) -> dict[str, np.ndarray]:
        """Views of one stream of one slot. They pin the map: drop them before closing it."""
        lay = self.layout
        offset = lay.data_offset + (slot * lay.streams + stream) * lay.region_bytes
        shape = (lay.micro_batch_size, lay.seq_length)
        views = {}
        for key, dtype in STREAM_ARRAYS:
            views[key] = np.frombuffer(self.mm, dtype=dtype, count=shape[0] * shape[1], offset=offset).reshape(shape)
            offset += views[key].nbytes
        return views


def wait_until(ready: Callable[[], bool], check: Callable[[], None], timeout_s: float | None, what: str,
               max_sleep_s: float) -> float:
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
