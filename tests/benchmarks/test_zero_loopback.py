"""``benchmarks.zero.loopback``: the host-term check runs as a user runs two nodes, on one host, and
refuses what would spoil it."""

from __future__ import annotations

import pytest

from benchmarks.zero.loopback import agents, main, run_agents


def test_two_torchrun_agents_of_two_ranks_meet_on_loopback():
    argv = agents(["-m", "deepspeed_ext.zero.probe"], 29555)
    assert len(argv) == 2
    for node, command in enumerate(argv):
        flags = dict(zip(command[3:13:2], command[4:14:2]))
        assert command[1:3] == ["-m", "torch.distributed.run"]
        assert flags == {
            "--nnodes": "2", "--node-rank": str(node), "--nproc-per-node": "2",
            "--master-addr": "127.0.0.1", "--master-port": "29555",
        }  # fmt: skip
        assert command[-2:] == ["-m", "deepspeed_ext.zero.probe"]


def test_a_busy_host_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(SystemExit, match="load average .* > --max-load -1"):
        main(["--max-load", "-1", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_a_failing_rank_stops_both_agents_and_names_the_command():
    with pytest.raises(RuntimeError, match="no_such_module"):
        run_agents(["-m", "no_such_module"], timeout=120)


def test_the_validation_page_shows_the_loopback_runs_traced_steps_when_they_exist(tmp_path):
    from benchmarks.device.validation import loopback_trace_lines

    assert loopback_trace_lines(tmp_path) == []
    table = tmp_path / "zero" / "bench_quick_loopback_trace" / "trace.md"
    table.parent.mkdir(parents=True)
    table.write_text("| variant | step |\n|---|---|\n| zero3 | 87.8 |\n")
    assert loopback_trace_lines(tmp_path)[-3:] == ["| variant | step |", "|---|---|", "| zero3 | 87.8 |"]
