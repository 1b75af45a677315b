"""Set-up time and memory of the producer's index streams for a large dataset.

    .venv/bin/python -m benchmarks.data_loader.sampler_setup --samples 100000000 --streams 8

Method in full: benchmarks/results/methods.md, `benchmarks.data_loader.sampler_setup`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

from mdsp_base.shutdown import exit_without_teardown


def _status_kib(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the peak) of this process, KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:"))


def _measure(mode: str, samples: int, streams: int, mbs: int, sharding: bool, queue: mp.Queue) -> None:
    import torch

    from megatron_ext.data.samplers import EpochPermutations, random_batches

    torch.set_num_threads(1)  # as in the producer
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from this process's RSS now (Linux 4.0+)
    base = _status_kib("VmRSS")
    start = time.perf_counter()
    if mode == "arrays":
        shared = EpochPermutations()
        iters = [
            random_batches(samples, 0, mbs, r, streams, sharding, permutations=shared) for r in range(streams)
        ]
        first = [next(s) for s in iters]
    else:  # a Python list per stream, built one after another
        lists = []
        for r in range(streams):
            g = torch.Generator()
            g.manual_seed(0)
            if sharding:
                bucket = (samples // (mbs * streams)) * mbs
                lists.append([r * bucket + i for i in torch.randperm(bucket, generator=g).tolist()])
            else:
                lists.append(torch.randperm((samples // mbs) * mbs, generator=g).tolist()[r::streams])
        first = [lst[:mbs] for lst in lists]
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    queue.put(
        dict(
            mode=mode,
            samples=samples,
            streams=streams,
            data_sharding=sharding,
            seconds=round(seconds, 2),
            peak_rss_growth_mib=round((peak - base) / 1024),
            first=first[0],
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=100_000_000)
    p.add_argument("--streams", type=int, default=8, help="DP ranks on the node")
    p.add_argument("--list-streams", type=int, default=1, help="streams of the list-based set-up")
    p.add_argument("--micro-batch-size", type=int, default=4)
    args = p.parse_args()
    ctx = mp.get_context("forkserver")  # a process per case: its peak RSS is that case's alone
    ctx.set_forkserver_preload(["torch", "megatron_ext.data.samplers"])
    cases = [("arrays", args.streams, s) for s in (True, False)] + [
        ("lists", args.list_streams, s) for s in (True, False)
    ]
    for mode, streams, sharding in cases:
        queue = ctx.Queue()
        proc = ctx.Process(
            target=_measure, args=(mode, args.samples, streams, args.micro_batch_size, sharding, queue)
        )
        proc.start()
        print(json.dumps(queue.get()), flush=True)
        proc.join()


if __name__ == "__main__":
    main()
    exit_without_teardown()
