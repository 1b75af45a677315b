"""The probe's measurements (``python -m deepspeed_ext.zero.probe``): every level's collectives timed on
every rank. Apart from the command line, so that ``--help`` loads no torch."""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepspeed_ext.zero.config import HierarchicalZeroConfig
from deepspeed_ext.zero.cost import host
from deepspeed_ext.zero.cost.collectives import Algorithm, Operation
from deepspeed_ext.zero.cost.profile import Profile, Timing, library_versions, topology_key
from deepspeed_ext.zero.engine import p2p_hops
from deepspeed_ext.zero.engine.levels import build_levels
from deepspeed_ext.zero.tools.probe_host import host_timings
from mdsp_base import comm
from mdsp_base.topology import Level, LinkClass, Topology, TopologyConfig, detect_topology
from mdsp_base.volume import span_class


@dataclass(frozen=True)
class Collective:
    """One collective the probe times: on which hop group, what, how."""

    link: LinkClass
    """Link class of the hop group."""
    group: dist.ProcessGroup
    """This rank's group of that hop."""
    members: int
    """Ranks in the group."""
    concurrent: int
    """Groups of this hop per node, all running at once."""
    operation: Operation
    """all_gather or reduce_scatter."""
    algorithm: Algorithm
    """ring (the library's collective) or recursive (point-to-point steps)."""
    smallest_only: bool = False
    """Timed at the smallest size only: a latency-bound call (DeepSpeed's scalars)."""


def collectives(topology: Topology) -> Iterator[Collective]:
    """The collectives of every hop of the job's level groups, innermost link first; then those
    of the whole job's group, which stock ZeRO-3 and hpZ run (flat all-gather and reduce-scatter at
    every size, the scalar all-reduce and broadcasts DeepSpeed's step makes at the smallest)."""
    plan = build_levels(topology, None, Level.GLOBAL, HierarchicalZeroConfig(enabled=True)).dp_plan()
    for i, (members, group, link) in enumerate(zip(plan.sizes, plan.groups, plan.links)):
        if members < 2:
            continue
        algorithms = [Algorithm.RING] + ([Algorithm.RECURSIVE] if link == LinkClass.INTER_NODE else [])
        for operation in (Operation.ALL_GATHER, Operation.REDUCE_SCATTER):
            for algorithm in algorithms:
                yield Collective(link, group, members, math.prod(plan.sizes[:i]), operation, algorithm)
    world = topology.world_size
    if world < 2:
        return
    link = span_class(topology, range(world))
    assert dist.group.WORLD is not None  # the probe runs in an initialized process group
    flat = [] if world in plan.sizes else [Operation.ALL_GATHER, Operation.REDUCE_SCATTER]
    for operation in flat:
        yield Collective(link, dist.group.WORLD, world, 1, operation, Algorithm.RING)
    for operation in (Operation.ALL_REDUCE, Operation.BROADCAST):
        yield Collective(link, dist.group.WORLD, world, 1, operation, Algorithm.RING, smallest_only=True)


def call(c: Collective, numel: int, dtype: torch.dtype, device: torch.device) -> Callable[[], object]:
    """One call of ``c`` on a message of ``numel`` elements (gathered output / reduce-scatter input)."""
    full = torch.zeros(numel, dtype=dtype, device=device)
    if c.operation == Operation.ALL_REDUCE:
        return lambda: comm.all_reduce(full, group=c.group)
    if c.operation == Operation.BROADCAST:
        return lambda: dist.broadcast(full, group_src=0, group=c.group)
    mine = full.view(c.members, -1)[dist.get_rank(c.group)]
    if c.operation == Operation.ALL_GATHER:
        block = mine.clone()
        if c.algorithm == Algorithm.RECURSIVE:
            return lambda: p2p_hops.all_gather(full, block, c.group)
        return lambda: comm.all_gather_into_tensor(full, block, group=c.group)
    if c.algorithm == Algorithm.RECURSIVE:
        return lambda: p2p_hops.reduce_scatter(full, c.group)
    out = torch.empty_like(mine)
    return lambda: comm.reduce_scatter_tensor(out, full, group=c.group)


def sizes_sweep(smallest: int, largest: int, factor: int = 4) -> list[int]:
    """Message sizes from ``smallest`` to ``largest`` bytes, each ``factor`` times the previous."""
    out, n = [], smallest
    while n <= largest:
        out.append(n)
        n *= factor
    return out


def timed(
    run: Callable[[], object], repeats: int, device: torch.device, started: float
) -> tuple[list[float], float]:
    """Each repeat's slowest-rank seconds (after one warm-up call), and the slowest rank's elapsed
    time since ``started``: one all-reduce, so every rank takes the same decisions from them."""
    seconds = []
    for repeat in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if repeat:
            seconds.append(time.perf_counter() - start)
    slowest = torch.tensor([*seconds, time.monotonic() - started], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    values = slowest.tolist()
    return values[:-1], values[-1]


def measure(
    topology: Topology, args: argparse.Namespace, device: torch.device
) -> tuple[list[Timing], list[str]]:
    """Time every collective at every size within the limits; returns the timings and what was cut."""
    dtype = getattr(torch, args.dtype)
    element = torch.tensor([], dtype=dtype).element_size()
    active = list(collectives(topology))
    timings: list[Timing] = []
    cut: list[str] = []
    started = time.monotonic()
    for size in args.sizes or sizes_sweep(args.smallest, args.largest):
        if dist.get_rank() == 0:
            print(
                f"probe: {size} bytes, {len(active)} collectives still growing, {time.monotonic() - started:.0f} s "
                f"of the {args.budget_s:.0f} s budget",
                flush=True,
            )
        for c in list(active):
            unit = c.members * element
            nbytes = max(1, size // unit) * unit
            run = call(c, nbytes // element, dtype, device)
            seconds, elapsed = timed(run, args.repeats, device, started)
            timings.append(
                Timing(c.link, c.operation, c.algorithm, c.members, c.concurrent, nbytes, tuple(seconds))
            )
            if c.smallest_only or max(seconds) > args.max_call_s:
                active.remove(c)  # larger sizes would take longer still
            if elapsed > args.budget_s:
                cut.append(f"sizes above {nbytes} bytes: the {args.budget_s:.0f} s budget was spent")
                return timings, cut
    return timings, cut


def summary(profile: Profile) -> str:
    """A table per collective: its sizes' medians and the fitted step latency and bandwidth."""
    keys = sorted({(t.link, t.operation, t.algorithm, t.members) for t in profile.timings}, key=str)
    lines = [
        "link        operation       algorithm  ranks  sizes  median at smallest..largest   step us   bus GB/s"
    ]
    for link, operation, algorithm, members in keys:
        series = profile.series(link, operation, algorithm, members)
        fit = profile.fit(link, operation, algorithm, members)
        span = f"{series[0].median * 1e3:.3f} ms ({series[0].nbytes} B)..{series[-1].median * 1e3:.1f} ms ({series[-1].nbytes} B)"
        fitted = f"{fit.step_us:9.1f} {fit.bus_gbps:10.4f}" if fit else "        -          -"
        lines.append(
            f"{link:11} {operation:15} {algorithm:10} {members:5}  {len(series):5}  {span:28} {fitted}"
        )
    cost = host.fit(profile.host)
    if cost is not None:
        lines.append(
            f"engine host cost (ZeRO-3 on one rank less plain torch): {cost.per_step_s * 1e3:.2f} ms per step "
            f"+ {cost.per_fetch_s * 1e3:.3f} ms per parameter fetch"
        )
    return "\n".join(lines)


def topology_config(args: argparse.Namespace) -> TopologyConfig:
    """The job's topology section, with the flags on top."""
    section: dict[str, Any] = {}
    if args.deepspeed_config:
        with open(args.deepspeed_config) as f:
            section = json.load(f).get("topology") or {}
    for key in ("ranks_per_node", "ranks_per_package"):
        if getattr(args, key) is not None:
            section[key] = getattr(args, key)
    return TopologyConfig.parse(section, "topology")


def run(args: argparse.Namespace) -> None:
    """Measure with the parsed flags; rank 0 writes the profile and prints what comes next."""
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if gpu else torch.device("cpu")
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo", device_id=device if gpu else None)
    try:
        topology = detect_topology(topology_config(args), world_size=dist.get_world_size())
        timings, cut = measure(topology, args, device)
        started = time.monotonic()
        engine = host_timings(
            args.repeats,
            getattr(torch, args.dtype),
            device,
            lambda run: timed(run, args.repeats, device, started)[0],
        )
        if dist.get_rank() == 0:
            profile = Profile(library_versions(), topology_key(topology), tuple(timings), tuple(engine))
            profile.save(args.out)
            print(summary(profile))
            for line in cut:
                print(f"not measured: {line}")
            print(f"profile written to {args.out} ({len(profile.timings)} timings, {topology_key(topology)})")
            print(
                f"next: give it to the job (--hierarchical-zero-profile {args.out}, or hierarchical_zero.profile "
                f"in the DeepSpeed JSON) and to the planner (python -m deepspeed_ext.zero.plan --profile {args.out} "
                f"--nodes <nodes> --model <preset>)"
            )
    finally:
        dist.destroy_process_group()
