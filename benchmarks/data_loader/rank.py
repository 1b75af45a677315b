"""One rank of the data-loader benchmark: ``steps`` training steps of one loading scheme.

Schemes: ``megatron`` (Megatron's path: TP rank 0 of each (DP, CP) rank reads through a torch
DataLoader with ``--num-workers`` workers, then broadcasts each key over its TP group) and ``shm``
(the node loader). A fixed CPU computation of about ``--step-ms`` stands in for the training step
(it competes for the cores as a real step would). The ``.bin`` is read with file reads instead of a
memory map (megatron-core's ``mmap_bin_files=False``, Megatron-LM's ``--no-mmap-bin-files``) so
that every byte a scheme asks of the filesystem shows in ``rchar``. Its result (``write_result``): per-step
wall time and data wait, /proc I/O and CPU/RSS of this rank, including the children it reaped
(DataLoader workers, the producer): Linux folds a reaped child's I/O counters and rusage into its
parent's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import time

import torch
import torch.distributed as dist

from megatron_ext.data.config import ShmDataLoaderConfig
from megatron_ext.data.indexed import check_indexed_dataset
from megatron_ext.data.loader import LoaderSettings, build_batch_iterator
from multirank import write_result
from plugin_base.topology import Topology
from trainer.corpus import gpt_dataset_config

SCHEMES = ("megatron", "shm")


def proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


def cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def stand_in_step(a: torch.Tensor, repeats: int) -> None:
    """A training step's CPU work: ``repeats`` matmuls of a fixed size."""
    for _ in range(repeats):
        a @ a


def calibrate(a: torch.Tensor, step_ms: float) -> int:
    start = time.perf_counter()
    stand_in_step(a, 20)
    per = (time.perf_counter() - start) / 20
    return max(1, round(step_ms / 1e3 / per))


def build_dataset(prefix: str, seq_length: int, num_samples: int, cache: str):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    check_indexed_dataset(prefix)
    config = dataclasses.replace(gpt_dataset_config(prefix, seq_length, 1234, cache), mmap_bin_files=False)
    return BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config).build()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scheme", choices=SCHEMES, required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--rendezvous", required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--step-ms", type=float, default=40.0)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--slots", type=int, default=4)
    args = parser.parse_args()

    from megatron.core import parallel_state as ps

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.rendezvous}", rank=rank, world_size=world)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, context_parallel_size=args.cp, create_gloo_process_groups=False
    )
    dp = ps.get_data_parallel_world_size()
    # megatron-core's builder builds on rank 0 first, then (after its own barrier) on the others.
    dataset = build_dataset(args.prefix, args.seq_length, args.steps * args.mbs * dp * 2, args.cache)
    a = torch.randn(256, 256)
    repeats = calibrate(a, args.step_ms)
    dist.barrier()
    io0, cpu0 = proc_io(), cpu_s(resource.RUSAGE_SELF) + cpu_s(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    iterator = build_batch_iterator(
        dataset,
        LoaderSettings(
            micro_batch_size=args.mbs,
            consumed_samples=0,
            config=ShmDataLoaderConfig(enabled=args.scheme == "shm", slots=args.slots, timeout_s=300),
            topology=Topology(world_size=world, ranks_per_node=world, ranks_per_package=1),
            tp_group=ps.get_tensor_model_parallel_group(),
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=dp,
            sampler="random",
            num_workers=args.num_workers,
        ),
    )
    setup_s = time.perf_counter() - start
    waits, steps = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        next(iterator)
        t1 = time.perf_counter()
        stand_in_step(a, repeats)
        waits.append(t1 - t0)
        steps.append(time.perf_counter() - t0)
    counters = iterator.counters.as_dict()
    iterator.close()  # reaps the producer / DataLoader workers: their counters join ours
    dist.barrier()
    io1 = proc_io()
    write_result(
        {
            "rank": rank,
            "scheme": args.scheme,
            "setup_s": setup_s,
            "wait_s": waits,
            "step_s": steps,
            "samples_read": counters["samples_read"],
            "repeats": repeats,
            "read_bytes": io1["read_bytes"] - io0["read_bytes"],
            "rchar": io1["rchar"] - io0["rchar"],
            "cpu_s": cpu_s(resource.RUSAGE_SELF) + cpu_s(resource.RUSAGE_CHILDREN) - cpu0,
            "max_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "children_max_rss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
        }
    )
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
