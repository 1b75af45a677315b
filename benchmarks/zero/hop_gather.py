"""The hop path's own cost: the hierarchical two-hop all-gather and reduce-scatter against gloo's flat
collectives on the same 4 local ranks (2 nodes x 2), per message size.

    python -m benchmarks.zero.hop_gather [--rounds N] [--sizes-mib 1 8 32]

Each round times the flat call and the hops back to back, alternating which goes first; a sample
is the slowest rank's mean wall time over a few calls after a barrier, and the ranks' mean CPU time
over the same calls (every thread of the process: the caller's, the hop lanes', gloo's), which a
loaded host disturbs less. Printed per size and operation: the medians and the paired ratio
hops / flat with its 95 % interval (:mod:`mdsp_base.paired`), of each.
The hops run as an engine runs them: the gather through its dispatcher's route and hop worker,
the reduce-scatter through a :class:`GradientReducer` (which packs, averages and unpacks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from deepspeed_ext.zero.config import HierarchicalZeroConfig, InterNodeAlgorithm
from deepspeed_ext.zero.engine.grad_sync import GradientReducer
from deepspeed_ext.zero.engine.hop_worker import HopWorker
from deepspeed_ext.zero.engine.inject import _Route
from deepspeed_ext.zero.engine.levels import ZeroLevels, build_levels
from mdsp_base.paired import MIN_PAIRS, paired_ratio
from mdsp_base.topology import Level, Topology
from multirank import launch_ranks, write_result

TOPOLOGY = Topology(world_size=4, ranks_per_node=2, ranks_per_package=2)
CPU = torch.device("cpu")
Timings = dict[str, dict[str, list[float]]]  # "<operation> <MiB> <wall|cpu>" -> variant -> seconds per round


def _calls(mib: int) -> int:
    """Calls per timed sample: enough that a sample lasts well above the clock's and a barrier's noise."""
    return max(2, 16 // mib)


def _timed(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """Per call of ``fn``: the slowest rank's mean wall seconds, the ranks' mean CPU seconds."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    wall = torch.tensor([(time.perf_counter() - start) / calls], dtype=torch.float64)
    used = torch.tensor([(time.process_time() - cpu) / calls], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(used)
    return float(wall.item()), float(used.item()) / dist.get_world_size()


def _variants(mib: int, levels: ZeroLevels, worker: HopWorker) -> dict[str, dict[str, Callable[[], object]]]:
    """Per operation, the flat call and the hops on buffers of ``mib`` MiB (gathered output and
    reduce-scatter input), fp32, each rank's block a view into the output as DeepSpeed's are."""
    plan, group = levels.dp_plan(), levels.dp_group
    p, me = len(plan.parent), dist.get_rank()
    numel = mib * 2**20 // 4
    out = torch.zeros(numel)
    block = out.view(p, -1)[me]
    block.normal_()
    grad, mine = torch.randn(numel), torch.empty(numel // p)
    route = _Route(group, plan, worker)
    reducer = GradientReducer(plan, False, None, 256)
    return {
        "all_gather": {
            "flat": lambda: dist.all_gather_into_tensor(out, block, group=group),
            "hops": lambda: route.gather(block, out).wait(),
        },
        "reduce_scatter": {
            "flat": lambda: dist.reduce_scatter_tensor(mine, grad, group=group),
            "hops": lambda: reducer.reduce([grad], worker),
        },
    }


def measure_rank(sizes: list[int], rounds: int) -> Timings:
    """This rank's part: every size's variants, interleaved, ``rounds`` pairs each after a warm-up."""
    config = HierarchicalZeroConfig(inter_node_algorithm=InterNodeAlgorithm.RING)
    levels, worker, timings = build_levels(TOPOLOGY, None, Level.GLOBAL, config), HopWorker(), {}
    try:
        for mib in sizes:
            for operation, variants in _variants(mib, levels, worker).items():
                for fn in variants.values():  # warm-up: first-call setup, page faults
                    _timed(fn, 1)
                wall: dict[str, list[float]] = {name: [] for name in variants}
                cpu: dict[str, list[float]] = {name: [] for name in variants}
                for r in range(rounds):
                    for name in sorted(variants, reverse=bool(r % 2)):
                        seconds, used = _timed(variants[name], _calls(mib))
                        wall[name].append(seconds)
                        cpu[name].append(used)
                timings[f"{operation} {mib} wall"], timings[f"{operation} {mib} cpu"] = wall, cpu
    finally:
        worker.shutdown()
    return timings


def report(timings: Timings) -> None:
    print(f"{'operation':<16}{'MiB':>5}{'time':>6}{'flat ms':>10}{'hops ms':>10}  hops / flat [95 % CI]")
    for key, runs in timings.items():
        operation, mib, clock = key.split()
        flat, hop = (statistics.median(runs[name]) * 1e3 for name in ("flat", "hops"))
        ratio = paired_ratio(runs["hops"], runs["flat"])
        print(f"{operation:<16}{mib:>5}{clock:>6}{flat:>10.2f}{hop:>10.2f}  {ratio.verdict()}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=12, help=f"pairs per size (at least {MIN_PAIRS})")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rank-of", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        torch.set_num_threads(1)
        warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renames of the flat calls
        dist.init_process_group("gloo", init_method="env://")
        write_result(measure_rank(args.sizes_mib, args.rounds))
        return
    if args.rounds < MIN_PAIRS:
        parser.error(f"--rounds: at least {MIN_PAIRS} pairs")
    argv = ["-m", "benchmarks.zero.hop_gather", "--rank-of", "--rounds", str(args.rounds), "--sizes-mib"]
    before = os.getloadavg()[0]
    ranks = launch_ranks(
        argv + [str(s) for s in args.sizes_mib],
        world_size=TOPOLOGY.world_size,
        timeout=1800,
        ranks_per_node=TOPOLOGY.ranks_per_node,
    )
    print(
        f"4 gloo ranks (2 nodes x 2), {args.rounds} pairs per size; "
        f"1-minute load average {before:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    report(ranks[0])


if __name__ == "__main__":
    main()
