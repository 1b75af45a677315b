"""Failures of the shared-memory loader: dead producer, dead consumer, killed rank, stuck reads, a
broken dataset. Processes here are forked by the test itself (never the multi-rank pool's workers),
with small timeouts; every test also checks that nothing is left in the shared-memory directory."""

import glob
import multiprocessing as mp
import os
import re
import signal
import time
import uuid

import pytest

from megatron_ext.data.batch import ALL_KEYS
from megatron_ext.data.config import ShmDataLoaderConfig
from megatron_ext.data.gpt_dataset import build_train_dataset, synthetic_documents, write_indexed_dataset
from megatron_ext.data.ring import Ring, RingError, State, wait_until
from megatron_ext.data.samplers import SamplerSettings
from megatron_ext.data.shm_loader import ShmBatchIterator
from megatron_ext.data.shm_segment import is_alive, process_start_time, segment_path

TIMEOUT_S = 4.0
ctx = mp.get_context("fork")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("shm-faults")
    write_indexed_dataset(str(root / "corpus"), synthetic_documents(40))
    return build_train_dataset(str(root / "corpus"), 32, 10, 1234, str(root / "cache"))


@pytest.fixture
def path():
    p = segment_path("/dev/shm", f"faults{uuid.uuid4().hex[:8]}", 0)
    yield p
    assert glob.glob(p + "*") == [], "a segment was left behind"


def _iterator(dataset, path, local, consumers=2, timeout=TIMEOUT_S, workers=1):
    return ShmBatchIterator(
        dataset,
        SamplerSettings(2, 0, consumers, kind="random"),
        keys=ALL_KEYS,
        path=path,
        local_index=local,
        config=ShmDataLoaderConfig(enabled=True, slots=2, timeout_s=timeout, workers=workers),
        node_dp_ranks=list(range(consumers)),
        rank=local,
    )


def _consume(dataset, path, local, queue, batches_then_sleep=None):
    """A rank in a child process: report each batch; report the error that ends it, with its time."""
    it = _iterator(dataset, path, local)
    try:
        while True:
            next(it)
            queue.put(("batch", time.monotonic()))
            if batches_then_sleep is not None and it.counters.batches >= batches_then_sleep:
                time.sleep(60)  # a rank that stays alive but stops reading
    except RingError as e:
        queue.put(("error", time.monotonic(), str(e)))
    finally:
        it.close()


def _first_error(queue, timeout):
    deadline = time.monotonic() + timeout
    while True:
        item = queue.get(timeout=max(0.1, deadline - time.monotonic()))
        if item[0] == "error":
            return item


def test_killed_producer_fails_every_consumer_in_time(dataset, path):
    queue = ctx.Queue()
    child = ctx.Process(target=_consume, args=(dataset, path, 1, queue))
    child.start()
    leader = _iterator(dataset, path, 0)
    assert glob.glob(path + "*") == []  # unlinked as soon as both ranks attached
    next(leader)
    os.kill(leader.producer.pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(RingError, match=r"producer .* died without a message"):
        for _ in range(10):
            next(leader)
    assert time.monotonic() - killed < TIMEOUT_S
    _, when, message = _first_error(queue, TIMEOUT_S)
    assert "died without a message" in message and when - killed < TIMEOUT_S
    child.join(10)
    leader.close()


def test_killed_consumer_makes_the_producer_raise(dataset, path):
    queue = ctx.Queue()
    child = ctx.Process(target=_consume, args=(dataset, path, 1, queue, 1))
    child.start()
    leader = _iterator(dataset, path, 0)
    assert queue.get(timeout=30)[0] == "batch"
    child.kill()
    child.join(10)
    killed = time.monotonic()
    with pytest.raises(RingError, match=r"local rank 1 of the node \(pid \d+\) died"):
        for _ in range(10):
            next(leader)
    assert time.monotonic() - killed < TIMEOUT_S
    assert leader.producer.stop(timeout_s=5) == 1
    leader.close()


def test_killed_first_rank_leaves_nothing_and_fails_the_others(dataset, path):
    queue, leader_queue = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_consume, args=(dataset, path, 1, queue))
    leader = ctx.Process(target=_consume, args=(dataset, path, 0, leader_queue, 2))
    child.start()
    leader.start()
    assert leader_queue.get(timeout=30)[0] == "batch"
    os.kill(leader.pid, signal.SIGKILL)
    killed = time.monotonic()
    _, when, message = _first_error(queue, TIMEOUT_S + 5)
    assert "local rank 0 of the node" in message and "died" in message
    assert when - killed < TIMEOUT_S
    child.join(10)
    leader.join(10)


def test_a_rank_that_stops_reading_stalls_the_others_until_their_timeout(dataset, path):
    # The producer keeps waiting for a live rank (it may be a validation loader between
    # evaluations); the ranks that wait for data give up after timeout_s, naming the step.
    queue = ctx.Queue()
    child = ctx.Process(target=_consume, args=(dataset, path, 1, queue, 1))
    child.start()
    leader = _iterator(dataset, path, 0, timeout=1.0)
    with pytest.raises(RingError, match=r"waited for step 3 \(slot 1\) .* nothing after 1 s"):
        for _ in range(10):
            next(leader)
    assert leader.producer.poll() is None
    child.kill()
    child.join(10)
    leader.close()


class _Failing:
    """Looks like the GPTDataset it wraps, but reading a sample fails or hangs."""

    def __init__(self, dataset, hang):
        self.config, self.dataset, self._len, self._hang = dataset.config, dataset.dataset, len(dataset), hang

    def __len__(self):
        return self._len

    def __getitem__(self, idx):
        if self._hang:
            time.sleep(60)
        raise OSError(f"reading sample {idx}: input/output error")


@pytest.mark.parametrize(
    ("workers", "via"),
    [(1, ""), (2, r"RingError: worker \d of 2 \(pid \d+\) failed: ")],
    ids=["producer", "worker"],
)
def test_a_producer_error_reaches_the_ranks_with_its_message(dataset, path, workers, via):
    leader = _iterator(_Failing(dataset, hang=False), path, 0, consumers=1, workers=workers)
    with pytest.raises(
        RingError, match=rf"(?s)producer of .* failed: {via}OSError: reading sample \d+: input/output error"
    ):
        next(leader)
    leader.close()


def test_a_stuck_producer_times_out_the_consumer(dataset, path):
    leader = _iterator(_Failing(dataset, hang=True), path, 0, consumers=1, timeout=1.0)
    start = time.monotonic()
    with pytest.raises(RingError, match=r"waited for step 0 .* nothing after 1 s"):
        next(leader)
    assert time.monotonic() - start < 3
    leader.close()


def test_data_published_before_the_peer_left_still_counts():
    # The first rank reads the last batch and closes while a peer is between two polls: the peer
    # must take the batch that is there, not report the closed ring.
    published = []

    def peer_left():
        published.append(True)
        raise RingError("closed")

    assert wait_until(lambda: bool(published), peer_left, 1.0, "a batch", max_sleep_s=1e-3) >= 0
    with pytest.raises(RingError, match="closed"):
        wait_until(lambda: False, peer_left, 1.0, "a batch", max_sleep_s=1e-3)


def test_the_producers_error_survives_a_parent_that_records_the_producer_after_it(dataset, path, monkeypatch):
    # The parent forks the producer and then records it; a producer that failed in between must
    # still be what every rank reports (the parent here records it only once the failure is there).
    queue = ctx.Queue()
    child = ctx.Process(target=_consume, args=(dataset, path, 1, queue))
    child.start()
    record = Ring.start_producer

    def record_after_the_failure(ring, pid, start):
        wait_until(
            lambda: ring.state == State.FAILED, lambda: None, TIMEOUT_S, "the producer's failure", 1e-3
        )
        record(ring, pid, start)

    monkeypatch.setattr(Ring, "start_producer", record_after_the_failure)
    leader = _iterator(_Failing(dataset, hang=False), path, 0)
    expected = r"(?s)producer of .* failed: .*OSError: reading sample \d+: input/output error"
    with pytest.raises(RingError, match=expected):
        next(leader)
    _, _, message = _first_error(queue, TIMEOUT_S)
    assert re.search(expected, message), message
    child.join(10)
    leader.close()


def _workers_of(pid: int, count: int = 2) -> list[int]:
    """The producer's workers, once it has forked ``count`` of them."""

    def children() -> list[int]:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]

    wait_until(lambda: len(children()) == count, lambda: None, TIMEOUT_S, "the producer's workers", 1e-3)
    return children()


def _two_ranks_reading(dataset, path):
    """The node's first rank (here, one batch read; its producer with 2 workers) and a second rank
    reading in a child process."""
    queue = ctx.Queue()
    child = ctx.Process(target=_consume, args=(dataset, path, 1, queue))
    child.start()
    leader = _iterator(dataset, path, 0, workers=2)
    next(leader)
    return leader, child, queue


def test_a_killed_worker_fails_every_rank_naming_the_worker_and_the_signal(dataset, path):
    leader, child, queue = _two_ranks_reading(dataset, path)
    workers = _workers_of(leader.producer.pid)
    os.kill(workers[1], signal.SIGKILL)
    expected = rf"worker \d of 2 \(pid {workers[1]}\) failed: killed by signal 9"
    with pytest.raises(RingError, match=expected):
        for _ in range(1000):
            next(leader)
    _, _, message = _first_error(queue, TIMEOUT_S)
    assert re.search(expected, message), message
    child.join(10)
    leader.close()


def test_a_killed_producer_takes_its_workers_with_it(dataset, path):
    leader, child, _ = _two_ranks_reading(dataset, path)
    workers = [(pid, process_start_time(pid)) for pid in _workers_of(leader.producer.pid)]
    os.kill(leader.producer.pid, signal.SIGKILL)
    assert leader.producer.stop(timeout_s=TIMEOUT_S) == -signal.SIGKILL
    wait_until(
        lambda: not any(is_alive(*w) for w in workers), lambda: None, TIMEOUT_S, "the workers' exit", 1e-3
    )
    child.join(10)
    leader.close()
