"""Leftovers and leaks of the shared-memory loader: a first rank killed while its node's ranks attach,
a producer that SIGKILL does not end, a loader dropped without close(). Processes are forked by the
test itself; every test also checks that nothing is left in the shared-memory directory.

The tests wait on events (a child's report on a queue, a file, a process state) with hang bounds
(helpers.shm.HANG_S) below the loaders' own TIMEOUT_S: a failure noticed only by that timeout, or
not at all, fails the test naming what it waited for; the errors are checked for the liveness
check's message, not the timeout's."""

import gc
import multiprocessing as mp
import os
import signal
import threading

import pytest

from megatron_ext.data.shm import node_loader as shm_loader
from megatron_ext.data.shm import producer as producer_module
from megatron_ext.data.shm import segment as shm_segment
from megatron_ext.data.shm.ring import RingError
from megatron_ext.data.shm.segment import remove_stale_segments
from tests.helpers.shm import node_iterator, process_start_time
from tests.helpers.waits import HANG_S, first_error, receive, wait_for

ctx = mp.get_context("fork")
TIMEOUT_S = 2 * HANG_S  # the loaders' own timeout: every failure must be noticed before it


def _iterator(dataset, path, local, consumers=3):
    return node_iterator(dataset, path, local, consumers, TIMEOUT_S)


def _rank(dataset, path, local, queue):
    """A rank in a child process: report how set-up and the first batch end."""
    try:
        it = _iterator(dataset, path, local)
        queue.put(("attached",))
        next(it)
        queue.put(("batch",))
    except RingError as e:
        queue.put(("error", str(e)))


def _start_first_rank(dataset, path, forked):
    """The node's first rank, creating the ring for 3 ranks of which only some come: it stays in set-up."""
    first = forked(_rank, dataset, path, 0, ctx.Queue())
    wait_for(lambda: os.path.exists(os.path.join(path, "ring")), "the first rank's ring file")
    return first


def _only_the_marker_is_left(path):
    """The segment is gone, its memory freed; an empty marker tells ranks that come later that the
    first rank failed (this user's next start removes it: it is emptied here for the fixture)."""
    wait_for(lambda: not os.path.exists(path), "the removal of the dead first rank's segment")
    assert os.listdir(path + shm_segment.ABANDONED) == []
    os.rmdir(path + shm_segment.ABANDONED)


def _kill(proc):
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(HANG_S)


def test_first_rank_killed_after_a_peer_attached(shm_dataset, shm_path, forked):
    first = _start_first_rank(shm_dataset, shm_path, forked)
    queue = ctx.Queue()
    peer = forked(_rank, shm_dataset, shm_path, 1, queue)
    assert receive(queue, "the peer's attach")[0] == "attached"  # then it waits for step 0, which never comes
    _kill(first)
    message = first_error(queue, "the peer after the first rank was killed")
    assert "first rank of its node" in message and "died while the node's ranks attached" in message
    peer.join(HANG_S)
    _only_the_marker_is_left(shm_path)  # the peer removed it, long before any next start


def test_first_rank_killed_before_a_peer_opens(shm_dataset, shm_path, forked):
    first = _start_first_rank(shm_dataset, shm_path, forked)
    _kill(first)
    queue = ctx.Queue()
    peer = forked(_rank, shm_dataset, shm_path, 1, queue)
    message = first_error(queue, "the peer of a dead first rank")
    assert "died while the node's ranks attached" in message
    peer.join(HANG_S)
    _only_the_marker_is_left(shm_path)


def test_a_rank_that_comes_after_the_segment_was_removed_fails_at_once(shm_dataset, shm_path, forked):
    # Several ranks of the node wait; the first to see the first rank dead removes its segment. The
    # others, even one that only starts looking now, must not wait for their timeout.
    first = _start_first_rank(shm_dataset, shm_path, forked)
    _kill(first)
    early = ctx.Queue()
    forked(_rank, shm_dataset, shm_path, 1, early)
    assert "died while the node's ranks attached" in first_error(early, "the peer that finds it dead")
    late = ctx.Queue()
    forked(_rank, shm_dataset, shm_path, 2, late)
    message = first_error(late, "a peer that comes after the segment was removed")
    assert "died while the node's ranks attached" in message, message
    _only_the_marker_is_left(shm_path)


def _peer_polling_for_the_name(dataset, path, queue):
    """A second rank as ``_rank``, reporting ("polling",) once it has looked for the segment and not
    found it (it then polls for the name)."""
    look = shm_loader.open_segment

    def looking(where):
        found = look(where)
        if found is None and not polled:
            polled.append(True)
            queue.put(("polling",))
        return found

    polled = []
    shm_loader.open_segment = looking
    _rank(dataset, path, 1, queue)


def _first_rank_stuck_creating(dataset, path):
    """The node's first rank, stopped half-way through creating its ring (directory and locked
    ``ring.tmp*`` made, nothing written): it stays there until killed."""
    shm_segment._fill_ring = lambda *args: signal.pause()
    _rank(dataset, path, 0, ctx.Queue())


def test_first_rank_killed_while_creating_fails_the_waiting_peer(shm_dataset, shm_path, forked):
    queue = ctx.Queue()
    forked(_peer_polling_for_the_name, shm_dataset, shm_path, queue)
    assert receive(queue, "the peer's first look for the segment") == ("polling",)
    creator = forked(_first_rank_stuck_creating, shm_dataset, shm_path)
    wait_for(lambda: os.path.isdir(shm_path) and os.listdir(shm_path), "the first rank's ring.tmp file")
    _kill(creator)
    message = first_error(queue, "the peer after its first rank was killed")
    assert "which had begun to create it" in message and "died while the node's ranks attached" in message, (
        message
    )
    wait_for(lambda: not os.path.exists(shm_path), "the peer's removal of the abandoned segment")
    _only_the_marker_is_left(shm_path)


def _first_rank_out_of_space(dataset, path, queue):
    shm_segment.free_bytes = lambda shm_dir: 0  # /dev/shm full at the moment the ring is sized
    try:
        _iterator(dataset, path, 0)
    except shm_segment.ShmSpaceError as e:
        queue.put(("error", str(e)))


def test_a_first_rank_out_of_space_fails_its_peers_at_once(shm_dataset, shm_path, forked):
    peers = ctx.Queue()
    forked(_peer_polling_for_the_name, shm_dataset, shm_path, peers)
    assert receive(peers, "the peer's first look for the segment") == ("polling",)
    first = ctx.Queue()
    forked(_first_rank_out_of_space, shm_dataset, shm_path, first)
    assert "only 0 bytes are free" in first_error(first, "the first rank's own error")
    message = first_error(peers, "the peer of a first rank that ran out of space")
    assert "failed or died while the node's ranks attached" in message, message
    wait_for(lambda: not os.path.exists(shm_path), "the peer's removal of the abandoned segment")
    _only_the_marker_is_left(shm_path)


def test_a_whole_node_killed_during_set_up_is_cleaned_at_the_next_start(shm_dataset, shm_path, forked):
    first = _start_first_rank(shm_dataset, shm_path, forked)
    _kill(first)
    assert os.path.exists(shm_path)  # nobody of the job is left to remove it ...
    assert shm_path in remove_stale_segments("/dev/shm")  # ... so the same user's next start does


def test_stop_is_bounded_when_sigkill_does_not_end_the_producer(monkeypatch):
    # Not one of the fixture's children: the producer's poll() reaps it.
    child = ctx.Process(target=signal.pause, daemon=True)
    child.start()
    stuck = producer_module.ProducerProcess.__new__(producer_module.ProducerProcess)
    stuck.pid, stuck.exitcode = child.pid, None
    # Stands for a process in an uninterruptible read: the signal is sent but does not take effect.
    monkeypatch.setattr(producer_module.os, "kill", lambda pid, sig: None)
    result = []
    thread = threading.Thread(
        target=lambda: result.append(stuck.stop(timeout_s=0.2, kill_wait_s=1.0)), daemon=True
    )
    try:
        with pytest.warns(RuntimeWarning, match=rf"pid {child.pid}\) did not exit within 1 s of SIGKILL"):
            thread.start()
            thread.join(HANG_S)
        assert not thread.is_alive(), f"stop() still waits {HANG_S:.0f} s after a SIGKILL that did not take"
        assert result == [None]
    finally:
        monkeypatch.undo()
        os.kill(child.pid, signal.SIGKILL)
    wait_for(lambda: stuck.poll() is not None, "the stuck producer's reaping once it died")
    assert stuck.exitcode == -signal.SIGKILL


def _drop_without_close(dataset, path, queue):
    # Only what this child makes is collected below: garbage inherited from the forked pytest process
    # (earlier tests' process groups, thread pools) has finalizers that are not safe after a fork.
    gc.freeze()
    it = _iterator(dataset, path, 0, consumers=1)
    next(it)
    queue.put(it.producer.pid)
    del it
    gc.collect()
    queue.put("dropped")
    signal.pause()  # the rank lives on, until the test kills it


def test_a_loader_dropped_without_close_stops_its_producer(shm_dataset, shm_path, forked):
    # A producer whose rank lives waits for it (past TIMEOUT_S, even): only the drop ends it.
    queue = ctx.Queue()
    rank = forked(_drop_without_close, shm_dataset, shm_path, queue)
    producer_pid = receive(queue, "the producer's pid")
    assert receive(queue, "the rank's drop of its loader") == "dropped"
    wait_for(lambda: process_start_time(producer_pid) is None, "the exit of the dropped loader's producer")
    assert rank.is_alive()
    _kill(rank)


class _BrokenPinnedRing:
    """The GPU path's pinned ring when the CUDA context failed (a sticky error after a device
    fault): waiting for its copies raises."""

    def close(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_close_leaves_the_ring_and_stops_the_producer_even_when_cuda_fails(shm_dataset, shm_path):
    leader = _iterator(shm_dataset, shm_path, 0, consumers=1)
    next(leader)
    producer, segment = leader.producer, leader._ring.segment
    leader._handle.pinned = _BrokenPinnedRing()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        leader.close()
    assert producer.poll() is not None, "the producer outlived a close that CUDA failed"
    assert segment.fd < 0, "the rank still holds its lock: its peers would take it for alive"
