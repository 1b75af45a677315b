"""A step predicted from its parts: the measured compute, each collective the engine launched at the
probe's median for its group and size, and the all-gathers DeepSpeed's prefetching hides. Checked
against hand arithmetic; the prediction against measured steps is the A/B command's
(``python -m benchmarks.zero.ab``, and ``tests/deepspeed_ext/zero/tools/test_zero_ab.py`` on a small run)."""

from __future__ import annotations

import pytest

from deepspeed_ext.zero.cost import collectives
from deepspeed_ext.zero.cost.collectives import (
    FRONTIER_RCCL,
    Algorithm,
    AlgorithmFit,
    CollectiveCosts,
    Operation,
)
from deepspeed_ext.zero.cost.host import HostTiming
from deepspeed_ext.zero.cost.profile import Profile, Timing
from deepspeed_ext.zero.cost.step import call_seconds, overlapped, predict, prefetch_hidden
from mdsp_base.topology import LinkClass
from mdsp_base.volume import CallKey

INTER, PACKAGE = LinkClass.INTER_NODE, LinkClass.PACKAGE
AG, RS = Operation.ALL_GATHER, Operation.REDUCE_SCATTER
RING = Algorithm.RING
TOPOLOGY = {"world_size": 8, "ranks_per_node": 2, "ranks_per_package": 2}
VERSIONS = {"torch": "2.13.0", "deepspeed": "0.19.8", "collectives": "gloo"}
# The cross-node hop (4 members, 2 groups per node at once) at 1 MB and 4 MB, and the flat group.
PROFILE = Profile(
    VERSIONS,
    TOPOLOGY,
    (
        Timing(INTER, AG, RING, 4, 2, 2**20, (0.30, 0.20, 0.25)),
        Timing(INTER, AG, RING, 4, 2, 2**22, (0.90, 0.80, 1.00)),
        Timing(INTER, RS, RING, 4, 2, 2**20, (0.40,)),
        Timing(INTER, RS, RING, 4, 2, 2**22, (1.30,)),
        Timing(INTER, AG, RING, 8, 1, 2**20, (0.50, 0.60, 0.55)),
        Timing(INTER, Operation.BROADCAST, RING, 8, 1, 4096, (0.07,)),
    ),
)
NO_PACKAGE_FIT = CollectiveCosts("none", {(PACKAGE, RING): AlgorithmFit(step_us=1000.0, bus_gbps=0.5)}, 1.0)


def _call(op: Operation, link: LinkClass, members: int, nbytes: int) -> CallKey:
    return CallKey(str(op), "ring", str(link), members, nbytes)


def test_each_launch_is_charged_the_profiles_median_for_its_group_and_size():
    calls = {
        _call(AG, INTER, 4, 2**20): 3,  # the hop's median 0.25 s
        _call(AG, INTER, 8, 2**20): 2,  # the flat group's median 0.55 s
        _call(Operation.BROADCAST, INTER, 8, 8): 1,  # below the smallest size: its time, 0.07 s
    }
    p = predict(PROFILE, calls, 0.0, None, 2, 0, 0, FRONTIER_RCCL)
    assert p.comm_s == pytest.approx(3 * 0.25 + 2 * 0.55 + 0.07)
    assert p.step_s == pytest.approx(p.comm_s) and p.hidden_s == 0.0


def test_between_measured_sizes_the_time_is_interpolated_in_log_log():
    # 2 MB is halfway between 1 MB and 4 MB in log size: the geometric mean of 0.4 s and 1.3 s
    p = predict(PROFILE, {_call(RS, INTER, 4, 2**21): 1}, 0.0, None, 2, 0, 0, FRONTIER_RCCL)
    assert p.comm_s == pytest.approx((0.4 * 1.3) ** 0.5)


def test_above_a_groups_only_measured_size_the_fitted_line_adds_its_growth():
    # the flat group's broadcast was timed at 4 KB only (0.07 s): a 1 MB one costs that plus what
    # the fitted line adds from 4 KB to 1 MB, not 0.07 s x 256
    costs = PROFILE.costs(FRONTIER_RCCL)
    bcast = Operation.BROADCAST
    growth = collectives.seconds(costs, bcast, RING, 8, 2**20, INTER) - collectives.seconds(
        costs, bcast, RING, 8, 4096, INTER
    )
    assert call_seconds(PROFILE, costs, _call(bcast, INTER, 8, 2**20)) == pytest.approx(0.07 + growth)
    assert call_seconds(PROFILE, costs, _call(bcast, INTER, 8, 1024)) == pytest.approx(0.07)


def test_a_group_the_probe_did_not_time_is_charged_the_fallback_line():
    # a 2-member package ring of 1 MB: 1 step x 1 ms + 0.5 MB at 0.5 GB/s = 2 ms
    p = predict(PROFILE, {_call(AG, PACKAGE, 2, 10**6): 1}, 0.0, None, 2, 0, 0, NO_PACKAGE_FIT)
    assert p.comm_s == pytest.approx(1e-3 + 0.5e6 / 0.5e9)


def test_prefetching_hides_every_gather_but_the_first_of_each_pass_up_to_the_compute():
    # 6 gathers of 0.25 s (latency 0.25 s: 1 MB is the smallest size measured) in 2 passes:
    # 4 prefetched, 1.0 s, one at a time (ours), behind 0.6 s of compute: 0.6 s hidden
    calls = {_call(AG, INTER, 4, 2**20): 6, _call(RS, INTER, 4, 2**20): 1}
    p = predict(PROFILE, calls, 0.6, None, 2, 1, 0, FRONTIER_RCCL)
    assert p.comm_s == pytest.approx(6 * 0.25 + 0.4)
    assert p.hidden_s == pytest.approx(0.6)
    assert p.step_s == pytest.approx(0.6 + 1.9 - 0.6)
    # with 2 s of compute all 4 prefetched gathers hide; without prefetching none does
    assert prefetch_hidden(2.0, 1.5, 0.0, 6, 2, concurrency=1) == pytest.approx(1.0)
    assert prefetch_hidden(2.0, 1.5, 0.0, 6, 2, concurrency=0) == 0.0
    assert prefetch_hidden(2.0, 1.5, 0.0, 2, 2, concurrency=1) == 0.0  # one gather per pass: none ahead


def test_gathers_in_flight_together_share_their_latency_not_their_bytes():
    # 6 gathers, 1.5 s in all, 0.6 s of it latency; 4 of 6 prefetched: 1.0 s, 0.4 s latency.
    # Two at once (gloo's two worker threads) pay half of that latency: 0.2 s hidden, no compute.
    assert prefetch_hidden(0.0, 1.5, 0.6, 6, 2, concurrency=2) == pytest.approx(0.2)
    # then 0.8 s of them remain, of which 0.5 s of compute hides 0.5 s
    assert prefetch_hidden(0.5, 1.5, 0.6, 6, 2, concurrency=2) == pytest.approx(0.7)
    # the latency is the profile's time at its smallest size: 0.25 s per 1 MB hop gather here
    calls = {_call(AG, INTER, 4, 2**22): 6}
    p = predict(PROFILE, calls, 0.0, None, 2, 2, 0, FRONTIER_RCCL)
    assert p.comm_s == pytest.approx(6 * 0.9)
    assert p.hidden_s == pytest.approx(4 * 0.25 / 2)


def test_the_projections_overlap_hides_a_fraction_of_the_communication_up_to_the_compute():
    assert overlapped(1.0, 3.0, overlap=0.0) == pytest.approx(4.0)
    assert overlapped(2.0, 3.0, overlap=0.5) == pytest.approx(3.5)
    assert overlapped(1.0, 3.0, overlap=1.0) == pytest.approx(3.0)  # at most the compute hides it


def test_the_hop_fit_ignores_the_flat_group_and_the_scalars():
    # the flat 8-member group's timings are the baseline's: the hop costs come from the 4-member hop
    hops = {(t.members, t.operation) for t in PROFILE.hop_timings()}
    assert hops == {(4, AG), (4, RS)}


def test_launches_the_profile_did_not_measure_are_counted():
    calls = {
        _call(AG, INTER, 4, 2**22): 2,  # measured up to 4 MB: interpolated
        _call(AG, INTER, 4, 2**23): 1,  # above the largest measured: extrapolated
        _call(AG, PACKAGE, 2, 10**6): 3,  # a group the probe did not time: the fitted line
    }
    p = predict(PROFILE, calls, 0.0, None, 2, 0, 0, NO_PACKAGE_FIT)
    assert p.unmeasured == 4
    assert (
        predict(PROFILE, {_call(AG, INTER, 4, 2**20): 5}, 0.0, None, 2, 0, 0, FRONTIER_RCCL).unmeasured == 0
    )


def test_the_engines_host_cost_is_the_probes_line_per_step_and_per_fetch():
    # the probe's two stacks: 10 fetches cost 20 ms over plain torch (median 24 - 4), 66 fetches 76 ms
    # (median 90 - 14): 1 ms per fetch, 10 ms per step whatever is fetched
    host = (
        HostTiming(4, 10.0, (0.030, 0.024, 0.020), (0.004, 0.005, 0.003)),
        HostTiming(32, 66.0, (0.090, 0.095, 0.080), (0.014, 0.012, 0.016)),
    )
    profile = Profile(VERSIONS, TOPOLOGY, PROFILE.timings, host)
    calls = {_call(AG, INTER, 4, 2**20): 3}  # 3 x 0.25 s, not prefetched (concurrency 0)
    p = predict(profile, calls, 0.5, 36.0, 2, 0, 0, FRONTIER_RCCL)
    assert p.host_s == pytest.approx(0.010 + 36 * 0.001)
    assert p.step_s == pytest.approx(0.5 + 0.046 + 0.75)
    # fetches not counted, or a profile without host timings (format version 1): no host cost
    assert predict(profile, calls, 0.5, None, 2, 0, 0, FRONTIER_RCCL).host_s == 0.0
    assert predict(PROFILE, calls, 0.5, 36.0, 2, 0, 0, FRONTIER_RCCL).host_s == 0.0


def test_a_noisy_pair_never_gives_a_negative_host_cost():
    # the larger stack measured cheaper than the smaller: no cost per fetch, the smaller's 20 ms per step
    host = (
        HostTiming(4, 10.0, (0.024,), (0.004,)),
        HostTiming(32, 66.0, (0.018,), (0.004,)),
    )
    p = predict(Profile(VERSIONS, TOPOLOGY, PROFILE.timings, host), {}, 0.0, 50.0, 2, 0, 0, FRONTIER_RCCL)
    assert p.host_s == pytest.approx(0.020)


def test_gathers_of_persistent_parameters_are_not_prefetched():
    # 6 gathers of 1 MB (0.25 s each) and compute of 2 s: with prefetching 4 of them hide (1.0 s);
    # taken for persistent parameters (DeepSpeed gathers those after the optimizer step) none does
    calls = {_call(AG, INTER, 4, 2**20): 6}
    assert predict(PROFILE, calls, 2.0, None, 2, 1, 2**20 - 1, FRONTIER_RCCL).hidden_s == pytest.approx(1.0)
    assert predict(PROFILE, calls, 2.0, None, 2, 1, 2**20, FRONTIER_RCCL).hidden_s == 0.0
