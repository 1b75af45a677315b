"""Step time from its parts: ``step = compute + host + communication - hidden``.

The A/B command predicts each variant's step from a measured single-rank step, the probe's host
cost and profile, and the collectives the engine launches; the projection (:func:`overlapped`)
uses the same sum with an assumed overlap fraction. All figures are computed, none fitted to the
step times they are compared with. What each part counts and what prefetching hides:
docs/hierarchical_zero_modules.md."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from deepspeed_ext.zero.cost import collectives, host
from deepspeed_ext.zero.cost.collectives import Algorithm, CollectiveCosts, Operation
from deepspeed_ext.zero.cost.profile import Profile
from mdsp_base.topology import LinkClass
from mdsp_base.volume import CallKey


@dataclass(frozen=True)
class StepPrediction:
    """A predicted step and its parts (seconds)."""

    compute_s: float
    """The measured single-rank step."""
    host_s: float
    """The engine's own host cost of the step (hooks, fetch bookkeeping, Python)."""
    comm_s: float
    """Every collective of the step, one after another."""
    hidden_s: float
    """Communication that runs behind compute."""
    unmeasured: float = 0.0
    """Launches per step the profile did not measure: a group it did not time, or a size above its
    largest for that group (extrapolated); the prediction is weaker the more of these."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.host_s + self.comm_s - self.hidden_s


def overlapped(compute_s: float, comm_s: float, overlap: float) -> float:
    """Step time when a fraction ``overlap`` (0..1) of the communication hides behind compute."""
    return compute_s + comm_s - min(overlap * comm_s, compute_s)


def call_seconds(profile: Profile, costs: CollectiveCosts, call: CallKey) -> float:
    """One launch of ``call``: the profile's median for its group and size, else the fitted cost.
    Above a group's only measured size, that median plus the fitted cost's growth from there: one
    size cannot tell latency from bandwidth (a latency-bound point scaled in proportion to the
    bytes would charge a 1 MB reduce-scatter a hundred times its time)."""
    operation, algorithm, link = Operation(call.collective), Algorithm(call.algorithm), LinkClass(call.link)
    series = profile.series(link, operation, algorithm, call.members)
    if len(series) == 1 and call.nbytes > series[0].nbytes:
        fitted = [
            collectives.seconds(costs, operation, algorithm, call.members, n, link)
            for n in (series[0].nbytes, call.nbytes)
        ]
        return statistics.median(series[0].seconds) + fitted[1] - fitted[0]
    measured = profile.seconds(link, operation, algorithm, call.members, call.nbytes)
    if measured is not None:
        return measured
    return collectives.seconds(costs, operation, algorithm, call.members, call.nbytes, link)


def measured(profile: Profile, call: CallKey) -> bool:
    """Whether the profile timed ``call``'s group at this size or a larger one."""
    series = profile.series(
        LinkClass(call.link), Operation(call.collective), Algorithm(call.algorithm), call.members
    )
    return bool(series) and call.nbytes <= series[-1].nbytes


def call_latency(profile: Profile, costs: CollectiveCosts, call: CallKey) -> float:
    """The latency part of one launch: the same collective at the profile's smallest size (else the
    fitted steps alone)."""
    return call_seconds(profile, costs, call._replace(nbytes=1))


def prefetch_hidden(
    compute_s: float,
    gather_s: float,
    gather_latency_s: float,
    gathers: float,
    passes: int,
    concurrency: int,
) -> float:
    """All-gather time hidden when DeepSpeed prefetches all but the first gather of each of
    ``passes`` passes (their mean time and latency each): ``concurrency`` in flight at once share
    their latency, and the rest hides behind compute, at most all of it. ``concurrency`` 0: no
    prefetching, nothing hidden."""
    if concurrency < 1 or gathers <= 0:
        return 0.0
    ahead = max(0.0, gathers - passes) / gathers
    shared = ahead * gather_latency_s * (1 - 1 / concurrency)
    return shared + min(compute_s, ahead * gather_s - shared)


def predict(
    profile: Profile,
    calls: Mapping[CallKey, float],
    compute_s: float,
    fetches: float | None,
    passes: int,
    concurrency: int,
    persistent_nbytes: float,
    fallback: CollectiveCosts,
) -> StepPrediction:
    """The step of an engine, from what can be known before timing it.

    Args:
        profile: the probe profile: each call at its median for that group and size.
        calls: launches per step of each call shape (op, algorithm, group, size).
        compute_s: a measured single-rank step's compute, in seconds.
        fetches: parameter fetches per step; None: not counted, so no host cost is charged.
        passes: forward and backward passes per step.
        concurrency: prefetched all-gathers in flight at once (0: DeepSpeed does not prefetch,
            ``stage3_prefetch_bucket_size`` 0).
        persistent_nbytes: the largest gather taken for a persistent parameter's (never prefetched).
        fallback: the costs for links the profile has no fit for.

    Returns:
        The step and its parts (compute, host, communication, hidden).
    """
    costs = profile.costs(fallback)
    comm = gather = latency = gathers = unmeasured = 0.0
    for call, count in calls.items():
        seconds = count * call_seconds(profile, costs, call)
        comm += seconds
        unmeasured += 0.0 if measured(profile, call) else count
        if call.collective == Operation.ALL_GATHER and call.nbytes > persistent_nbytes:
            gather, gathers = gather + seconds, gathers + count
            latency += count * call_latency(profile, costs, call)
    hidden = prefetch_hidden(compute_s, gather, latency, gathers, passes, concurrency)
    cost = host.fit(profile.host)
    host_s = cost.seconds(fetches) if cost is not None and fetches is not None else 0.0
    return StepPrediction(compute_s, host_s, comm, hidden, unmeasured)
