"""One rank of the data-loader benchmark: time ``steps`` micro-batches of one loading scheme.

Schemes: ``every_rank`` (each rank reads its DP rank's samples itself, no broadcast),
``tp_broadcast`` (Megatron: TP rank 0 reads, then broadcasts each key) and ``shm`` (the node
loader). A sleep of ``--step-ms`` stands in for the training step, so prefetching can hide reads.
Prints one JSON line: batch latencies, /proc I/O and CPU/RSS figures of this rank, including the
children it reaped (DataLoader workers, the producer): Linux folds a reaped child's I/O counters
and rusage into its parent's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch
import torch.distributed as dist

from deepspeed_ext.config import ShmDataLoaderConfig
from deepspeed_ext.topology import Topology
from megatron_ext.data.gpt_dataset import build_train_dataset
from megatron_ext.data.loader import build_batch_iterator

SCHEMES = ("every_rank", "tp_broadcast", "shm")


def proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


def cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scheme", choices=SCHEMES, required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--rendezvous", required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--slots", type=int, default=4)
    args = parser.parse_args()

    from megatron.core import parallel_state as ps

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.rendezvous}", rank=rank, world_size=world)
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, create_gloo_process_groups=False)
    dataset = build_train_dataset(args.prefix, args.seq_length, args.steps * 64, 1234, args.cache,
                                  is_built_on_rank=True)
    dist.barrier()
    io0, cpu0 = proc_io(), cpu_s(resource.RUSAGE_SELF) + cpu_s(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    iterator = build_batch_iterator(
        dataset, micro_batch_size=args.mbs, consumed_samples=0,
        config=ShmDataLoaderConfig(enabled=args.scheme == "shm", slots=args.slots, timeout_s=300),
        topology=Topology(world_size=world, ranks_per_node=world, ranks_per_package=1),
        tp_group=None if args.scheme == "every_rank" else ps.get_tensor_model_parallel_group(),
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(), sampler="random",
        num_workers=args.num_workers,
    )
    setup_s = time.perf_counter() - start
    latencies = []
    for _ in range(args.steps):
        t = time.perf_counter()
        next(iterator)
        latencies.append(time.perf_counter() - t)
        time.sleep(args.step_ms / 1e3)
    counters = iterator.counters.as_dict()
    iterator.close()  # reaps the producer / DataLoader workers: their counters join ours
    dist.barrier()
    io1 = proc_io()
    print(json.dumps({
        "rank": rank, "scheme": args.scheme, "setup_s": setup_s, "latencies_s": latencies, "counters": counters,
        "read_bytes": io1["read_bytes"] - io0["read_bytes"], "rchar": io1["rchar"] - io0["rchar"],
        "cpu_s": cpu_s(resource.RUSAGE_SELF) + cpu_s(resource.RUSAGE_CHILDREN) - cpu0,
        "max_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "children_max_rss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
    }), flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
