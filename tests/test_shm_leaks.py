"""Leftovers and leaks of the shared-memory loader: a first rank killed while its node's ranks attach,
a producer that SIGKILL does not end, a loader dropped without close(). Processes are forked by the
test itself; every test also checks that nothing is left in the shared-memory directory."""

import gc
import glob
import multiprocessing as mp
import os
import signal
import threading
import time
import uuid

import pytest

from megatron_ext.data import producer as producer_module
from megatron_ext.data.batch import ALL_KEYS
from megatron_ext.data.config import ShmDataLoaderConfig
from megatron_ext.data.gpt_dataset import build_train_dataset, synthetic_documents, write_indexed_dataset
from megatron_ext.data.ring import RingError
from megatron_ext.data.samplers import SamplerSettings
from megatron_ext.data.shm_loader import ShmBatchIterator
from megatron_ext.data.shm_segment import process_start_time, remove_stale_segments, segment_path

ctx = mp.get_context("fork")
BOUND_S = 5.0  # how soon each failure must be noticed: far below the loaders' 30 s timeout


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("shm-leaks")
    write_indexed_dataset(str(root / "corpus"), synthetic_documents(40))
    return build_train_dataset(str(root / "corpus"), 32, 10, 1234, str(root / "cache"))


@pytest.fixture
def path():
    p = segment_path("/dev/shm", f"leaks{uuid.uuid4().hex[:8]}", 0)
    yield p
    assert glob.glob(p + "*") == [], "a segment was left behind"


def _iterator(dataset, path, local, consumers=3, creator=None):
    return ShmBatchIterator(
        dataset,
        SamplerSettings(2, 0, consumers, kind="random"),
        keys=ALL_KEYS,
        path=path,
        local_index=local,
        config=ShmDataLoaderConfig(enabled=True, slots=2, timeout_s=30),
        node_dp_ranks=list(range(consumers)),
        rank=local,
        creator=creator,
    )


def _rank(dataset, path, local, queue, creator=None):
    """A rank in a child process: report how set-up and the first batch end."""
    try:
        it = _iterator(dataset, path, local, creator=creator)
        queue.put(("attached", time.monotonic()))
        next(it)
        queue.put(("batch", time.monotonic()))
    except RingError as e:
        queue.put(("error", time.monotonic(), str(e)))


def _wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _start_first_rank(dataset, path):
    """The node's first rank, creating the ring for 3 ranks of which only some come: it stays in set-up."""
    first = ctx.Process(target=_rank, args=(dataset, path, 0, ctx.Queue()))
    first.start()
    _wait_for(lambda: os.path.exists(os.path.join(path, "ring")))
    return first, (first.pid, process_start_time(first.pid))


def _kill(proc):
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    return time.monotonic()


def test_first_rank_killed_after_a_peer_attached(dataset, path):
    first, _ = _start_first_rank(dataset, path)
    queue = ctx.Queue()
    peer = ctx.Process(target=_rank, args=(dataset, path, 1, queue))
    peer.start()
    assert queue.get(timeout=30)[0] == "attached"  # then it waits for step 0, which never comes
    killed = _kill(first)
    kind, when, message = queue.get(timeout=BOUND_S + 5)
    assert kind == "error" and when - killed < BOUND_S
    assert "first rank of its node" in message and "died while the node's ranks attached" in message
    peer.join(10)
    assert not os.path.exists(path)  # the peer removed it, long before any next start


def test_first_rank_killed_before_a_peer_opens(dataset, path):
    first, creator = _start_first_rank(dataset, path)
    _kill(first)
    queue = ctx.Queue()
    peer = ctx.Process(target=_rank, args=(dataset, path, 1, queue, creator))
    started = time.monotonic()
    peer.start()
    kind, when, message = queue.get(timeout=BOUND_S + 5)
    assert kind == "error" and when - started < BOUND_S and "died while the node's ranks attached" in message
    peer.join(10)
    assert not os.path.exists(path)


def test_first_rank_killed_before_creating_fails_the_waiting_peer(dataset, path):
    # The peer knows the creator from the collective: it stops waiting for the name when that dies.
    creator = ctx.Process(target=time.sleep, args=(60,))
    creator.start()
    queue = ctx.Queue()
    peer = ctx.Process(
        target=_rank, args=(dataset, path, 1, queue, (creator.pid, process_start_time(creator.pid)))
    )
    peer.start()
    time.sleep(0.5)  # the peer is polling for the name
    killed = _kill(creator)
    kind, when, message = queue.get(timeout=BOUND_S + 5)
    assert kind == "error" and when - killed < BOUND_S and f"(pid {creator.pid})" in message
    peer.join(10)


def test_a_whole_node_killed_during_set_up_is_cleaned_at_the_next_start(dataset, path):
    first, _ = _start_first_rank(dataset, path)
    _kill(first)
    assert os.path.exists(path)  # nobody of the job is left to remove it ...
    assert path in remove_stale_segments("/dev/shm")  # ... so the same user's next start does


def test_stop_is_bounded_when_sigkill_does_not_end_the_producer(monkeypatch):
    child = ctx.Process(target=time.sleep, args=(60,))
    child.start()
    stuck = producer_module.ProducerProcess.__new__(producer_module.ProducerProcess)
    stuck.pid, stuck.exitcode = child.pid, None
    # Stands for a process in an uninterruptible read: the signal is sent but does not take effect.
    monkeypatch.setattr(producer_module.os, "kill", lambda pid, sig: None)
    result = []
    thread = threading.Thread(
        target=lambda: result.append(stuck.stop(timeout_s=0.2, kill_wait_s=1.0)), daemon=True
    )
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match=rf"pid {child.pid}\) did not exit within 1 s of SIGKILL"):
        thread.start()
        thread.join(BOUND_S)
    assert not thread.is_alive() and result == [None] and time.monotonic() - start < BOUND_S
    monkeypatch.undo()
    os.kill(child.pid, signal.SIGKILL)
    _wait_for(lambda: stuck.poll() is not None)  # reaped later, once it does die
    assert stuck.exitcode == -signal.SIGKILL


def _drop_without_close(dataset, path, queue):
    it = ShmBatchIterator(
        dataset,
        SamplerSettings(2, 0, 1, kind="random"),
        keys=ALL_KEYS,
        path=path,
        local_index=0,
        config=ShmDataLoaderConfig(enabled=True, slots=2, timeout_s=30),
        node_dp_ranks=[0],
        rank=0,
    )
    next(it)
    queue.put(it.producer.pid)
    del it
    gc.collect()
    queue.put("dropped")
    time.sleep(60)  # the rank lives on


def test_a_loader_dropped_without_close_stops_its_producer(dataset, path):
    queue = ctx.Queue()
    rank = ctx.Process(target=_drop_without_close, args=(dataset, path, queue))
    rank.start()
    producer_pid = queue.get(timeout=30)
    assert queue.get(timeout=30) == "dropped"
    dropped = time.monotonic()
    _wait_for(lambda: process_start_time(producer_pid) is None, timeout=BOUND_S)
    assert time.monotonic() - dropped < BOUND_S and rank.is_alive()
    _kill(rank)
