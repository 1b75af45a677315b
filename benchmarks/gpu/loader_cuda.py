"""The node loader's GPU copy path against Megatron's, on one GPU: throughput of ``next()`` and the
synchronising CUDA calls it makes, at micro batch 4 x sequence 8192.

    python -m benchmarks.gpu.loader_cuda [--out benchmarks/results/gpu]

Schemes, each over the same samples of one random-token corpus, TP=1 (no broadcast on either path):

Method in full: benchmarks/results/methods.md, `benchmarks.gpu.loader_cuda`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.gpu.report import write_report
from mdsp_base.shutdown import exit_without_teardown

REPO = Path(__file__).resolve().parents[2]


def write_random_corpus(prefix: str, tokens: int, seed: int = 0) -> None:
    """Documents of random byte tokens (mean length 3000), each ended by the byte tokenizer's EOD."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_ext.trainer.corpus import ByteTokenizer

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    written = 0
    while written < tokens:
        doc = rng.integers(0, 256, int(rng.integers(500, 5500)), dtype=np.int64)
        builder.add_item(torch.from_numpy(np.append(doc, ByteTokenizer.eod)))
        builder.end_document()
        written += len(doc) + 1
    builder.finalize(prefix + ".idx")


def build_dataset(prefix: str, cache: str, seq: int, samples: int, mask: str) -> Any:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from megatron_ext.trainer.corpus import gpt_dataset_config

    config = dataclasses.replace(
        gpt_dataset_config(prefix, seq, 1234, cache, create_attention_mask=mask != "none"),
        reset_attention_mask=mask == "reset",
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, [samples, 0, 0], lambda: True, config).build()[0]


_ACTIVITIES = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


def _count_syncs(prof: Any) -> int:
    return sum(e.count for e in prof.key_averages() if "Synchronize" in e.key)


def _sync_calls(fn: Any) -> int:
    """``cuda*Synchronize`` runtime calls the profiler records around ``fn`` and one device sync."""
    with torch.profiler.profile(activities=_ACTIVITIES) as prof:
        fn()
        torch.cuda.synchronize()
    return _count_syncs(prof)


def measure(
    dataset: Any,
    scheme: str,
    workers: int,
    mask: bool,
    mbs: int,
    steps: int,
    profile_steps: int,
    device: torch.device,
) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from megatron_ext.data.config import ShmDataLoaderConfig
    from megatron_ext.data.loader import LoaderSettings, build_batch_iterator

    it = build_batch_iterator(
        dataset,
        LoaderSettings(
            micro_batch_size=mbs,
            consumed_samples=0,
            config=ShmDataLoaderConfig(enabled=scheme == "shm", timeout_s=600),
            topology=None,
            tp_group=ps.get_tensor_model_parallel_group(),
            dp_rank=0,
            dp_size=1,
            create_attention_mask=mask,
            name=f"bench-{scheme}-{workers}-{mask}-{os.getpid()}",
            device=device,
            num_workers=workers,
        ),
    )
    try:
        for _ in range(3):
            batch = next(it)
        torch.cuda.synchronize()
        nbytes = sum(t.numel() * t.element_size() for t in batch.values())
        calls = []
        start = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            next(it)
            calls.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        baseline = _sync_calls(lambda: None)  # what the profiler's own start and stop add
        with (
            warnings.catch_warnings(record=True) as caught,
            torch.profiler.profile(activities=_ACTIVITIES) as prof,
        ):
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(profile_steps):
                    next(it)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()  # closes the window; counted in the baseline too
        syncs = _count_syncs(prof) - baseline
        sync_warnings = sum("synchronizing" in str(w.message) for w in caught)
    finally:
        it.close()
    return {
        "scheme": scheme,
        "workers": workers,
        "mask": mask,
        "batch_MB": nbytes / 1e6,
        "next_ms_min": min(calls),
        "next_ms_median": statistics.median(calls),
        "next_ms_max": max(calls),
        "batches_per_s": steps / wall,
        "GB_per_s": steps * nbytes / wall / 1e9,
        "sync_calls_per_step": syncs / profile_steps,
        "sync_warnings_per_step": sync_warnings / profile_steps,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = [
        "mask",
        "scheme",
        "batch MB",
        "next() ms min/med/max",
        "batches/s",
        "GB/s to GPU",
        "sync runtime calls / step",
        "sync-debug warnings / step",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        name = "shm loader" if r["scheme"] == "shm" else f"megatron, {r['workers']} workers"
        lines.append(
            f"| {r['mask_setting']} | {name} | {r['batch_MB']:.1f} | {r['next_ms_min']:.2f}/"
            f"{r['next_ms_median']:.2f}/{r['next_ms_max']:.2f} | {r['batches_per_s']:.1f} | "
            f"{r['GB_per_s']:.2f} | {r['sync_calls_per_step']:.2f} | {r['sync_warnings_per_step']:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu")
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--steps", type=int, default=100, help="timed next() calls without a mask")
    p.add_argument("--mask-steps", type=int, default=15, help="timed next() calls with a mask")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument(
        "--workers", type=int, nargs="+", default=[0, 2], help="DataLoader workers of Megatron's path"
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: loader_cuda needs a CUDA (or ROCm) GPU")
    from megatron.core import parallel_state as ps

    torch.cuda.set_device(0)
    work = tempfile.mkdtemp(prefix="loader-cuda-")
    dist.init_process_group("nccl", init_method=f"file://{work}/rendezvous", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, create_gloo_process_groups=False)
    device = torch.device("cuda", 0)
    samples = (3 + max(args.steps, args.mask_steps) + args.profile_steps) * args.mbs
    prefix = os.path.join(work, "corpus")
    write_random_corpus(prefix, int(samples * (args.seq_length + 1) * 1.1))
    rows = []
    for mask in ("none", "causal", "reset"):
        dataset = build_dataset(prefix, os.path.join(work, "cache"), args.seq_length, samples, mask)
        steps = args.steps if mask == "none" else args.mask_steps
        for scheme, workers in [("megatron", w) for w in args.workers] + [("shm", 0)]:
            row = measure(
                dataset, scheme, workers, mask != "none", args.mbs, steps, args.profile_steps, device
            )
            row["mask_setting"] = {"none": "none", "causal": "causal (default)", "reset": "reset at EOD"}[
                mask
            ]
            rows.append(row)
            print(json.dumps(row), flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    meta = {
        "device": torch.cuda.get_device_name(),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "mbs": args.mbs,
        "seq_length": args.seq_length,
    }
    text = (
        f"Device: {meta['device']}, {meta['cpus']} CPUs, load average {meta['load_avg'][0]:.2f}; micro batch "
        f"{args.mbs} x sequence {args.seq_length}, TP=1.\n\n{table(rows)}\n"
    )
    write_report(args.out, "loader_cuda", {"meta": meta, "rows": rows}, text)
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
