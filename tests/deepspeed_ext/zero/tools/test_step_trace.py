"""A traced step: which spans it records, what they sum to, and the trace file a user opens.

The sums are checked against steps laid out by hand, where each figure can be read off a timeline."""

from __future__ import annotations

import threading

import pytest
import torch

from deepspeed_ext.zero.tools.ab import trace_report
from deepspeed_ext.zero.tools.ab.step_trace import StepTrace
from mdsp_base import spans
from mdsp_base.spans import Span

MAIN, HOPS, STREAM = "MainThread", "hierarchical-zero-hops_0", "virtual device stream 0"


def _step() -> list[Span]:
    """A 10 s step on one rank, in whole seconds:

    main:   |fetch 0-3 (sleeps for the device 0.25-0.75, waits on the hops 1-3)|   |reduce hook 6-9 (waits 7-9)|
    hops:     queue 0-1, all_gather node 1-2, all_gather inter_node 1.5-2.5,
              reduce_scatter inter_node 7-9 (sleeps for the gradient's device op 7-8)
    device:                 matmul 3-6                 matmul 6-8
    """
    return [
        Span("step", "step", MAIN, 0, 10),
        Span("forward", "phase", MAIN, 0, 6),
        Span("backward", "phase", MAIN, 6, 9.5),
        Span("optimizer step", "phase", MAIN, 9.5, 10),
        Span("fetch parameters", "fetch", MAIN, 0, 3, {"forward": True}),
        Span("wait for device", "device wait", MAIN, 0.25, 0.75),
        Span("wait hops", "wait", MAIN, 1, 3),
        Span("hop queue", "queue", HOPS, 0, 1),
        Span("all_gather node", "gather", HOPS, 1, 2, {"link": "node"}),
        Span("all_gather inter_node", "gather", HOPS, 1.5, 2.5, {"link": "inter_node"}),
        Span("reorder gathered", "copy", HOPS, 2.5, 2.75),
        Span("reduce gradients", "reduce hook", MAIN, 6, 9),
        Span("wait hops", "wait", MAIN, 7, 9),
        Span("reduce_scatter inter_node", "reduce", HOPS, 7, 9, {"link": "inter_node"}),
        Span("wait for device", "device wait", HOPS, 7, 8),
        Span("matmul", "device", STREAM, 3, 6),
        Span("matmul", "device", STREAM, 6, 8),
    ]


def test_a_step_sums_to_what_its_timeline_shows():
    s = trace_report.summarize(_step())
    assert (s["step_s"], s["forward_s"], s["backward_s"], s["optimizer_s"]) == (10, 6, 3.5, 0.5)
    assert s["gather_wait_s"] == 3
    # 0.25-0.75 asleep for the device; 0-0.25 and 0.75-1 queued, 2.5-3 the reorder copy and the
    # wait's return (no gather in flight); 1-1.5 node only; 1.5-2.5 the inter-node hop is the slowest
    assert s["gather_wait_by_level"] == {"device": 0.5, "none": 1.0, "node": 0.5, "inter_node": 1.0}
    assert s["gather_busy_by_level"] == {"node": 1.0, "inter_node": 1.0}
    assert s["reduce_busy_by_level"] == {"inter_node": 1.0}  # 7-8 waited for the gradient, not the wire
    assert (s["reduce_hook_s"], s["hop_queue_s"], s["copy_s"], s["device_wait_s"]) == (3, 1, 0.25, 1.5)
    # the hooks' own host time: fetch 3 - 2.5 asleep or waiting, reduce hook 3 - 2 waiting
    assert s["hooks_host_s"] == 1.5
    assert s["device_busy_s"] == 5 and s["device_ops"] == 2  # 3-8, the two matmuls back to back


def test_overlapping_transfers_of_one_link_count_once_and_ranks_average():
    rank0 = [
        Span("step", "step", MAIN, 0, 4),
        *(Span("ag", "gather", f"lane{i}", i, i + 2, {"link": "node"}) for i in (0, 1)),
    ]
    rank1 = [Span("step", "step", MAIN, 0, 2)]
    per_rank = [trace_report.summarize(r) for r in (rank0, rank1)]
    assert per_rank[0]["gather_busy_by_level"] == {"node": 3}  # 0-2 and 1-3 in flight: 0-3
    mean = trace_report.mean_summary(per_rank)
    assert mean["step_s"] == 3 and mean["gather_busy_by_level"] == {"node": 1.5}


def test_a_trace_without_exactly_one_step_is_refused():
    with pytest.raises(ValueError, match="one 'step' span, these spans hold 0"):
        trace_report.summarize([Span("fetch parameters", "fetch", MAIN, 0, 1)])


def test_the_chrome_trace_has_a_process_per_rank_and_a_track_per_thread_from_each_steps_start():
    later = [Span(s.name, s.category, s.thread, s.start + 100, s.end + 100, s.args) for s in _step()]
    trace = trace_report.chrome_trace([_step(), later])
    events = trace["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert names == {(rank, t) for rank in (0, 1) for t in (MAIN, HOPS, STREAM)}
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == 2 * len(_step())
    fetch = [e for e in slices if e["name"] == "fetch parameters"]
    assert [(e["pid"], e["ts"], e["dur"]) for e in fetch] == [(0, 0, 3e6), (1, 0, 3e6)]


def test_the_table_has_a_row_per_variant_in_milliseconds():
    lines = trace_report.table({"ours": trace_report.summarize(_step())}).splitlines()
    assert len(lines) == 3
    assert lines[2].startswith(
        "| ours | 10000.0 | 5000.0 | 1500.0 | 3000.0 | device 500.0, inter_node 1000.0, node 500.0, none 1000.0 |"
    )


def test_spans_cost_nothing_and_record_nothing_without_a_log():
    with spans.span("x", "copy"):
        spans.record("y", "device", 0, 1)
    with spans.SpanLog() as log:
        with spans.span("x", "copy", bytes=4):
            pass
        threading.Thread(target=spans.record, args=("y", "device", 0.0, 1.0, "stream")).start()
    with spans.span("z", "copy"):  # the log is off again
        pass
    assert sorted((s.name, s.category) for s in log.spans) == [("x", "copy"), ("y", "device")]
    assert {s.name: s.thread for s in log.spans}["y"] == "stream"


def test_the_step_trace_wraps_deepspeeds_hooks_only_while_entered_and_records_collectives():
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as O

    before = (C.fetch_sub_module, C.release_sub_module, O.step)
    with StepTrace() as trace:
        assert C.fetch_sub_module is not before[0] and O.step is not before[2]
        spans.record("all_gather inter_node", "gather", 0.0, 1.0, link="inter_node")
        torch.zeros(1)
    assert (C.fetch_sub_module, C.release_sub_module, O.step) == before
    assert [s.name for s in trace.spans] == ["all_gather inter_node"]


def test_a_collective_is_a_span_and_an_asynchronous_one_its_launch_wait_and_flight(tmp_path):
    import torch.distributed as dist

    from mdsp_base import comm

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        out, block = torch.zeros(4), torch.ones(4)
        with spans.SpanLog() as log:
            comm.all_gather_into_tensor(out, block)
            work = comm.all_gather_into_tensor(out, block, async_op=True)
            work.wait()
        assert work.is_completed()  # the handle's own methods pass through
    finally:
        dist.destroy_process_group()
    got = [(s.name, s.category, s.args["bytes"], s.args["ranks"]) for s in log.spans]
    assert got == [
        ("all_gather 1 ranks", "gather", 16, 1),
        ("launch all_gather 1 ranks", "launch", 16, 1),
        ("wait all_gather 1 ranks", "wait", 16, 1),
        ("all_gather 1 ranks", "gather", 16, 1),
    ]
    launch, flight = log.spans[1], log.spans[3]
    assert flight.thread == "collectives in flight" and flight.start == launch.start
    assert flight.end == log.spans[2].end


def test_a_fetch_waiting_behind_a_hop_thread_asleep_for_the_device_waits_for_the_device():
    step = [
        Span("step", "step", MAIN, 0, 2),
        Span("fetch parameters", "fetch", MAIN, 0, 2, {"forward": True}),
        Span("wait for device", "device wait", HOPS, 0, 1),  # the gather's input not made yet
        Span("all_gather inter_node", "gather", HOPS, 0, 2, {"link": "inter_node"}),
    ]
    s = trace_report.summarize(step)
    assert s["gather_wait_by_level"] == {"device": 1, "inter_node": 1}
    assert s["gather_busy_by_level"] == {"inter_node": 1}


def test_a_trace_file_reads_back_as_each_ranks_spans_from_its_step_start(tmp_path):
    path = trace_report.trace_path(tmp_path, "zero++ (hpZ + qwZ + qgZ)")
    assert path.name == "zero_hpZ_qwZ_qgZ.trace.json.gz"
    later = [Span(s.name, s.category, s.thread, s.start + 100, s.end + 100, s.args) for s in _step()]
    trace_report.write_trace([_step(), later], path)
    back = trace_report.read_trace(path)
    assert len(back) == 2 and all(trace_report.summarize(r) == trace_report.summarize(_step()) for r in back)
