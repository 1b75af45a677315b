"""A probe profile: collective timings measured on this cluster, and what ``auto`` reads from them.

``python -m deepspeed_ext.zero.probe`` writes one; ``hierarchical_zero.profile`` points a job at
it. It is valid only for the topology and library versions it was measured with: :func:`load`
refuses anything else with the reason, and the job then runs the library's collectives. What it
holds: docs/hierarchical_zero_modules.md."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from deepspeed_ext.zero.cost import host
from deepspeed_ext.zero.cost.collectives import (
    Algorithm,
    AlgorithmFit,
    CollectiveCosts,
    Operation,
    algorithm_steps,
    bus_bytes,
)
from deepspeed_ext.zero.cost.host import HostTiming
from mdsp_base.topology import LinkClass, Topology

FORMAT = "hierarchical_zero.profile"
VERSION = 2
READS = (1, VERSION)


class ProfileError(ValueError):
    """A profile that cannot be used here: corrupt, of another format version, another topology or
    other library versions."""


@dataclass(frozen=True)
class Timing:
    """One collective measured at one message size."""

    link: LinkClass
    """Link class the group spans."""
    operation: Operation
    """all_gather or reduce_scatter."""
    algorithm: Algorithm
    """ring: the library's collective; recursive: the point-to-point algorithm."""
    members: int
    """Ranks in the group."""
    concurrent: int
    """Groups of this kind per node running at once (they share the node's links)."""
    nbytes: int
    """Gathered output (all-gather) or input (reduce-scatter) in bytes."""
    seconds: tuple[float, ...]
    """Every repeat: the slowest rank's time from a barrier to its result."""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def library_versions() -> dict[str, str]:
    """The versions a profile is tied to: torch, DeepSpeed, and the collective library of the
    accelerator (NCCL, or RCCL on ROCm), else gloo (part of torch)."""
    import deepspeed
    import torch

    if torch.cuda.is_available():
        library = "RCCL" if torch.version.hip else "NCCL"
        version = ".".join(map(str, torch.cuda.nccl.version()))
        collective = f"{library} {version}"
    else:
        collective = f"gloo (torch {torch.__version__})"
    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "collectives": collective}


def topology_key(topology: Topology) -> dict[str, int]:
    return {
        "world_size": topology.world_size,
        "ranks_per_node": topology.ranks_per_node,
        "ranks_per_package": topology.ranks_per_package,
    }


@dataclass(frozen=True)
class Profile:
    """What the probe measured on one topology with one set of library versions."""

    versions: Mapping[str, str]
    """torch, DeepSpeed and collective-library versions (:func:`library_versions`)."""
    topology: Mapping[str, int]
    """world_size, ranks_per_node, ranks_per_package (:func:`topology_key`)."""
    timings: tuple[Timing, ...]
    """The raw timings."""
    host: tuple[HostTiming, ...] = ()
    """The engine's host cost, raw (:func:`.host.fit` fits it; none in a version 1 profile)."""

    def series(
        self, link: LinkClass, operation: Operation, algorithm: Algorithm, members: int
    ) -> list[Timing]:
        """The timings of one collective over ``members`` ranks, by message size."""
        return sorted(
            (
                t
                for t in self.timings
                if (t.link, t.operation, t.algorithm, t.members) == (link, operation, algorithm, members)
            ),
            key=lambda t: t.nbytes,
        )

    def seconds(
        self,
        link: LinkClass,
        operation: Operation,
        algorithm: Algorithm,
        members: int,
        nbytes: float,
        statistic: Callable[[Sequence[float]], float] = statistics.median,
    ) -> float | None:
        """Measured time at ``nbytes`` (``statistic`` of each size's repeats: median, min or max):
        interpolated in log-log between measured sizes; below the smallest its time
        (latency-bound), above the largest the line through the two largest (bandwidth-bound).
        None when this collective was not measured."""
        points = [(t.nbytes, statistic(t.seconds)) for t in self.series(link, operation, algorithm, members)]
        if not points:
            return None
        if len(points) == 1:  # one size: flat below it, proportional above
            return points[0][1] * max(1.0, nbytes / points[0][0])
        if nbytes <= points[0][0]:
            return points[0][1]
        for (n0, t0), (n1, t1) in zip(points, points[1:]):
            if nbytes <= n1:
                w = math.log(nbytes / n0) / math.log(n1 / n0)
                return math.exp((1 - w) * math.log(t0) + w * math.log(t1))
        (n0, t0), (n1, t1) = points[-2], points[-1]
        return t1 + max((t1 - t0) / (n1 - n0), 0.0) * (nbytes - n1)

    def fastest(self, link: LinkClass, operation: Operation, members: int, nbytes: float) -> Algorithm:
        """Recursive where it won at this size: its median repeat faster than ring's fastest (a win
        inside ring's noise keeps the library's collective, and one slow repeat of recursive's does
        not hide a win); ring otherwise, and where recursive was not measured."""
        ring = self.seconds(link, operation, Algorithm.RING, members, nbytes, min)
        recursive = self.seconds(link, operation, Algorithm.RECURSIVE, members, nbytes)
        if ring is None or recursive is None or recursive >= ring:
            return Algorithm.RING
        return Algorithm.RECURSIVE

    def fit(
        self, link: LinkClass, operation: Operation, algorithm: Algorithm, members: int
    ) -> AlgorithmFit | None:
        """Step latency and bus bandwidth of one collective: the least-squares line
        ``seconds = steps x step + bus bytes / bandwidth`` through its medians (None: fewer than two
        sizes measured, or no positive slope)."""
        points = self.series(link, operation, algorithm, members)
        if len(points) < 2:
            return None
        xs = [bus_bytes(operation, members, t.nbytes) for t in points]
        ys = [t.median for t in points]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
        if slope <= 0:
            return None
        intercept = max(0.0, my - slope * mx)
        steps = max(1, algorithm_steps(algorithm, members))
        return AlgorithmFit(step_us=intercept / steps * 1e6, bus_gbps=1 / slope / 1e9)

    def hop_timings(self) -> list[Timing]:
        """The timings of the hops' groups (package, across packages, across nodes): not those of
        the whole job's group (the baseline's flat collectives, DeepSpeed's scalars)."""
        world = self.topology.get("world_size", 0)
        per_node = self.topology.get("ranks_per_node", world) or 1
        package = self.topology.get("ranks_per_package", 1) or 1
        hop_sizes = {package, per_node // package, world // per_node}
        return [
            t
            for t in self.timings
            if t.operation in (Operation.ALL_GATHER, Operation.REDUCE_SCATTER)
            and (t.members != world or world in hop_sizes)
        ]

    def costs(self, fallback: CollectiveCosts) -> CollectiveCosts:
        """``fallback`` with every (link, algorithm) this profile measured replaced by its fit, per
        operation. Across nodes the fit is what one communicator got while ``concurrent`` shared
        the node's NICs, so the NICs together carry that many times it."""
        fits = dict(fallback.fits)
        by_operation = dict(fallback.by_operation)
        nic = None
        for link, operation, algorithm, members, concurrent in {
            (t.link, t.operation, t.algorithm, t.members, t.concurrent) for t in self.hop_timings()
        }:  # each measured collective once, not once per size
            fit = self.fit(link, operation, algorithm, members)
            if fit is None:
                continue
            by_operation[(operation, link, algorithm)] = fit
            fits.setdefault((link, algorithm), fit)  # for operations the profile did not measure
            if link == LinkClass.INTER_NODE:
                nic = max(nic or 0.0, fit.bus_gbps * concurrent)
        return replace(
            fallback,
            system=f"measured by the probe ({self.versions.get('collectives', '?')})",
            fits=fits,
            by_operation=by_operation,
            nic_gbps=nic if nic is not None else fallback.nic_gbps,
        )

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "versions": dict(self.versions),
            "topology": dict(self.topology),
            "timings": [{**asdict(t), "seconds": list(t.seconds)} for t in self.timings],
            "host": [t.to_json() for t in self.host],
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile (through a temporary file, so a reader never sees half of it)."""
        target = Path(path)
        partial = target.with_name(target.name + ".partial")
        partial.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        partial.replace(target)


def parse(data: object, source: str) -> Profile:
    """A profile from its JSON, every field checked; :class:`ProfileError` names what is wrong."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f'{source} is not a hierarchical ZeRO profile (no "format": "{FORMAT}")')
    if data.get("version") not in READS:
        raise ProfileError(
            f"{source} has profile format version {data.get('version')}, this plugin reads "
            f"{' and '.join(map(str, READS))}: run python -m deepspeed_ext.zero.probe again"
        )
    try:
        timings = tuple(
            Timing(
                link=LinkClass(t["link"]),
                operation=Operation(t["operation"]),
                algorithm=Algorithm(t["algorithm"]),
                members=int(t["members"]),
                concurrent=int(t["concurrent"]),
                nbytes=int(t["nbytes"]),
                seconds=tuple(float(s) for s in t["seconds"]),
            )
            for t in data["timings"]
        )
        versions = {str(k): str(v) for k, v in data["versions"].items()}
        topology = {str(k): int(v) for k, v in data["topology"].items()}
        host_timings = host.parse(data["host"], source) if data["version"] == VERSION else ()
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProfileError(f"{source} is corrupt ({type(exc).__name__}: {exc}): run the probe again") from exc
    bad = [
        t
        for t in timings
        if not t.seconds
        or not all(math.isfinite(s) and s > 0 for s in t.seconds)
        or t.nbytes <= 0
        or t.members < 2
    ]
    if bad:
        raise ProfileError(
            f"{source} is corrupt: a timing without positive, finite sizes and times ({bad[0]})"
        )
    return Profile(versions=versions, topology=topology, timings=timings, host=host_timings)


def read(path: str | os.PathLike) -> Profile:
    """The profile at ``path``, every field checked: :class:`ProfileError` for a file that cannot
    be read, is not UTF-8 JSON, or is not a profile."""
    source = os.fspath(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ProfileError(f"cannot read the profile {source}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ProfileError(
            f"{source} is not a profile (not UTF-8 text: {exc.reason}): run the probe again"
        ) from exc
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{source} is not valid JSON ({exc}): run the probe again") from exc
    return parse(data, source)


def load(path: str | os.PathLike, topology: Topology, versions: Mapping[str, str] | None = None) -> Profile:
    """The profile at ``path``, checked against this job.

    Args:
        path: the profile's JSON.
        topology: this job's placement, which the profile must have been measured on.
        versions: the library versions to match; None: those installed.

    Returns:
        The profile.

    Raises:
        ProfileError: unreadable, corrupt, or measured on another topology or other versions.
    """
    profile = read(path)
    _check_matches(profile, topology, versions or library_versions(), os.fspath(path))
    return profile


def _differences(measured: Mapping, here: Mapping) -> list[str]:
    return [f"{k} {measured.get(k)} (here {v})" for k, v in here.items() if measured.get(k) != v]


def _check_matches(profile: Profile, topology: Topology, versions: Mapping[str, str], source: str) -> None:
    topo = _differences(profile.topology, topology_key(topology))
    if topo:
        raise ProfileError(
            f"{source} was measured on another topology: {', '.join(topo)}; run the probe with this "
            "job's nodes and ranks per node"
        )
    libs = _differences(profile.versions, versions)
    if libs:
        raise ProfileError(
            f"{source} was measured with other library versions: {', '.join(libs)}; run the probe again "
            "in this environment"
        )
