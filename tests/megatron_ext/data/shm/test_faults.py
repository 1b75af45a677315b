"""Failures of the shared-memory loader: dead producer, dead consumer, killed rank, stuck reads, a
broken dataset. Processes here are forked by the test itself (never the multi-rank pool's workers);
every test also checks that nothing is left in the shared-memory directory.

A failure must be noticed from the processes' state, not by a rank's timeout: the loaders here wait
up to TIMEOUT_S, and the error a rank reports says which it was (a dead or failed peer, or "nothing
after N s", the timeout's own message). The tests wait on events (a child's report on a queue, a
process state), with hang bounds that fail naming what they waited for, never on the clock."""

import glob
import multiprocessing as mp
import os
import re
import signal

import pytest

from megatron_ext.data.shm.polling import wait_until
from megatron_ext.data.shm.ring import Ring, RingError, State, Writer
from tests.helpers.shm import is_alive, node_iterator, process_start_time
from tests.helpers.waits import HANG_S, first_error, receive, wait_for

TIMEOUT_S = 2 * HANG_S  # the loaders' own timeout: a failure only it noticed would fail the message checks
STALL_S = 1.0  # the timeout of the tests about the timeout itself
ctx = mp.get_context("fork")


def _iterator(dataset, path, local, consumers=2, timeout=TIMEOUT_S, workers=1):
    return node_iterator(dataset, path, local, consumers, timeout, workers)


def _consume(dataset, path, local, queue, stop_after=None):
    """A rank in a child process: report each batch, and the error that ends it. ``stop_after``
    batches: it stays alive but stops reading, until the test kills it."""
    it = _iterator(dataset, path, local)
    try:
        while True:
            next(it)
            queue.put(("batch", it.counters.batches))
            if stop_after is not None and it.counters.batches >= stop_after:
                signal.pause()
    except RingError as e:
        queue.put(("error", str(e)))
    finally:
        it.close()


def test_killed_producer_fails_every_consumer_in_time(shm_dataset, shm_path, forked):
    queue = ctx.Queue()
    forked(_consume, shm_dataset, shm_path, 1, queue)
    leader = _iterator(shm_dataset, shm_path, 0)
    assert glob.glob(shm_path + "*") == []  # unlinked as soon as both ranks attached
    next(leader)
    os.kill(leader.producer.pid, signal.SIGKILL)
    with pytest.raises(RingError, match=r"producer .* died without a message"):
        for _ in range(10):
            next(leader)
    message = first_error(queue, "rank 1 after the producer was killed")
    assert "died without a message" in message, message
    leader.close()


def test_killed_consumer_makes_the_producer_raise(shm_dataset, shm_path, forked):
    queue = ctx.Queue()
    child = forked(_consume, shm_dataset, shm_path, 1, queue, 1)
    leader = _iterator(shm_dataset, shm_path, 0)
    assert receive(queue, "first batch of rank 1")[0] == "batch"
    child.kill()
    child.join(HANG_S)
    with pytest.raises(RingError, match=r"local rank 1 of the node \(pid \d+ in its PID namespace\) died"):
        for _ in range(10):
            next(leader)
    assert leader.producer.stop(timeout_s=HANG_S) == 1  # it failed and left on its own, not killed
    leader.close()


def test_killed_first_rank_leaves_nothing_and_fails_the_others(shm_dataset, shm_path, forked):
    queue, leader_queue = ctx.Queue(), ctx.Queue()
    forked(_consume, shm_dataset, shm_path, 1, queue)
    leader = forked(_consume, shm_dataset, shm_path, 0, leader_queue, 2)
    assert receive(leader_queue, "first batch of rank 0")[0] == "batch"
    os.kill(leader.pid, signal.SIGKILL)
    message = first_error(queue, "rank 1 after rank 0 was killed")
    assert "local rank 0 of the node" in message and "died" in message, message


def test_a_rank_that_stops_reading_stalls_the_others_until_their_timeout(shm_dataset, shm_path, forked):
    # The producer keeps waiting for a live rank (it may be a validation loader between
    # evaluations); the ranks that wait for data give up after timeout_s, naming the step.
    queue = ctx.Queue()
    child = forked(_consume, shm_dataset, shm_path, 1, queue, 1)
    leader = _iterator(shm_dataset, shm_path, 0, timeout=STALL_S)
    with pytest.raises(RingError, match=r"waited for step 3 \(slot 1\) .* nothing after 1 s"):
        for _ in range(10):
            next(leader)
    assert leader.producer.poll() is None
    child.kill()
    child.join(HANG_S)
    leader.close()


class _Failing:
    """Looks like the GPTDataset it wraps, but reading a sample fails; with ``hang`` (an event), only
    once the event is set: until then the read is stuck."""

    def __init__(self, dataset, hang=None):
        self.config, self.dataset, self._len, self._hang = dataset.config, dataset.dataset, len(dataset), hang

    def __len__(self):
        return self._len

    def _query_document_sample_shuffle_indices(self, idx):
        if self._hang is not None:
            self._hang.wait(HANG_S)
        raise OSError(f"reading sample {idx}: input/output error")


@pytest.mark.parametrize(
    ("workers", "via"),
    [(1, ""), (2, r"RingError: worker \d of 2 \(pid \d+\) failed: ")],
    ids=["producer", "worker"],
)
def test_a_producer_error_reaches_the_ranks_with_its_message(shm_dataset, shm_path, workers, via):
    leader = _iterator(_Failing(shm_dataset), shm_path, 0, consumers=1, workers=workers)
    with pytest.raises(
        RingError, match=rf"(?s)producer of .* failed: {via}OSError: reading sample \d+: input/output error"
    ):
        next(leader)
    leader.close()


def test_a_stuck_producer_times_out_the_consumer(shm_dataset, shm_path):
    stuck = ctx.Event()
    leader = _iterator(_Failing(shm_dataset, hang=stuck), shm_path, 0, consumers=1, timeout=STALL_S)
    try:
        with pytest.raises(RingError, match=r"waited for step 0 .* nothing after 1 s"):
            next(leader)
    finally:
        stuck.set()  # the read fails now: the producer leaves on its own
        leader.close()


def test_data_published_before_the_peer_left_still_counts():
    # The first rank reads the last batch and closes while a peer is between two polls: the peer
    # must take the batch that is there, not report the closed ring.
    published = []

    def peer_left():
        published.append(True)
        raise RingError("closed")

    wait_until(lambda: bool(published), peer_left, 1.0, "a batch", max_sleep_s=1e-3)  # no error
    assert published == [True]  # the batch came during the check that saw the peer leave
    with pytest.raises(RingError, match="closed"):
        wait_until(lambda: False, peer_left, 1.0, "a batch", max_sleep_s=1e-3)


def test_the_producers_error_survives_a_parent_that_records_the_producer_after_it(
    shm_dataset, shm_path, monkeypatch, forked
):
    # The parent forks the producer and then records it; a producer that failed in between must
    # still be what every rank reports (the parent here records it only once the failure is there).
    queue = ctx.Queue()
    forked(_consume, shm_dataset, shm_path, 1, queue)
    record = Ring.start_producer

    def record_after_the_failure(ring, pid):
        wait_for(lambda: ring.state == State.FAILED, "the producer's failure")
        record(ring, pid)

    monkeypatch.setattr(Ring, "start_producer", record_after_the_failure)
    leader = _iterator(_Failing(shm_dataset), shm_path, 0)
    expected = r"(?s)producer of .* failed: .*OSError: reading sample \d+: input/output error"
    with pytest.raises(RingError, match=expected):
        next(leader)
    message = first_error(queue, "rank 1 after the producer failed")
    assert re.search(expected, message), message
    leader.close()


def _workers_of(pid: int, count: int = 2) -> list[int]:
    """The producer's workers, once it has forked ``count`` of them."""

    def children() -> list[int]:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]

    wait_for(lambda: len(children()) == count, f"the producer's {count} workers")
    return children()


def _two_ranks_reading(dataset, path, forked):
    """The node's first rank (here, one batch read; its producer with 2 workers) and a second rank
    reading in a child process."""
    queue = ctx.Queue()
    forked(_consume, dataset, path, 1, queue)
    leader = _iterator(dataset, path, 0, workers=2)
    next(leader)
    return leader, queue


def test_a_killed_worker_fails_every_rank_naming_the_worker_and_the_signal(shm_dataset, shm_path, forked):
    leader, queue = _two_ranks_reading(shm_dataset, shm_path, forked)
    workers = _workers_of(leader.producer.pid)
    os.kill(workers[1], signal.SIGKILL)
    expected = rf"worker \d of 2 \(pid {workers[1]}\) failed: killed by signal 9"
    with pytest.raises(RingError, match=expected):
        for _ in range(1000):
            next(leader)
    message = first_error(queue, "rank 1 after a worker was killed")
    assert re.search(expected, message), message
    leader.close()


def test_a_killed_producer_takes_its_workers_with_it(shm_dataset, shm_path, forked):
    leader, _ = _two_ranks_reading(shm_dataset, shm_path, forked)
    workers = [(pid, process_start_time(pid)) for pid in _workers_of(leader.producer.pid)]
    os.kill(leader.producer.pid, signal.SIGKILL)
    assert leader.producer.stop(timeout_s=HANG_S) == -signal.SIGKILL
    wait_for(lambda: not any(is_alive(*w) for w in workers), "the exit of the killed producer's workers")
    leader.close()


def test_a_producer_that_records_its_error_and_exits_between_two_checks_is_reported_by_its_error(
    shm_dataset, shm_path, monkeypatch
):
    # The interleaving: a rank reads the ring's state (running), the producer then records an IOError
    # and exits, and the rank finds it dead. The recorded error must win over "died without a message".
    leader = _iterator(shm_dataset, shm_path, 0, consumers=1)
    next(leader)
    os.kill(leader.producer.pid, signal.SIGKILL)
    leader.producer.stop(timeout_s=HANG_S)
    found_dead = Ring.producer_alive

    def records_its_error_then_is_found_dead(ring):
        ring.fail("the producer failed: OSError: reading sample 9: input/output error", Writer.PRODUCER)
        return found_dead(ring)

    monkeypatch.setattr(Ring, "producer_alive", records_its_error_then_is_found_dead)
    with pytest.raises(RingError, match=r"OSError: reading sample 9: input/output error") as raised:
        for _ in range(10):
            next(leader)
    assert "died without a message" not in str(raised.value)
    leader.close()


def test_a_slot_written_after_the_producer_sealed_it_is_a_clear_error(shm_dataset, shm_path):
    leader = _iterator(shm_dataset, shm_path, 0, consumers=1)
    next(leader)
    ring = leader._ring
    wait_for(lambda: ring.holds(1, 1), "step 1 in slot 1")
    ring.tokens(1, 0)[0, 3] ^= 1  # another process of this user writing into the mapped ring
    with pytest.raises(
        RingError, match=r"slot 1 \(step 1\) of stream 0 is corrupt: its token ids have CRC-32"
    ):
        next(leader)
    leader.close()
