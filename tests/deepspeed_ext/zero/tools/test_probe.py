"""Hierarchical ZeRO's hops across nodes run the library's collective unless a profile measured on
this cluster (``python -m deepspeed_ext.zero.probe``) shows the point-to-point algorithm faster at
that size. The probe times every hop of the job's level groups; a job reads the profile only where
its topology and library versions are the ones measured, and says why otherwise."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import pytest

from deepspeed_ext.zero.config import HierarchicalZeroConfig, InterNodeAlgorithm
from deepspeed_ext.zero.cost.collectives import Algorithm, Operation
from deepspeed_ext.zero.cost.host import HostTiming
from deepspeed_ext.zero.cost.profile import Profile, ProfileError, Timing, load
from deepspeed_ext.zero.engine import hops
from deepspeed_ext.zero.engine.levels import HopSchedule
from mdsp_base.topology import LinkClass, Topology
from multirank.processes import launch_ranks

AG, RS = Operation.ALL_GATHER, Operation.REDUCE_SCATTER
RING, RECURSIVE = Algorithm.RING, Algorithm.RECURSIVE
TOPOLOGY = Topology(world_size=4, ranks_per_node=2, ranks_per_package=1)
TOPOLOGY_KEY = {"world_size": 4, "ranks_per_node": 2, "ranks_per_package": 1}
VERSIONS = {"torch": "2.13.0", "deepspeed": "0.19.8", "collectives": "NCCL 2.27.3"}
# Medians per (algorithm, bytes): recursive wins small messages, ring large ones.
MEASURED = {
    RING: {4096: 1e-3, 65536: 2e-3, 2**20: 10e-3},
    RECURSIVE: {4096: 0.5e-3, 65536: 2.5e-3, 2**20: 12e-3},
}


def _profile(measured: dict = MEASURED, operation: Operation = AG) -> Profile:
    timings = tuple(
        Timing(
            LinkClass.INTER_NODE, operation, algorithm, 2, 1, nbytes, (seconds * 1.1, seconds, seconds * 0.9)
        )
        for algorithm, series in measured.items()
        for nbytes, seconds in series.items()
    )
    return Profile(
        versions=VERSIONS,
        topology={"world_size": 4, "ranks_per_node": 2, "ranks_per_package": 1},
        timings=timings,
    )


def _plan(profile: Profile | None, algorithm: InterNodeAlgorithm = InterNodeAlgorithm.AUTO) -> HopSchedule:
    return HopSchedule(
        parent=(0, 1, 2, 3),
        sizes=(2, 2),
        groups=(None, None),  # type: ignore[arg-type]  (the choice reads no group)
        links=(LinkClass.NODE, LinkClass.INTER_NODE),
        inter_node=algorithm,
        profile=profile,
    )


def test_auto_without_a_profile_runs_the_librarys_collective_at_every_size():
    plan = _plan(None)
    for nbytes in (1, 4096, 2**20, 2**30):
        for operation in (AG, RS):
            assert hops.algorithm(plan, 1, operation, nbytes) == RING
    assert HierarchicalZeroConfig().inter_node_algorithm == "auto"
    assert HierarchicalZeroConfig().pipeline_chunks == 1


def test_auto_with_a_profile_runs_the_algorithm_measured_faster_at_that_size():
    plan = _plan(_profile())
    assert hops.algorithm(plan, 1, AG, 4096) == RECURSIVE
    assert hops.algorithm(plan, 1, AG, 65536) == RING
    assert hops.algorithm(plan, 1, AG, 2**20) == RING
    # between two sizes, log-log interpolation: recursive's median sqrt(0.5e-3 * 2.5e-3) = 1.12 ms is
    # below ring's fastest repeat sqrt(0.9e-3 * 1.8e-3) = 1.27 ms
    assert hops.algorithm(plan, 1, AG, 16384) == RECURSIVE
    assert hops.algorithm(plan, 1, RS, 4096) == RING  # reduce-scatter was not measured
    assert hops.algorithm(plan, 0, AG, 4096) == RING  # inside the node: always the library's
    assert hops.algorithm(_plan(_profile(), InterNodeAlgorithm.RING), 1, AG, 4096) == RING


def test_a_recursive_win_within_the_noise_keeps_the_librarys_collective():
    # one slow repeat of recursive's (0.3 s among 0.07 s) does not hide its win over ring's 0.29 s
    outlier = Profile(
        versions=VERSIONS,
        topology=dict(world_size=4, ranks_per_node=2, ranks_per_package=1),
        timings=(
            Timing(LinkClass.INTER_NODE, RS, RING, 2, 1, 4096, (0.293, 0.307, 0.311, 0.300, 0.301)),
            Timing(LinkClass.INTER_NODE, RS, RECURSIVE, 2, 1, 4096, (0.068, 0.073, 0.072, 0.070, 0.337)),
        ),
    )
    assert hops.algorithm(_plan(outlier), 1, RS, 4096) == RECURSIVE
    # recursive's median 0.95 ms beats ring's 1.0 ms, but not ring's fastest repeat (0.9 ms)
    close = {RING: {4096: 1e-3, 65536: 2e-3}, RECURSIVE: {4096: 0.95e-3, 65536: 2.5e-3}}
    assert hops.algorithm(_plan(_profile(close)), 1, AG, 4096) == RING


def test_measured_times_between_and_beyond_the_measured_sizes():
    profile = _profile()
    ring = lambda n: profile.seconds(LinkClass.INTER_NODE, AG, RING, 2, n)  # noqa: E731
    assert ring(4096) == pytest.approx(1e-3)
    assert ring(16384) == pytest.approx(math.sqrt(1e-3 * 2e-3))
    assert ring(1024) == pytest.approx(1e-3)  # below the smallest: its time
    # above the largest: the line through the two largest, (10 - 2) ms per (1 MiB - 64 KiB)
    assert ring(2**21) == pytest.approx(10e-3 + 8e-3 / (2**20 - 65536) * 2**20)
    assert profile.seconds(LinkClass.INTER_NODE, RS, RING, 2, 4096) is None


def test_the_fit_of_a_line_gives_its_step_latency_and_bandwidth():
    # a 2-member ring: 1 step, bus bytes n/2; 10 us + (n/2) / 1 GB/s
    line = {RING: {n: 10e-6 + n / 2 / 1e9 for n in (4096, 65536, 2**20, 2**24)}}
    fit = _profile(line).fit(LinkClass.INTER_NODE, AG, RING, 2)
    assert fit is not None
    assert fit.step_us == pytest.approx(10.0)
    assert fit.bus_gbps == pytest.approx(1.0)


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda d: "{not json", "not valid JSON"),
        (lambda d: {**d, "format": "other"}, "not a hierarchical ZeRO profile"),
        (lambda d: {**d, "version": 99}, "format version 99"),
        (lambda d: {**d, "topology": {**d["topology"], "world_size": 8}}, "world_size 8 (here 4)"),
        (
            lambda d: {**d, "versions": {**d["versions"], "collectives": "NCCL 2.18.1"}},
            "NCCL 2.18.1 (here NCCL 2.27.3)",
        ),
        (lambda d: {**d, "timings": [{"link": "inter_node"}]}, "corrupt"),
        (lambda d: {**d, "timings": [{**d["timings"][0], "seconds": []}]}, "corrupt"),
        (lambda d: {**d, "timings": [{**d["timings"][0], "seconds": [float("nan"), 1e-3]}]}, "finite"),
        (lambda d: {**d, "timings": [{**d["timings"][0], "seconds": [float("inf")]}]}, "finite"),
    ],
    ids=["json", "format", "version", "topology", "library", "fields", "no-times", "nan-time", "inf-time"],
)
def test_a_profile_that_does_not_fit_this_job_is_refused_with_the_reason(tmp_path, change, reason):
    good = _profile().to_json()
    assert load(_write(tmp_path, good), TOPOLOGY, VERSIONS).timings == _profile().timings
    with pytest.raises(ProfileError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        load(_write(tmp_path, change(good)), TOPOLOGY, VERSIONS)
    with pytest.raises(ProfileError, match="cannot read"):
        load(tmp_path / "absent.json", TOPOLOGY, VERSIONS)


HOST = (HostTiming(4, 10.0, (0.02, 0.03), (0.004,)), HostTiming(32, 66.0, (0.08,), (0.01, 0.02)))


def test_the_engines_host_cost_round_trips_and_a_format_1_profile_reads_without_it(tmp_path):
    written = Profile(VERSIONS, TOPOLOGY_KEY, _profile().timings, HOST)
    data = json.loads(json.dumps(written.to_json()))
    assert data["version"] == 2 and data["host"][1] == {
        "modules": 32,
        "fetches": 66.0,
        "engine_seconds": [0.08],
        "plain_seconds": [0.01, 0.02],
    }
    assert load(_write(tmp_path, data), TOPOLOGY, VERSIONS) == written
    # format 1, as the probe wrote it before it timed the engine: collectives only, no host cost
    old = {k: v for k, v in data.items() if k != "host"} | {"version": 1}
    assert load(_write(tmp_path, old), TOPOLOGY, VERSIONS).host == ()
    for bad in ({**data["host"][0], "plain_seconds": []}, {**data["host"][0], "fetches": 0}):
        with pytest.raises(ProfileError, match="corrupt.*host timing"):
            load(_write(tmp_path, {**data, "host": [bad]}), TOPOLOGY, VERSIONS)
    with pytest.raises(ProfileError, match="corrupt"):  # format 2 without its host timings
        load(_write(tmp_path, {k: v for k, v in data.items() if k != "host"}), TOPOLOGY, VERSIONS)


def _job_reads(path: str) -> tuple[bool, list[str]]:
    """On a rank: whether a job of 4 ranks as 2 nodes uses the profile, and what rank 0 logged."""
    from deepspeed_ext.zero.engine.api import logger, measured_profile

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        profile = measured_profile(HierarchicalZeroConfig(enabled=True, profile=path), TOPOLOGY)
        no_profile = measured_profile(HierarchicalZeroConfig(enabled=True), TOPOLOGY)
    finally:
        logger.removeHandler(handler)
    return profile is not None and no_profile is None, messages


PROBE = """
import sys
from deepspeed_ext.zero.tools import probe
from multirank.processes import write_result
probe.main(sys.argv[1:])
write_result(True)
"""


def test_the_probe_times_every_hop_and_a_job_of_its_topology_reads_it(tmp_path, run_ranks):
    out = tmp_path / "profile.json"
    argv = [
        "-c",
        PROBE,
        "--out",
        str(out),
        "--ranks-per-package",
        "1",
        "--largest",
        "65536",
        "--repeats",
        "2",
    ]
    launch_ranks(argv, 4, timeout=240, ranks_per_node=2)
    profile = load(out, TOPOLOGY)
    measured = {(t.link, t.operation, t.algorithm, t.members) for t in profile.timings}
    hops = {(LinkClass.NODE, op, RING, 2) for op in (AG, RS)} | {
        (LinkClass.INTER_NODE, op, algorithm, 2) for op in (AG, RS) for algorithm in (RING, RECURSIVE)
    }
    # and the whole job's group, which stock ZeRO-3 runs: its collectives, and the scalars once
    flat = {(LinkClass.INTER_NODE, op, RING, 4) for op in (AG, RS, Operation.ALL_REDUCE, Operation.BROADCAST)}
    assert measured == hops | flat
    for t in profile.timings:
        assert len(t.seconds) == 2 and min(t.seconds) > 0
    assert {t.nbytes for t in profile.timings} == {4096, 16384, 65536}
    scalars = [t for t in profile.timings if t.operation in (Operation.ALL_REDUCE, Operation.BROADCAST)]
    assert {t.nbytes for t in scalars} == {4096}
    assert {(t.members, t.link) for t in profile.hop_timings()} == {
        (2, LinkClass.NODE),
        (2, LinkClass.INTER_NODE),
    }
    assert profile.versions["collectives"].startswith("gloo")
    # the engine's host cost: each stack stepped as ZeRO-3 and as plain torch, 2 repeats each;
    # DeepSpeed fetches every linear layer and the stack itself, in forward and in backward
    assert [(t.modules, t.fetches) for t in profile.host] == [(4, 2 * 5), (32, 2 * 33)]
    for t in profile.host:
        assert len(t.engine_seconds) == len(t.plain_seconds) == 2 and min(t.engine_seconds) > 0

    used, messages = run_ranks(4, _job_reads, str(out))[0]
    assert used
    assert any("read the profile" in m for m in messages)
    assert any("no profile measured on this cluster" in m and "library's collective" in m for m in messages)

    other = tmp_path / "other.json"
    other.write_text(json.dumps({**profile.to_json(), "topology": {**profile.topology, "ranks_per_node": 4}}))
    for used, messages in run_ranks(4, _job_reads, str(other)):  # the reason on every rank
        assert not used
        assert any(
            "another topology" in m and "runs every hop on the library's collectives" in m for m in messages
        )


def test_the_planner_charges_the_fitted_step_latency_and_bandwidth_of_what_the_profile_measured():
    from deepspeed_ext.zero.cost.collectives import FRONTIER_RCCL

    # across nodes: a 2-member ring, 1 step and n/2 bus bytes: 10 us + (n/2) / 1 GB/s, 3 groups at once
    line = tuple(
        Timing(LinkClass.INTER_NODE, AG, RING, 2, 3, n, (10e-6 + n / 2 / 1e9,)) for n in (4096, 2**20, 2**24)
    )
    costs = Profile(VERSIONS, {"world_size": 4}, line).costs(FRONTIER_RCCL)
    fit = costs.fit(AG, RING, LinkClass.INTER_NODE)
    assert fit.step_us == pytest.approx(10.0) and fit.bus_gbps == pytest.approx(1.0)
    assert costs.nic_gbps == pytest.approx(3.0)  # what 3 concurrent communicators got together
    # what it did not measure keeps the documented figures
    assert costs.fit(RS, RING, LinkClass.INTER_NODE) == FRONTIER_RCCL.fit(RS, RING, LinkClass.INTER_NODE)
    assert costs.fit(AG, RING, LinkClass.PACKAGE) == FRONTIER_RCCL.fit(AG, RING, LinkClass.PACKAGE)


def test_the_probes_help_shows_every_flags_default(capsys):
    from deepspeed_ext.zero.tools.probe import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    options = capsys.readouterr().out.split("options:", 1)[1]
    entries = re.split(r"\n  (?=-)", options)  # one per flag, its help wrapped onto further lines
    lines = {entry.split()[0]: " ".join(entry.split()) for entry in entries if entry.strip()}
    shown = {
        "--smallest": "4096",
        "--largest": "268435456",
        "--repeats": "5",
        "--max-call-s": "0.5",
        "--budget-s": "90.0",
    }
    for flag, default in shown.items():
        assert lines[flag].endswith(f"(default: {default})"), lines[flag]
    for flag in ("--deepspeed-config", "--ranks-per-node", "--ranks-per-package", "--sizes", "--dtype"):
        assert "(default: " in lines[flag] and "None" not in lines[flag], lines[flag]
