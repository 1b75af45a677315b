"""One rank of the node benchmark (``benchmarks.data_loader.node``); writes its figures to ``--out``.

Modes:

Method in full: benchmarks/results/methods.md, `benchmarks.data_loader.node_rank`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.data_loader.corpus import drop_cache
from benchmarks.data_loader.node_proc import (
    cpu_ns,
    descendants,
    reset_peak_rss,
    status_kib,
    tree_memory,
    window_cpu,
)
from mdsp_base.shutdown import exit_without_teardown
from mdsp_base.topology import Topology
from megatron_ext.data.config import ShmDataLoaderConfig
from megatron_ext.data.loader import LoaderSettings, build_batch_iterator

TIMEOUT_S = 60.0  # the node loader's timeout_s: a launch's ranks wait seconds at most when all is well
PREFETCH_MARGIN = 16  # steps a loader may read past the last one (producer lead, DataLoader prefetch)


def build_dataset(prefix: str, seq_length: int, num_samples: int, cache: str, mask: bool) -> Any:
    """megatron-core's GPTDataset over the corpus (memory-mapped ``.bin``, Megatron's default)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from megatron_ext.data.indexed import check_indexed_dataset
    from megatron_ext.trainer.corpus import gpt_dataset_config

    check_indexed_dataset(prefix)
    config = dataclasses.replace(
        gpt_dataset_config(prefix, seq_length, 1234, cache, create_attention_mask=mask),
        reset_attention_mask=mask,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config).build()[0]


def shm_config(workers: int, slots: int) -> ShmDataLoaderConfig:
    """The node loader's section with ``workers`` producer processes."""
    return ShmDataLoaderConfig(enabled=True, slots=slots, workers=workers, timeout_s=TIMEOUT_S)


DEFAULT_WORKERS = ShmDataLoaderConfig().workers


class Rank:
    """This process's place in the job, and the loader factory every mode uses."""

    def __init__(self, args: argparse.Namespace) -> None:
        from megatron.core import parallel_state as ps

        self.args = args
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{args.rendezvous}", rank=self.rank, world_size=self.world
        )
        ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, create_gloo_process_groups=False)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        steps = args.warmup + args.steps + args.slots + PREFETCH_MARGIN + 2 * args.mask_calls
        # Every rank builds the dataset: the loader's entry point needs its length on every rank.
        # Upstream builds it on TP rank 0 only; the build ends before anything is measured.
        self.dataset = build_dataset(
            args.prefix, args.seq_length, steps * args.mbs * self.dp, args.cache, args.mode == "mask"
        )

    def fresh_cache(self) -> None:
        """Every rank idle, the corpus out of the page cache (``--cold``), every rank on its way."""
        dist.barrier()
        if self.args.cold and self.rank == 0:
            drop_cache(self.args.prefix)
        dist.barrier()

    def iterator(
        self, config: ShmDataLoaderConfig, name: str, num_workers: int = 0, mask: bool = False
    ) -> Any:
        return build_batch_iterator(
            self.dataset,
            LoaderSettings(
                micro_batch_size=self.args.mbs,
                consumed_samples=0,
                config=config,
                topology=Topology(world_size=self.world, ranks_per_node=self.world, ranks_per_package=1),
                tp_group=self.tp_group,
                dp_rank=self.dp_rank,
                dp_size=self.dp,
                create_attention_mask=mask,
                job_id=self.args.job,
                name=name,
                num_workers=num_workers,
            ),
        )


def layout(r: Rank) -> dict:
    args, me = r.args, os.getpid()
    phases = {}
    r.fresh_cache()
    gc.collect()
    before = tree_memory(descendants(me))
    it: Any = None  # scheme none: no loader, the ranks' own CPU and memory while they sleep
    if args.scheme == "shm":
        it = r.iterator(shm_config(args.node_workers, args.slots), name="layout")
    elif args.scheme == "megatron":
        it = r.iterator(ShmDataLoaderConfig(enabled=False), name="layout", num_workers=args.num_workers)
    phases["loader_built"] = time.time()
    waits, steps, tree, cpu0, t0w = [], [], [me], {}, 0.0
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        if it is not None:
            next(it)
        t1 = time.perf_counter()
        time.sleep(args.step_ms / 1e3)
        waits.append(t1 - t0)
        steps.append(time.perf_counter() - t0)
        if i + 1 == args.warmup:
            tree = descendants(me)  # this rank and its loader's processes, listed before the window
            cpu0, t0w = cpu_ns(tree), time.perf_counter()
            phases["window_start"] = time.time()
    cpu1, window = cpu_ns(tree), time.perf_counter() - t0w
    phases["window_end"] = time.time()
    now = descendants(me)
    born = [p for p in now if p not in tree]
    cpu1.update(cpu_ns(born))  # a process born inside the window: all its time is in it
    during = tree_memory(now)
    if it is not None:
        it.close()
    del it
    gc.collect()
    phases["closed"] = time.time()
    dist.barrier()
    return {
        "phases": phases,
        "wait_s": waits[args.warmup :],
        "step_s": steps[args.warmup :],
        "window_s": window,
        **window_cpu(cpu0, cpu1),
        "processes": len(tree),
        "processes_born": len(born),
        "processes_gone": len([p for p in tree if p not in now]),
        "before": before,
        "during": during,
    }


def mask_peak(r: Rank) -> dict:
    args = r.args
    it = r.iterator(shm_config(args.node_workers, args.slots), name="mask", mask=True)
    for _ in range(args.slots + 2):  # every slot of the ring mapped in: its pages are in VmRSS now
        batch = next(it)
    mask = batch["attention_mask"]
    out = {"mask_bytes": mask.numel() * mask.element_size(), "mask_shape": list(mask.shape)}
    hwm, torch_peaks = [], []
    for _ in range(args.mask_calls):
        batch = mask = None
        gc.collect()
        rss0 = status_kib("VmRSS")
        reset_peak_rss()
        t0 = time.perf_counter()
        batch = next(it)
        seconds = time.perf_counter() - t0
        hwm.append(
            {"peak_kib": status_kib("VmHWM") - rss0, "kept_kib": status_kib("VmRSS") - rss0, "s": seconds}
        )
    from mdsp_base.allocations import AllocationTrace

    for _ in range(args.mask_calls):
        batch = None
        gc.collect()
        with AllocationTrace() as trace:
            batch = next(it)
        torch_peaks.append(trace.process_peak())
    it.close()
    return {**out, "hwm": hwm, "torch_peak_bytes": torch_peaks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("layout", "mask"), required=True)
    p.add_argument("--scheme", choices=("megatron", "shm", "none"), default="shm")
    for name in ("--prefix", "--cache", "--rendezvous", "--out", "--job"):
        p.add_argument(name, required=True)
    for name, default in (
        ("--tp", 1),
        ("--mbs", 4),
        ("--seq-length", 4096),
        ("--steps", 30),
        ("--warmup", 5),
        ("--slots", 4),
        ("--num-workers", 2),
        ("--node-workers", DEFAULT_WORKERS),
        ("--mask-calls", 0),
    ):
        p.add_argument(name, type=int, default=default)
    p.add_argument("--step-ms", type=float, default=100.0)
    p.add_argument("--cold", action="store_true")
    args = p.parse_args()
    from megatron.core import parallel_state as ps

    times = {"imported": time.time()}
    r = Rank(args)
    times["set_up"] = time.time()
    result = {"layout": layout, "mask": mask_peak}[args.mode](r)
    times.update(result.pop("phases", {}))
    times["measured"] = time.time()
    with open(args.out, "w") as f:
        json.dump({"rank": r.rank, "tp_rank": r.tp_rank, "result": result, "times": times}, f)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # everything is closed and written: skip the interpreter's slow teardown of torch's modules


if __name__ == "__main__":
    main()
    exit_without_teardown()
