"""How the overlap schedules wait for a peer: on CUDA only the compute stream waits (a timed
``work.wait`` would block the host until the transfer ends); on gloo every wait is bounded."""

import threading
from concurrent.futures import Future
from contextlib import nullcontext
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_ext.layers.p2p import link as p2p_link
from megatron_ext.layers.p2p.link import OverlapGroup
from tests.helpers.flash_overlap import FakeGroup


class _Work:
    def __init__(self) -> None:
        self.waits: list[dict] = []

    def wait(self, *args, **kwargs) -> bool:
        self.waits.append(dict(enumerate(args)) | kwargs)
        return True


def _posted(work: _Work) -> "p2p_link.Posted":
    works: Future = Future()
    works.set_result([work])
    return p2p_link.Posted(works, receives=1, ops=1)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Enough of torch.cuda for the schedule's CUDA branch to run on a machine without a GPU."""
    streams = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute stream")
    monkeypatch.setattr(torch.cuda, "stream", lambda s: streams.append(s) or nullcontext())
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    return streams


def test_cuda_waits_are_stream_ordered_with_no_timeout(fake_cuda):
    link = p2p_link.Link(OverlapGroup(group=FakeGroup([0, 1])), torch.device("cuda", 0), "all-gather")
    work = _Work()
    link.wait(_posted(work), True, 1, "receive of slice 1")
    assert work.waits == [{}]  # no timeout: the host is not held until the transfer ends
    assert fake_cuda == ["compute stream"]  # the compute stream is the one made to wait


def test_gloo_waits_are_bounded_by_timeout_s(monkeypatch):
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    link = p2p_link.Link(
        OverlapGroup(group=FakeGroup([0, 1]), timeout_s=7), torch.device("cpu"), "all-gather"
    )
    work = _Work()
    link.wait(_posted(work), True, 1, "receive of slice 1")
    assert work.waits == [{"timeout": timedelta(seconds=7)}]


def test_gloo_posting_thread_is_stopped_by_shutdown_posters(monkeypatch):
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    posted_ops = []
    monkeypatch.setattr(dist, "P2POp", lambda *args, **kwargs: args)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: posted_ops.append(ops) or [_Work()])
    link = p2p_link.Link(OverlapGroup(group=FakeGroup([0, 1])), torch.device("cpu"), "all-gather")
    link.exchange(torch.zeros(1), 1, None, 1, step=0).works.result(timeout=10)
    thread_names = lambda: {t.name for t in threading.enumerate() if t.name.startswith("flash-overlap-p2p")}  # noqa: E731
    assert thread_names(), "gloo transfers are posted from a thread of their own"
    p2p_link.shutdown_posters()
    assert not thread_names() and len(posted_ops) == 1
    link.exchange(torch.zeros(1), 1, None, 1, step=1).works.result(
        timeout=10
    )  # a later step starts a new one
    p2p_link.shutdown_posters()
    assert len(posted_ops) == 2 and not thread_names()
