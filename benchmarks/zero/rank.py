"""One rank of the ZeRO benchmark: ZeRO-3, ZeRO++ hpZ and the hierarchical variant, side by side.

Method in full: benchmarks/results/methods.md, `benchmarks.zero.rank`.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.cluster.netns import sent_bytes
from benchmarks.device import StandIn, add_device_flags, stand_in
from benchmarks.zero.variants import Question, param_count, variant_configs
from deepspeed_ext.zero.tools.ab.engine import initialize, peak_bytes
from deepspeed_ext.zero.tools.ab.model import mlp
from mdsp_base import comm
from mdsp_base.paired import MIN_PAIRS
from mdsp_base.shutdown import exit_without_teardown
from mdsp_base.topology import Topology


def build(ours: bool, cfg: dict, topology: Topology, args: argparse.Namespace) -> Any:
    """The engine of ``cfg`` over the benchmark's MLP: ``--layers`` square layers of ``--hidden``."""
    if ours:
        cfg["hierarchical_zero"]["enabled"] = True
    return initialize(ours, mlp([args.hidden] * (args.layers + 1), tanh_last=True), cfg, topology)


def engine_bytes(engine: Any) -> dict[str, int]:
    """Bytes of the storages the engine's state lives in, each storage counted once."""
    opt = engine.optimizer
    parts = {
        "weights_16bit": [p.ds_tensor for p in engine.module.parameters()]
        + list(opt.fp16_partitioned_groups_flat),
        "secondary": [
            t
            for p in engine.module.parameters()
            if (t := getattr(p, "ds_secondary_tensor", None)) is not None
        ],
        "fp32_and_adam": list(opt.fp32_partitioned_groups_flat)
        + [v for s in opt.optimizer.state.values() for v in s.values() if torch.is_tensor(v)],
        "gradients": [t for t in (getattr(opt, "grad_partitions_flat_buffer", None),) if t is not None],
    }
    seen: set[int] = set()
    out = {}
    for name, tensors in parts.items():
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        out[name] = total
    reducer = getattr(opt, "hierarchical_reducer", None)  # gradient blocks held for the cross-node hop
    out["held_for_cross_node"] = reducer.peak_bytes if reducer is not None else 0
    return out


def one_step(
    engine: Any, counter: comm.CommCounter, step: int, args: argparse.Namespace, device: StandIn | None = None
) -> tuple[float, dict[str, int]]:
    """One optimizer step between barriers: its seconds and, on the host's own compute, the engine's
    bytes after the last backward. On a stand-in ``device`` the step ends when the device is idle."""
    dist.barrier()
    start = time.perf_counter()
    held: dict[str, int] = {}
    dtype = torch.float32 if device is None else torch.bfloat16
    with device if device is not None else nullcontext():
        for micro in range(args.micro):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
            x = torch.randn(args.batch, args.hidden, generator=g, dtype=dtype)
            with counter.phase("forward"):
                loss = engine(x).pow(2).mean()
            with counter.phase("backward"):
                engine.backward(loss)
            if micro == args.micro - 1 and device is None:
                paused = time.perf_counter()
                held = engine_bytes(engine)
                start += time.perf_counter() - paused  # reading the tensors is not part of the step
            with counter.phase("step"):
                engine.step()
    dist.barrier()
    return time.perf_counter() - start, held


def peak(ours: bool, cfg: dict, topology: Topology, args: argparse.Namespace) -> int:
    """Most bytes the rank held at once during a fresh engine's second step (the other engines idle),
    read from the allocator's running total."""
    counter = comm.CommCounter(topology)
    return peak_bytes(
        lambda: build(ours, copy.deepcopy(cfg), topology, args),
        lambda engine, index: one_step(engine, counter, index, args),
        torch.device("cpu"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument(
        "--micro",
        type=int,
        nargs="+",
        default=[1],
        help="gradient accumulation steps; several: one after the other",
    )
    parser.add_argument(
        "--steps", type=int, default=MIN_PAIRS, help="timed steps per variant (paired across the variants)"
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prefetch-bucket", type=int, default=50_000_000, help="stage3_prefetch_bucket_size")
    parser.add_argument("--max-live", type=int, default=300_000, help="stage3_max_live_parameters")
    parser.add_argument(
        "--ours-variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="one more engine of ours with these hierarchical_zero keys",
    )
    parser.add_argument(
        "--quantized-hops",
        metavar="JSON",
        help="one more engine of ours with quantized inter-node hops: the hierarchical_zero keys that turn them on",
    )
    parser.add_argument(
        "--variant-set",
        choices=("levels", "scale"),
        default="levels",
        help="levels: ZeRO-3, hpZ and ours at the package and node levels; scale: benchmarks.zero.variants",
    )
    parser.add_argument(
        "--chunks", type=int, default=4, help="pipeline_chunks of the pipelined variants (scale)"
    )
    parser.add_argument(
        "--algorithms",
        nargs="+",
        default=["recursive"],
        help="inter_node_algorithm of each pipelined variant (scale)",
    )
    parser.add_argument(
        "--question",
        type=Question,
        choices=list(Question),
        default=Question.ALL,
        help="which scale variants (benchmarks.zero.variants.Question)",
    )
    parser.add_argument(
        "--no-peak", action="store_true", help="skip the peak-memory pass after the timed steps"
    )
    add_device_flags(parser)
    args = parser.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    spec = json.loads(os.environ["EMU_SPEC"]) if "EMU_SPEC" in os.environ else None
    per_package = spec["ranks_per_package"] if spec else int(os.environ.get("BENCH_RANKS_PER_PACKAGE", "2"))
    topology = Topology(dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"]), per_package)
    comm.patch_deepspeed_comm()
    if args.quantized_hops:
        args.ours_variant.append(f"package, quantized hops={args.quantized_hops}")
    results = []
    for micro in args.micro:
        # One process for every accumulation value: 16 ranks take minutes to start on a small host.
        args.micro = micro
        results.append(measure(variant_configs(args, topology), topology, args, spec is not None))
    from benchmarks.cluster import write_result

    write_result(results)


def measure(
    configs: dict[str, tuple[bool, dict]], topology: Topology, args: argparse.Namespace, on_cluster: bool
) -> dict[str, Any]:
    """Build every engine, interleave their steps, charge each one's last step to the physical
    links, then (unless --no-peak or on a stand-in) measure each one's peak."""
    engines = {name: build(ours, copy.deepcopy(cfg), topology, args) for name, (ours, cfg) in configs.items()}
    counters = {name: comm.CommCounter(topology) for name in engines}
    devices = {name: stand_in(args) for name in engines}  # one each: its charged seconds are its own
    record: dict[str, dict[str, Any]] = {
        name: {"times": [], "wire": [], "held": [], "device_s": []} for name in engines
    }
    counts: dict[str, dict] = {}
    for step in range(args.warmup + args.steps):
        for name, engine in engines.items():
            counters[name].reset()
            before = sent_bytes() if on_cluster else None
            device = devices[name]
            busy = device.stats.busy_s if device else 0.0
            with comm.counting(counters[name]):
                seconds, held = one_step(engine, counters[name], step, args, device)
            if step >= args.warmup:
                record[name]["times"].append(seconds)
                record[name]["held"].append(held)
                if device:
                    record[name]["device_s"].append(device.stats.busy_s - busy)
                if before is not None:
                    after = sent_bytes()
                    record[name]["wire"].append({k: after[k] - before[k] for k in after})
                counts[name] = counters[name].snapshot()
    del engines  # the next accumulation value's engines replace them
    for name, (ours, cfg) in configs.items():
        record[name]["nic"] = comm.nic_bytes_per_step(counters[name], 1)  # the last step's
        measured = not args.no_peak and devices[name] is None
        record[name]["peak"] = peak(ours, cfg, topology, args) if measured else None
    return {
        "record": record,
        "counts": counts,
        "params": param_count(args),
        "args": dict(vars(args)),  # a copy: args.micro changes per accumulation value
        "topology": [topology.world_size, topology.ranks_per_node, topology.ranks_per_package],
        "loadavg": os.getloadavg(),
        # the device and its factors (the charged figures in it are the first engine's)
        "device": next((d.describe() for d in devices.values() if d is not None), None),
    }


if __name__ == "__main__":
    main()
    exit_without_teardown()
