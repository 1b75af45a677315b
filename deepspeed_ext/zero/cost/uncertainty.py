"""The projection's uncertain inputs and their ranges: a computed figure is quoted with the least
and greatest value it takes over every combination of them."""

from __future__ import annotations

import itertools
from dataclasses import replace

from deepspeed_ext.zero.cost.collectives import (
    FRONTIER_RING_GBPS,
    FRONTIER_RING_GBPS_LOW,
    FRONTIER_RING_STEP_RANGE_US,
    frontier_costs,
)
from deepspeed_ext.zero.cost.workload import System

COLLECTIVE_SWEEP = {
    "ring_step_us": FRONTIER_RING_STEP_RANGE_US,
    "ring_gbps": (FRONTIER_RING_GBPS_LOW, FRONTIER_RING_GBPS),
}
"""Frontier's uncertain collective inputs, each at both ends (documented in :mod:`.collectives`)."""
SYSTEM_SWEEP = {"overlap": (0.0, 0.5, 0.9), "gemm_efficiency": (0.3, 0.6)}
"""The step's uncertain inputs: communication hidden behind compute, fraction of peak the GEMMs reach."""


def systems(base: System, sweep_collectives: bool) -> list[tuple[dict[str, float], System]]:
    """``base`` at every combination of the uncertain inputs: the step's always, Frontier's
    documented collective constants where ``sweep_collectives`` (not with a probe's measured costs,
    nor on another machine's)."""
    sweep = {**COLLECTIVE_SWEEP, **SYSTEM_SWEEP} if sweep_collectives else SYSTEM_SWEEP
    out = []
    for values in itertools.product(*sweep.values()):
        inputs = dict(zip(sweep, values))
        system = replace(base, overlap=inputs["overlap"], gemm_efficiency=inputs["gemm_efficiency"])
        if sweep_collectives:
            system = replace(system, costs=frontier_costs(inputs["ring_step_us"], inputs["ring_gbps"]))
        out.append((inputs, system))
    return out
