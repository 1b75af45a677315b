"""The engine's own per-step host cost (DeepSpeed's module hooks, fetch bookkeeping, Python),
measured by the probe and charged ``per_step + per_fetch x fetches``.

On a small model or a slow host it is most of a ZeRO-3 step, and no collective accounts for it.
How the probe measures it: docs/hierarchical_zero_modules.md."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HostTiming:
    """One model the probe stepped both ways: a ZeRO-3 engine on a one-rank group, and plain torch."""

    modules: int
    """Linear layers in the stack."""
    fetches: float
    """DeepSpeed's parameter fetches per step (module hooks that ran ``fetch_sub_module``)."""
    engine_seconds: tuple[float, ...]
    """Every repeat of the engine's step: the slowest rank's time from a barrier."""
    plain_seconds: tuple[float, ...]
    """Every repeat of the same step in plain torch (no ZeRO): the slowest rank's time."""

    @property
    def host_s(self) -> float:
        """The engine's median step less plain torch's: its host cost per step (not below 0)."""
        return max(0.0, statistics.median(self.engine_seconds) - statistics.median(self.plain_seconds))

    def to_json(self) -> dict:
        return {
            "modules": self.modules,
            "fetches": self.fetches,
            "engine_seconds": list(self.engine_seconds),
            "plain_seconds": list(self.plain_seconds),
        }


@dataclass(frozen=True)
class HostCost:
    """The engine's host cost of a step: ``per_step_s + per_fetch_s x fetches``."""

    per_step_s: float
    """What a step costs whatever it fetches (the optimizer step's bookkeeping)."""
    per_fetch_s: float
    """What each parameter fetch adds (a module's hooks, its gather's bookkeeping)."""

    def seconds(self, fetches: float) -> float:
        """Host seconds of a step with ``fetches`` parameter fetches."""
        return self.per_step_s + self.per_fetch_s * fetches


def fit(timings: Sequence[HostTiming]) -> HostCost | None:
    """The line through the host cost of the fewest- and the most-fetching model (each clipped at 0:
    a noisy pair never gives a negative cost); one model: all of it per fetch. None: nothing timed."""
    if not timings:
        return None
    low, high = min(timings, key=lambda t: t.fetches), max(timings, key=lambda t: t.fetches)
    if high.fetches == low.fetches:
        return HostCost(0.0, high.host_s / high.fetches if high.fetches else 0.0)
    per_fetch = max(0.0, (high.host_s - low.host_s) / (high.fetches - low.fetches))
    return HostCost(max(0.0, low.host_s - per_fetch * low.fetches), per_fetch)


def parse(items: object, source: str) -> tuple[HostTiming, ...]:
    """Host timings from a profile's JSON; ``ValueError`` naming the first bad one."""
    if not isinstance(items, list):
        raise ValueError(f"{source}: host timings are not a list")
    out = []
    for item in items:
        timing = HostTiming(
            modules=int(item["modules"]),
            fetches=float(item["fetches"]),
            engine_seconds=tuple(float(s) for s in item["engine_seconds"]),
            plain_seconds=tuple(float(s) for s in item["plain_seconds"]),
        )
        seconds = timing.engine_seconds + timing.plain_seconds
        if (
            not timing.engine_seconds
            or not timing.plain_seconds
            or not all(math.isfinite(s) and s > 0 for s in seconds)
            or not (math.isfinite(timing.fetches) and timing.fetches > 0)
        ):
            raise ValueError(f"{source}: a host timing without positive, finite fetches and times ({item})")
        out.append(timing)
    return tuple(out)
