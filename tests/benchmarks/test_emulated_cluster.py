"""Emulated cluster: spec validation (fast) and a shaped two-namespace smoke test (root, ip, tc)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator

import pytest

from benchmarks.cluster import ClusterSpec, ClusterUnavailable, EmulatedCluster, RankFailure, netns
from benchmarks.cluster.spec import frontier, frontier_latency, generic
from benchmarks.studies.cluster.calibrate import calibrate, main, shared_nic_flows
from benchmarks.studies.zero.scale import answers, targets
from benchmarks.zero.variants import Question, scale_variants
from deepspeed_ext.zero.config import HierarchicalZeroConfig
from multirank.warm import WarmLauncher

PREFIX = "emct"  # not the default prefix, so a calibration running at the same time is left alone
HAVE_NETNS = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


def test_spec_validation_names_every_factor() -> None:
    with pytest.raises(ValueError) as err:
        ClusterSpec(0, 2, -1, 400.0, 0.0, 900.0)
    msg = str(err.value)
    for factor in ("nodes=0", "ranks_per_package=-1", "node_mbit=0.0", "inter_node_mbit=900.0"):
        assert factor in msg
    assert "packages_per_node" not in msg and "package_mbit=400" not in msg
    with pytest.raises(ValueError, match=r"packages_per_node=100 x ranks_per_package=4"):
        ClusterSpec(1, 100, 4, 100.0, 100.0, 100.0)
    with pytest.raises(ValueError, match=r"= 72 ranks exceeds 64"):
        ClusterSpec(9, 4, 2, 100.0, 100.0, 100.0)


def test_spec_layout_addresses_and_link_classes() -> None:
    spec = frontier()
    assert (spec.world_size, spec.ranks_per_node) == (8, 4)
    assert (spec.package_mbit, spec.node_mbit, spec.inter_node_mbit) == (400.0, 200.0, 50.0)
    assert [spec.link_class(0, peer) for peer in range(1, 8)] == ["package"] + ["node"] * 2 + [
        "inter_node"
    ] * 4
    assert [spec.sample_pair(link) for link in spec.link_classes()] == [(0, 1), (0, 2), (0, 4)]
    assert len({spec.address(r) for r in range(8)}) == 8
    place = spec.place(6)
    assert (place.node, place.package, place.local_in_package, place.local_rank) == (1, 1, 0, 2)
    # The u32 prefix of a rank's package must cover exactly the ranks of that package.
    assert spec.address(6) == "10.77.1.4" and spec.package_net(6) == "10.77.1.4/31"
    assert generic(nodes=3, ranks_per_node=2).link_classes() == ["node", "inter_node"]
    with pytest.raises(SystemExit):
        main(["--profile", "frontier", "--node-mbit", "-5"])


def test_latency_spec_and_the_scale_benchmark_variants() -> None:
    with pytest.raises(ValueError) as err:
        ClusterSpec(2, 1, 2, 400.0, 200.0, 50.0, package_latency_ms=-1.0, inter_node_latency_ms=500.0)
    assert "package_latency_ms=-1.0" in str(err.value) and "inter_node_latency_ms=500.0" in str(err.value)
    spec = frontier_latency()  # 8 nodes of one MI250X: 16 ranks, 2 per NIC
    assert (spec.world_size, spec.ranks_per_node, spec.ranks_per_nic) == (16, 2, 2)
    assert (spec.package_latency_ms, spec.node_latency_ms, spec.inter_node_latency_ms) == (2.0, 4.0, 10.0)
    assert spec.delayed_classes() == ["package", "inter_node"]  # one package per node: no node link
    assert frontier_latency(nodes=6, scale=0).delayed_classes() == []
    variants = scale_variants(2, 4, ["recursive", "auto"])
    assert [v.role for v in variants.values()] == [
        "flat",
        "hpz",
        "zero++",
        "serial",
        "pipelined",
        "pipelined",
    ]
    assert variants["hpZ(2)"].zero == {"zero_hpz_partition_size": 2}  # = ours' node-level secondary
    for v in variants.values():
        if v.ours:  # every key is one the engine's config has
            HierarchicalZeroConfig(enabled=True, secondary_level="node", **v.hierarchical)
    rows = {
        "hpZ(2)": {"role": "hpz", "median": 3.0},
        "serial": {"role": "serial", "median": 2.0},
        "a": {"role": "pipelined", "median": 1.9},
        "b": {"role": "pipelined", "median": 1.5},
    }
    assert [(t["ours"], t["against"], t["ratio"], t["met"]) for t in targets(rows)] == [
        ("b", "hpZ(2)", 2.0, True),
        ("b", "serial", pytest.approx(1.333, abs=1e-3), True),
    ]


def test_each_question_runs_variants_that_differ_in_that_alone() -> None:
    algorithm = scale_variants(2, 4, ["recursive"], Question.ALGORITHM)
    assert [v.hierarchical for v in algorithm.values()] == [
        {"inter_node_algorithm": "ring", "pipeline_chunks": 1},
        {"inter_node_algorithm": "recursive", "pipeline_chunks": 1},
    ]
    pipelining = scale_variants(2, 4, ["ring"], Question.PIPELINING)
    assert [v.hierarchical for v in pipelining.values()] == [
        {"inter_node_algorithm": "ring", "pipeline_chunks": 1},
        {"inter_node_algorithm": "ring", "pipeline_chunks": 4},
    ]
    baselines = scale_variants(2, 4, ["ring"], Question.BASELINES)
    assert [(v.ours, v.zero) for v in baselines.values()] == [
        (False, {}),
        (False, {"zero_hpz_partition_size": 2}),
        (True, {}),
    ]
    # a ratio is claimed only where the min-max ranges do not overlap
    rows = {
        "a": {"median": 2.0, "min": 1.9, "max": 2.2},
        "b": {"median": 1.0, "min": 0.9, "max": 1.1},
        "c": {"median": 0.9, "min": 0.8, "max": 1.0},
    }
    assert [(q["ratio"], q["separated"]) for q in answers(rows, Question.BASELINES)] == [
        (2.0, True),
        (pytest.approx(1.111, abs=1e-3), False),
    ]
    assert answers(dict(list(rows.items())[:2]), Question.ALGORITHM)[0]["separated"]


def test_a_package_shares_one_inter_node_link() -> None:
    spec = frontier()  # 2 nodes x 2 packages x 2: NICs 0, 1 on node 0 and 2, 3 on node 1
    assert [spec.nic(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3] and spec.ranks_per_nic == 2
    own = frontier(shared_nic=False)
    assert [own.nic(r) for r in range(8)] == list(range(8)) and own.ranks_per_nic == 1
    # Both ranks of package 0 send to node 1 at once (through one NIC's tx), and receive from it (its rx).
    assert shared_nic_flows(spec) == [
        ("inter_node tx shared by a package", [[0, 4], [1, 5]]),
        ("inter_node rx shared by a package", [[4, 0], [5, 1]]),
    ]
    assert shared_nic_flows(own) == [] and shared_nic_flows(generic()) == []


def test_missing_prerequisites_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda _tool: None)
    with pytest.raises(ClusterUnavailable) as err:
        netns.check_prerequisites()
    for needed in ("root", "'ip'", "'tc'", "iproute2"):
        assert needed in str(err.value)


def shaped(measured_mbit: float, rate_mbit: float) -> bool:
    """A rate a shaped link gives: at most the configured rate (+25 %: tc's bucket lets a burst
    through at the start of a short transfer), and more than half of it. Unshaped loopback runs at
    Gbit/s; at these rates the sender needs a few per cent of a core, so even a fully loaded host
    does not halve them: below half, the shaping is wrong, not the host busy."""
    return rate_mbit / 2 < measured_mbit <= 1.25 * rate_mbit


@pytest.fixture(scope="module")
def warm() -> Iterator[WarmLauncher]:
    """Ranks forked after importing torch.distributed (the link tests' ranks: what they measure is the
    links, and test_a_warm_launch_puts_each_rank_in_its_namespace_as_a_cold_one_does checks the ranks)."""
    with WarmLauncher(
        dict(os.environ), preload=["torch.distributed", "benchmarks.studies.cluster.p2p"]
    ) as launcher:
        yield launcher


def _leftovers() -> tuple[list[str], list[str]]:
    return netns.list_namespaces(PREFIX), netns.list_host_links(PREFIX)


@pytest.mark.netns
@pytest.mark.skipif(not HAVE_NETNS, reason="needs root and the ip and tc commands (iproute2)")
def test_shaped_link_bandwidth_failures_and_teardown() -> None:
    subprocess.run(["ip", "netns", "add", f"{PREFIX}-r7"], check=True)  # leftover of a "killed" run
    spec = ClusterSpec(1, 1, 2, 200.0, 200.0, 200.0, name="smoke")
    (link,) = calibrate(spec, mbytes=4.0, repeats=3, timeout=60.0, prefix=PREFIX)
    assert link.link == "package" and link.samples == 6
    assert shaped(link.measured_mbit, 200.0), link
    assert _leftovers() == ([], [])

    with EmulatedCluster(spec, prefix=PREFIX) as cluster:
        show = "from benchmarks.cluster import write_result; import os; write_result([os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'EMU_NODE', 'GLOO_SOCKET_IFNAME', 'MASTER_ADDR', 'CALLER')])"
        assert cluster.launch(["-c", show], timeout=30, env={"CALLER": "x"}) == [
            ["0", "0", "0", "eth0", "10.77.0.2", "x"],
            ["1", "1", "0", "eth0", "10.77.0.2", "x"],
        ]
        with pytest.raises(RankFailure, match=r"(?s)exit codes \[3.*boom"):
            cluster.launch(["-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"], timeout=30)
        with pytest.raises(RankFailure, match=r"timeout after 1 s, ranks \[0, 1\]"):
            cluster.launch(["-c", "import time; time.sleep(60)"], timeout=1)
    assert _leftovers() == ([], [])

    # SIGTERM (as from a job scheduler) must unwind through the context manager's teardown.
    with pytest.raises(SystemExit), EmulatedCluster(spec, prefix=PREFIX):
        assert len(_leftovers()[0]) == 3
        os.kill(os.getpid(), signal.SIGTERM)
    assert _leftovers() == ([], [])


# Each rank's own address, as the route to the master chooses it: a rank's namespace has only its link.
# (Its /sys, which a warm rank mounts afresh as ip netns exec does, is read by the shared-NIC test.)
WHERE = """
import os, socket, torch.distributed as dist
from benchmarks.cluster import write_result
dist.init_process_group("gloo")
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect((os.environ["MASTER_ADDR"], 9))
write_result([os.environ["RANK"], probe.getsockname()[0], os.environ["CALLER"]])
"""


@pytest.mark.netns
@pytest.mark.skipif(not HAVE_NETNS, reason="needs root and the ip and tc commands (iproute2)")
def test_a_warm_launch_puts_each_rank_in_its_namespace_as_a_cold_one_does(warm: WarmLauncher) -> None:
    spec = ClusterSpec(2, 1, 1, 200.0, 200.0, 200.0, name="smoke")
    with EmulatedCluster(spec, prefix=PREFIX) as cluster:
        cold = cluster.launch(["-c", WHERE], timeout=60, env={"CALLER": "x"})
    with EmulatedCluster(spec, prefix=PREFIX, warm=warm) as cluster:
        assert cluster.launch(["-c", WHERE], timeout=60, env={"CALLER": "x"}) == cold
        assert cold == [["0", spec.address(0), "x"], ["1", spec.address(1), "x"]]
        failed = r"ranks \[0\] failed with exit codes \[1\]\n--- rank 0 stderr \(tail\) ---\nboom\n"
        with pytest.raises(RankFailure, match=failed):
            cluster.launch(
                ["-c", "import os, sys; os.environ['RANK'] == '0' and sys.exit('boom')"], timeout=30
            )
        with pytest.raises(RankFailure, match=r"still running after 1 s"):
            cluster.launch(["-c", "import time; time.sleep(60)"], timeout=1)
    assert _leftovers() == ([], [])


SEND_AND_COUNT = """
import torch, torch.distributed as dist
from benchmarks.cluster import write_result
from benchmarks.cluster.netns import sent_bytes
dist.init_process_group("gloo")
payload = torch.zeros(250_000)  # 1 MB
dist.barrier()
before = sent_bytes()
if dist.get_rank() == 0:
    dist.send(payload, 2)  # rank 2 sits on the other node
elif dist.get_rank() == 2:
    dist.recv(payload, 0)
dist.barrier()  # the receiver has it all: the bytes have left the sender's queues
after = sent_bytes()
write_result({k: after[k] - before[k] for k in after})
"""


@pytest.mark.netns
@pytest.mark.skipif(not HAVE_NETNS, reason="needs root and the ip and tc commands (iproute2)")
def test_shared_nic_halves_each_flow_and_wire_bytes_are_counted_per_class(warm: WarmLauncher) -> None:
    spec = ClusterSpec(2, 1, 2, 200.0, 200.0, 40.0, name="shared")  # 2 nodes, one package (one NIC) each
    rows = {
        r.link: r for r in calibrate(spec, mbytes=0.5, repeats=2, timeout=120.0, prefix=PREFIX, warm=warm)
    }
    assert shaped(rows["inter_node"].measured_mbit, 40.0), rows["inter_node"]
    for label in ("inter_node tx shared by a package", "inter_node rx shared by a package"):
        # Two flows through one 40 Mbit/s link: together 40, not the 80 of two own links.
        assert shaped(rows[label].measured_mbit, 40.0), rows[label]
    with EmulatedCluster(spec, prefix=PREFIX, warm=warm) as cluster:
        sent = cluster.launch(["-c", SEND_AND_COUNT], timeout=60)
    # Rank 0 put the 1 MB (plus TCP/IP headers, < 2 % at MTU 9000) on its inter-node class only.
    assert 1_000_000 <= sent[0]["inter_node"] < 1_030_000 and sent[0]["package"] < 10_000, sent[0]
    assert 1_000_000 <= sent[0]["total"] < 1_040_000
    assert sent[2]["inter_node"] < 100_000  # the receiver only acknowledges
    assert _leftovers() == ([], [])


PING_PONG = """
import time, torch, torch.distributed as dist
from benchmarks.cluster import write_result
dist.init_process_group("gloo")
token, rtt = torch.zeros(1), {}
for peer in range(1, dist.get_world_size()):
    times = []
    for _ in range(6):
        dist.barrier()
        if dist.get_rank() == 0:
            start = time.perf_counter()
            dist.send(token, peer)
            dist.recv(token, peer)
            times.append(time.perf_counter() - start)
        elif dist.get_rank() == peer:
            dist.recv(token, 0)
            dist.send(token, 0)
    # The fastest round trip: the first one pays the connection set-up, and on a loaded host others
    # wait for a core; no round trip can beat the delays.
    rtt[peer] = min(times[1:]) * 1000 if times else None
write_result(rtt)
"""


@pytest.mark.netns
@pytest.mark.skipif(not HAVE_NETNS, reason="needs root and the ip and tc commands (iproute2)")
def test_latency_per_link_class_round_trips(warm: WarmLauncher) -> None:
    spec = frontier_latency(nodes=2, scale=2000)  # one way: package 4 ms, inter-node 20 ms
    with EmulatedCluster(spec, prefix=PREFIX, warm=warm) as cluster:
        rtt = cluster.launch(["-c", PING_PONG], timeout=60)[0]
    one_way = {"1": spec.package_latency_ms, "2": spec.inter_node_latency_ms, "3": spec.inter_node_latency_ms}
    # A round trip crosses the link twice and cannot beat the delay line, however loaded the host.
    for peer, delay in one_way.items():
        assert rtt[peer] >= 2 * delay, (peer, rtt)
    # Each class has its own delay: the inter-node round trips exceed the package one by at least half
    # the configured difference (32 ms), a margin that load cannot close unless every one of the five
    # package round trips waits 16 ms for a core. No upper bound: a busy host only adds time.
    margin = (2 * one_way["2"] - 2 * one_way["1"]) / 2
    for peer in ("2", "3"):
        assert rtt[peer] - rtt["1"] > margin, (peer, rtt)
    assert _leftovers() == ([], []) and not netns._DELAY_LINES
