"""The allocation trace behind the benchmarks' peak memory: tensors of known sizes, read back."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.profiler import record_function

from mdsp_base.allocations import AllocationTrace

MB = 1 << 20


def _tensor(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def test_peak_is_the_most_bytes_live_at_once() -> None:
    with AllocationTrace() as trace:
        kept = _tensor(1 * MB)
        brief = _tensor(2 * MB)
        del brief
        later = _tensor(MB // 2)
    assert trace.peak() == 3 * MB
    del kept, later


def test_region_peak_counts_what_was_live_when_it_began() -> None:
    with AllocationTrace() as trace:
        before = _tensor(3 * MB)
        gone = _tensor(4 * MB)
        del gone  # freed before the region: not part of its peak
        with record_function("region"):
            inside = _tensor(MB)
            del inside
        after = _tensor(8 * MB)  # after the region: not part of its peak
    assert trace.peak("region") == 4 * MB
    assert trace.peak() == 11 * MB
    del before, after


def test_a_region_that_never_ran_is_refused_by_name() -> None:
    with AllocationTrace() as trace:
        _tensor(MB)
    with pytest.raises(ValueError, match="'step'"):
        trace.peak("step")


def test_process_peak_counts_every_thread_and_frees_wherever_they_happen() -> None:
    held: list[torch.Tensor] = []
    with AllocationTrace() as trace:
        main = _tensor(MB)
        worker = threading.Thread(target=lambda: held.append(_tensor(2 * MB)))  # allocated off-thread
        worker.start()
        worker.join()
        with record_function("region"):
            marker = _tensor(1)  # the calling thread's allocation that samples the total
            dropper = threading.Thread(target=held.clear)  # freed off-thread
            dropper.start()
            dropper.join()
            after_free = _tensor(1)
    assert trace.process_peak("region") == 3 * MB + 1
    assert trace.process_peak() == 3 * MB + 1
    assert trace.peak() == MB + 2  # the calling thread's own bytes never saw the 2 MB
    del main, marker, after_free
