"""Asynchronous hops on CPU: the dispatcher returns before the hops run, the handle completes when
they have, work runs in the order it was asked for, and a failure surfaces in ``wait``."""

from __future__ import annotations

import threading

import pytest
import torch

from deepspeed_ext.zero.engine.hop_worker import HopWorker, Stage
from mdsp_base import comm
from mdsp_base.topology import Topology

CPU = torch.device("cpu")


def test_handle_completes_when_the_work_does_and_work_keeps_its_order():
    worker, gate, order = HopWorker(), threading.Event(), []
    try:
        first = worker.submit(CPU, lambda: (gate.wait(10), order.append("first")))
        second = worker.submit(CPU, lambda: order.append("second"))
        assert not first.is_completed() and not second.is_completed()  # returned before running
        gate.set()
        assert second.wait() and first.is_completed()
        assert order == ["first", "second"]
        assert worker.run(CPU, lambda: torch.is_grad_enabled()) is False  # hops never build graphs
    finally:
        gate.set()
        worker.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("hierarchical-zero-hops")]


def test_a_failed_hop_raises_in_wait():
    worker = HopWorker()
    try:
        handle = worker.submit(CPU, lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            handle.wait()
    finally:
        worker.shutdown()


def test_bytes_are_counted_in_the_phase_that_asked_for_them():
    counter, worker = (
        comm.CommCounter(Topology(world_size=1, ranks_per_node=1, ranks_per_package=1)),
        HopWorker(),
    )
    seen = []
    try:
        with comm.counting(counter), counter.phase("forward"):
            handle = worker.submit(CPU, lambda: seen.append(counter.current_phase))
            with counter.phase("backward"):
                handle.wait()
                assert counter.current_phase == "backward"
    finally:
        worker.shutdown()
    assert seen == ["forward"]


def test_cpu_tensors_run_on_the_worker_thread():
    worker, names = HopWorker(), []
    try:
        assert worker.submit(CPU, lambda: names.append(threading.current_thread().name)).wait()
        names.append(worker.run(CPU, lambda: threading.current_thread().name))
        assert len(names) == 2 and all(name.startswith("hierarchical-zero-hops") for name in names)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("device", [torch.empty(1, device="meta").device, torch.device("xpu")])
def test_other_device_types_are_refused_naming_the_type(device):
    """Only CPU (worker thread) and cuda (CUDA and ROCm streams) have an owner for the hops; another
    accelerator must not fall into the CPU path."""
    worker, ran = HopWorker(), []
    try:
        for call in (worker.submit, worker.run):
            with pytest.raises(ValueError, match=rf"'{device.type}' tensors.*'cpu'.*'cuda'"):
                call(device, lambda: ran.append(1))
    finally:
        worker.shutdown()
    assert not ran and worker._pool is None  # nothing ran, no thread started


def test_stages_of_different_groups_run_at_once_each_group_in_order_and_whole_operations_fence():
    """A pipelined operation's stages run on a lane per group: a stage of one group can wait for a
    stage of another group asked for after it (one thread would never get there); a group's stages
    keep the order they were asked for; a whole operation runs after every earlier stage and before
    every later one."""
    worker, order = HopWorker(), []
    inner, outer, other = object(), object(), object()
    crossed = threading.Event()

    def outer_waits_for_inner() -> None:
        order.append(("outer", crossed.wait(10)))

    try:
        first = worker.submit_stages(
            CPU,
            [
                Stage(outer, outer_waits_for_inner),
                Stage(outer, lambda: order.append(("outer", "second"))),
                Stage(inner, crossed.set),
                Stage(other, lambda: order.append(("other", "after inner")), after=(2,)),
            ],
        )
        fence = worker.submit(CPU, lambda: order.append(("fence", first.is_completed())))
        later = worker.submit_stages(CPU, [Stage(inner, lambda: order.append(("inner", "after fence")))])
        assert later.wait() and fence.wait()
    finally:
        crossed.set()
        worker.shutdown()
    assert order.index(("outer", True)) < order.index(("outer", "second"))
    assert ("other", "after inner") in order
    assert order[-2:] == [("fence", True), ("inner", "after fence")]
