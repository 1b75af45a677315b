"""One rank of the node benchmark (``benchmarks.data_loader.node``); writes its figures to ``--out``.

Modes (the launcher's parts A-D):

* ``throughput``: TP=1, every rank its own DP stream; for each repetition and producer worker count
  a fresh node loader, ranks calling ``next()`` back to back with no compute. Each rank records its
  window (the wall clock from the end of warm-up to its last step) and its data wait; the node's
  first rank also reads the samples the producer has published (``counters.samples_read``) and the
  CPU time of the producer's process tree (``node_proc.tree_cpu_s``) at both ends of its window.
* ``footprint``: one loader (``--scheme megatron``: the stock path, a DataLoader with
  ``--num-workers`` workers on TP rank 0, and on every other TP rank an idle DataLoader iterator
  with as many workers, as upstream Megatron-LM starts one on every rank; ``shm``: the node loader;
  ``none``: no loader, the ranks' own baseline),
  each step ``next()`` then ``time.sleep(--step-ms)``. Records step time and data wait per step,
  this rank's tree CPU over the steady-state window, its tree's RSS and PSS before the loader and
  at the end of the window, and its own + reaped children's rusage over the loader's whole life.
* ``mask``: one rank, the node loader with ``create_attention_mask`` and ``reset_attention_mask``;
  after warm-up, per ``next()``: the rise of VmHWM above the VmRSS just before the call (VmHWM reset
  through ``/proc/self/clear_refs``), then, on separate calls, the peak of torch's CPU allocator
  (``benchmarks.allocations``: torch tensors only).
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

from benchmarks.data_loader.node_proc import (
    children_cpu_s,
    cpu_rusage_s,
    descendants,
    own_cpu_s,
    reset_peak_rss,
    status_kib,
    tree_cpu_s,
    tree_memory,
)
from benchmarks.data_loader.run import drop_cache
from megatron_ext.data.config import ShmDataLoaderConfig
from megatron_ext.data.loader import LoaderSettings, build_batch_iterator
from plugin_base.topology import Topology

TIMEOUT_S = 300.0


def build_dataset(prefix: str, seq_length: int, num_samples: int, cache: str, mask: bool) -> Any:
    """megatron-core's GPTDataset over the corpus (memory-mapped ``.bin``, Megatron's default)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from megatron_ext.data.indexed import check_indexed_dataset
    from trainer.corpus import gpt_dataset_config

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
        samples = (args.warmup + args.steps + args.slots + 8 + 2 * args.mask_calls) * args.mbs * self.dp
        self.dataset = build_dataset(args.prefix, args.seq_length, samples, args.cache, args.mode == "mask")

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

    def idle_loader(self) -> Any:
        """Upstream's DataLoader on a TP rank other than 0: started (its workers prefetch), never read."""
        from torch.utils.data import DataLoader

        from megatron_ext.data.samplers import BatchSampler, SamplerSettings

        settings = SamplerSettings(micro_batch_size=self.args.mbs, consumed_samples=0, dp_size=self.dp)
        sampler = BatchSampler(settings, len(self.dataset), self.dp_rank)
        workers = self.args.num_workers
        return iter(
            DataLoader(
                self.dataset, batch_sampler=sampler, num_workers=workers, persistent_workers=workers > 0
            )
        )


def throughput(r: Rank) -> list[dict]:
    args, runs = r.args, []
    for rep in range(args.repeats):
        shift = rep % len(args.workers)
        for workers in args.workers[shift:] + args.workers[:shift]:  # order rotated per repetition
            config = shm_config(workers, args.slots)
            run: dict[str, Any] = {"repeat": rep, "workers": workers}
            runs.append(run)
            r.fresh_cache()
            reaped0 = children_cpu_s()
            it = r.iterator(config, name=f"a{rep}w{workers}")
            producer = getattr(it, "producer", None)
            marks, wait, tree = [], 0.0, []
            for i in range(args.warmup + args.steps):
                t0 = time.perf_counter()
                next(it)
                t1 = time.perf_counter()
                wait += (t1 - t0) if i >= args.warmup else 0.0
                if i + 1 == args.warmup and producer is not None:
                    tree = descendants(producer.pid)  # the producer and its workers, listed once
                if i + 1 in (args.warmup, args.warmup + args.steps):
                    mark = {"t": t1}
                    if producer is not None:
                        mark["samples"], mark["cpu_s"] = it.counters.samples_read, tree_cpu_s(tree)
                    marks.append(mark)
            if producer is not None:
                run.update(
                    published_steps=(marks[1]["samples"] - marks[0]["samples"]) / (r.dp * args.mbs),
                    producer_cpu_s=marks[1]["cpu_s"] - marks[0]["cpu_s"],
                    producer_processes=len(tree),
                    tree_changed=sorted(descendants(producer.pid)) != sorted(tree),
                )
            it.close()  # the first rank reaps the producer, which reaped its workers
            run.update(window_s=marks[1]["t"] - marks[0]["t"], wait_s=wait, steps=args.steps)
            if producer is not None:
                run["producer_lifetime_cpu_s"] = children_cpu_s() - reaped0
    dist.barrier()
    return runs


def footprint(r: Rank) -> dict:
    args = r.args
    r.fresh_cache()
    gc.collect()
    before = tree_memory(os.getpid())
    life0 = cpu_rusage_s()
    it: Any = None  # scheme none: no loader, the ranks' own CPU and memory while they sleep
    if args.scheme == "shm":
        it = r.iterator(shm_config(args.node_workers, args.slots), name="footprint")
    elif args.scheme == "megatron":
        it = r.iterator(ShmDataLoaderConfig(enabled=False), name="footprint", num_workers=args.num_workers)
    idle = r.idle_loader() if args.scheme == "megatron" and r.tp_rank != 0 else None
    waits, steps, cpu0, t0w, probe, tree = [], [], 0.0, 0.0, 0.0, []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        if it is not None:
            next(it)
        t1 = time.perf_counter()
        time.sleep(args.step_ms / 1e3)
        waits.append(t1 - t0)
        steps.append(time.perf_counter() - t0)
        if i + 1 == args.warmup:
            probe = own_cpu_s()
            tree = descendants(os.getpid())  # this rank and its loader's processes, listed once
            cpu0, t0w = tree_cpu_s(tree), time.perf_counter()
            probe = own_cpu_s() - probe
    cpu1, window = tree_cpu_s(tree), time.perf_counter() - t0w
    probe -= own_cpu_s()
    changed = sorted(descendants(os.getpid())) != sorted(tree)
    during = tree_memory(os.getpid())
    probe += own_cpu_s()  # this rank's CPU for the readings, taken out of its lifetime figure
    if it is not None:
        it.close()
    del it, idle  # a DataLoader iterator shuts its workers down and joins them as it goes
    lifetime = cpu_rusage_s() - life0 - probe  # before gc.collect(), whose cost is no loader's
    left = len(descendants(os.getpid())) - 1  # processes not reaped yet: their CPU is missing
    gc.collect()
    dist.barrier()
    return {
        "wait_s": waits[args.warmup :],
        "step_s": steps[args.warmup :],
        "window_s": window,
        "cpu_s": cpu1 - cpu0,
        "tree_changed": changed,
        "probe_cpu_s": probe,
        "lifetime_cpu_s": lifetime,
        "unreaped": left,
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
    from benchmarks.allocations import AllocationTrace

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
    p.add_argument("--mode", choices=("throughput", "footprint", "mask"), required=True)
    p.add_argument("--scheme", choices=("megatron", "shm", "none"), default="shm")
    for name in ("--prefix", "--cache", "--rendezvous", "--out", "--job"):
        p.add_argument(name, required=True)
    for name, default in (
        ("--tp", 1),
        ("--mbs", 4),
        ("--seq-length", 8192),
        ("--steps", 20),
        ("--warmup", 5),
    ):
        p.add_argument(name, type=int, default=default)
    for name, default in (
        ("--repeats", 1),
        ("--slots", 4),
        ("--num-workers", 2),
        ("--node-workers", DEFAULT_WORKERS),
    ):
        p.add_argument(name, type=int, default=default)
    p.add_argument("--mask-calls", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--step-ms", type=float, default=200.0)
    p.add_argument("--cold", action="store_true")
    args = p.parse_args()
    from megatron.core import parallel_state as ps

    times = {"imported": time.time()}
    r = Rank(args)
    times["set_up"] = time.time()
    result = {"throughput": throughput, "footprint": footprint, "mask": mask_peak}[args.mode](r)
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
