"""The ring's memory ordering: which machines run it and with which fences, every word that
announces a payload stored after a release fence and loaded before an acquire fence, and a stress
run of publish (producer to ranks) and release (ranks to producer) across processes.

The rule is C11's release/acquire: a writer's stores before its release fence are visible to a
reader that loaded the announcing word and then issued an acquire fence. x86-64 keeps stores and
loads in program order by itself; aarch64 needs the fences."""

from __future__ import annotations

import mmap
import os
import platform
import tempfile

import pytest

from megatron_ext.data.ordering import (
    Architecture,
    LibatomicFences,
    TotalStoreOrder,
    UnsupportedPlatformError,
    architecture,
    fences_for,
)
from megatron_ext.data.shm import ring as ring_module
from megatron_ext.data.shm.polling import wait_until
from megatron_ext.data.shm.ring import Ring, RingLayout, State, Writer
from megatron_ext.data.shm.segment_file import SegmentFile
from tests.helpers.shm import is_alive, process_start_time


@pytest.mark.parametrize(
    ("machine", "arch", "fences"),
    [
        ("x86_64", Architecture.X86_64, TotalStoreOrder),
        ("AMD64", Architecture.X86_64, TotalStoreOrder),
        ("aarch64", Architecture.AARCH64, LibatomicFences),
        ("arm64", Architecture.AARCH64, LibatomicFences),
    ],
)
def test_x86_64_needs_no_fences_and_aarch64_takes_libatomics(machine, arch, fences):
    assert architecture(machine) is arch
    assert type(fences_for(machine)) is fences


@pytest.mark.parametrize("machine", ["ppc64le", "riscv64", "s390x"])
def test_other_architectures_are_refused_naming_the_supported_ones(machine):
    with pytest.raises(
        UnsupportedPlatformError, match=rf"runs on x86_64, aarch64, and this machine is '{machine}'"
    ):
        fences_for(machine)


def test_a_missing_libatomic_is_refused_naming_the_package_to_install(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(
        UnsupportedPlatformError, match=r"libatomic1 on Debian/Ubuntu.*shm_data_loader.enabled=false"
    ):
        LibatomicFences("libno-such-atomic.so.1")


def test_libatomics_fences_can_be_called_here():
    fences = LibatomicFences()  # the aarch64 path, exercised on whatever machine runs the suite
    fences.release()
    fences.acquire()


# -- every announcing word is fenced --------------------------------------------------------------
LAYOUT = RingLayout(slots=3, streams=2, micro_batch_size=2, seq_length=16, consumers=2)


class _Log(list):
    """Fences that record their calls in the same list as the ring's word accesses."""

    def release(self) -> None:
        self.append("release")

    def acquire(self) -> None:
        self.append("acquire")


class _RecordingRing(Ring):
    def _get(self, word: int) -> int:
        value = super()._get(word)
        self.fences.append(("get", word, value))
        return value

    def _set(self, word: int, value: int) -> None:
        self.fences.append(("set", word, value))
        super()._set(word, value)


def _segment(layout: RingLayout) -> SegmentFile:
    """An unlinked ring file, mapped shared (forked processes see one ring), holding ``layout``'s header."""
    fd, name = tempfile.mkstemp(dir="/dev/shm")
    os.unlink(name)
    os.ftruncate(fd, layout.size)
    mm = mmap.mmap(fd, layout.size)
    mm[: layout.data_offset] = layout.header(os.getpid())
    return SegmentFile(fd, mm)


def _ring(fences=None) -> Ring:
    return (_RecordingRing if isinstance(fences, _Log) else Ring)(_segment(LAYOUT), LAYOUT, fences)


def _fenced_store(log: _Log, word: int) -> bool:
    i = next(i for i, e in enumerate(log) if e[:2] == ("set", word))
    return i > 0 and log[i - 1] == "release"


def _fenced_load(log: _Log, word: int) -> bool:
    i = max(i for i, e in enumerate(log) if e[:2] == ("get", word))
    return log[i + 1] == "acquire"


def _step_word(slot: int) -> int:
    return LAYOUT.slot_table_offset // 8 + 2 * slot


def _consumer_word(consumer: int, field: int) -> int:
    return ring_module._CONSUMERS_OFFSET // 8 + ring_module._CONSUMER_WORDS * consumer + field


def test_a_slot_is_published_after_a_release_and_read_after_an_acquire():
    log = _Log()
    ring = _ring(log)
    ring.tokens(1, 0)[:] = 7
    ring.publish(1, 4)
    assert _fenced_store(log, _step_word(1))
    log.clear()
    assert not ring.holds(1, 5)
    assert "acquire" not in log  # nothing to read yet: no fence needed
    assert ring.holds(1, 4)
    assert _fenced_load(log, _step_word(1))


def test_a_release_is_stored_after_a_release_fence_and_seen_before_an_acquire():
    log = _Log()
    ring = _ring(log)
    ring.release(0, 0)
    ring.release(1, 0)
    assert _fenced_store(log, _consumer_word(0, ring_module._RELEASED))
    assert _fenced_store(log, _consumer_word(1, ring_module._RELEASED))
    log.clear()
    assert ring.released_by_all(1)
    assert log[-1] == "acquire"  # after every release word was loaded, before the refill's stores


def test_pids_and_failures_are_announced_after_their_payloads():
    log = _Log()
    ring = _ring(log)
    ring.register(1, 4242)
    ring.start_producer(4343)
    ring.fail("disk gone", Writer.PRODUCER)
    assert _fenced_store(log, _consumer_word(1, ring_module._PID))
    assert _fenced_store(log, ring_module._PRODUCER_PID)
    assert _fenced_store(log, ring_module._PRODUCER_FAILED)
    log.clear()
    assert ring.consumer_pid(1) == 4242
    assert _fenced_load(log, _consumer_word(1, ring_module._PID))
    assert ring.producer_pid() == 4343
    assert _fenced_load(log, ring_module._PRODUCER_PID)
    assert ring.state == State.FAILED and ring.error() == "disk gone"
    assert _fenced_load(log, ring_module._PRODUCER_FAILED)


def test_a_failure_is_never_overwritten_and_the_producers_comes_first():
    ring = _ring()
    ring.fail("disk gone", Writer.PRODUCER)
    ring.start_producer(4343)  # the parent records the producer after it already failed
    ring.close_for_all()
    ring.fail("set-up failed", Writer.FIRST_RANK)
    ring.fail("a second producer error", Writer.PRODUCER)
    assert ring.state == State.FAILED
    assert ring.error() == "disk gone\nthen: set-up failed"


# -- stress: publish and release across processes --------------------------------------------------
STEPS = 2000


def _value(step: int, stream: int) -> int:
    return step * 2 + stream


def _consume(ring: Ring, consumer: int, parent: int) -> int:
    """Every step's copy must hold exactly that step's values: a slot overwritten before this rank
    released it, or read before its payload landed, gives a mixed copy. Returns the mixed copies."""

    def parent_alive() -> None:
        if os.getppid() != parent:
            raise RuntimeError("the producer is gone")

    stream, bad = consumer % ring.layout.streams, 0
    for step in range(STEPS):
        slot = step % ring.layout.slots
        wait_until(
            lambda slot=slot, step=step: ring.holds(slot, step),
            parent_alive,
            60,
            "consumer",
            max_sleep_s=1e-4,
        )
        copy = ring.tokens(slot, stream).copy()
        ring.release(consumer, step)
        bad += not (copy == _value(step, stream)).all()
    return bad


@pytest.mark.parametrize("slots", [1, 2, 7])
@pytest.mark.parametrize("fences", ["this machine's", "libatomic"])
def test_publish_and_release_stress_across_processes(slots, fences):
    layout = RingLayout(slots, streams=2, micro_batch_size=2, seq_length=64, consumers=3)
    ring = Ring(_segment(layout), layout, LibatomicFences() if fences == "libatomic" else None)
    parent, children = os.getpid(), []
    for c in range(layout.consumers):
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                code = min(_consume(ring, c, parent), 2)
            finally:
                os._exit(code)
        children.append((pid, process_start_time(pid)))

    def consumers_alive() -> None:
        if not all(is_alive(pid, start) for pid, start in children):
            raise RuntimeError("a consumer is gone")

    for step in range(STEPS):
        slot = step % slots
        wait_until(
            lambda step=step: ring.released_by_all(step - slots + 1), consumers_alive, 60, "producer", 1e-4
        )
        for stream in range(layout.streams):
            ring.tokens(slot, stream)[...] = _value(step, stream)
        ring.publish(slot, step)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid, _ in children]
    assert codes == [0] * layout.consumers, (
        f"consumers' exit codes (1: a mixed copy, 2: several, 3: error): {codes}"
    )


# -- single-store words -----------------------------------------------------------------------------
WORD_VALUES = (0x0123456789ABCDEF, ~0x0123456789ABCDEF)  # every byte differs: any mix is a third value
REWRITES = 1_000_000


def torn_reads(ring: Ring, word: int) -> tuple[int, int]:
    """Another process rewrites ``word`` REWRITES times, alternating WORD_VALUES, while this one
    reads it back through the ring's accessors; returns (reads, reads of a value never written)."""
    ring._set(word, WORD_VALUES[0])
    pid = os.fork()
    if pid == 0:
        try:
            for i in range(REWRITES):
                ring._set(word, WORD_VALUES[i & 1])
        finally:
            os._exit(0)
    reads = torn = 0
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        for _ in range(4096):
            torn += ring._get(word) not in WORD_VALUES
        reads += 4096
    return reads, torn


def test_a_word_rewritten_by_another_process_never_reads_as_a_value_never_written():
    # struct.pack_into zeroes a word before it writes it: through it, 8-19 % of these reads saw a
    # value never written. The ring's int64 view stores and loads each word whole.
    reads, torn = torn_reads(_ring(), ring_module._PROGRESS)
    assert reads > 0 and torn == 0, f"{torn} of {reads} reads saw a value that was never written"
