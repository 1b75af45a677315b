"""One rank of the ZeRO benchmark: ZeRO-3, ZeRO++ hpZ and the hierarchical variant, side by side.

Started by ``benchmarks.zero.run`` on every rank (emulated cluster or loopback). The three engines
are built once, then their steps interleave (ZeRO-3, hpZ, ours, ZeRO-3, ...) so that a change of
host load hits all three alike. Each step is timed between barriers; bytes per link class are
counted for every step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch
import torch.distributed as dist

from deepspeed_ext import comm
from deepspeed_ext.topology import Topology


def model(hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, hidden), torch.nn.Tanh()]
    return torch.nn.Sequential(*blocks)


def ds_config(args: argparse.Namespace, topology: Topology, **zero: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.micro,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                              "stage3_prefetch_bucket_size": 0, **zero},
        "steps_per_print": 10**9,
        "topology": {"ranks_per_node": topology.ranks_per_node, "ranks_per_package": topology.ranks_per_package},
        "hierarchical_zero": {"enabled": False, "secondary_level": args.level, "secondary_memory_budget_gb": 1.0},
    }


def build(kind: str, cfg: dict, topology: Topology, args: argparse.Namespace):
    import deepspeed
    from deepspeed.utils import groups

    from deepspeed_ext import zero

    groups.mpu, groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None, None
    net = model(args.hidden, args.layers)
    if kind == "ours":
        cfg["hierarchical_zero"]["enabled"] = True
        engine, *_ = zero.initialize(model=net, config=cfg, topology=topology, model_parameters=net.parameters())
    else:
        engine, *_ = deepspeed.initialize(model=net, config=cfg, model_parameters=net.parameters())
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None  # hpZ leaves its group global; the next engine must not see it
    return engine


def one_step(engine, counter: comm.CommCounter, step: int, args: argparse.Namespace) -> float:
    dist.barrier()
    start = time.perf_counter()
    for micro in range(args.micro):
        g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
        x = torch.randn(args.batch, args.hidden, generator=g)
        with counter.phase("forward"):
            loss = engine(x).pow(2).mean()
        with counter.phase("backward"):
            engine.backward(loss)
        with counter.phase("step"):
            engine.step()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--micro", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--level", default="package", choices=("auto", "package", "node"))
    args = parser.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    spec = json.loads(os.environ["EMU_SPEC"]) if "EMU_SPEC" in os.environ else None
    per_package = spec["ranks_per_package"] if spec else int(os.environ.get("BENCH_RANKS_PER_PACKAGE", "2"))
    topology = Topology(dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"]), per_package)
    comm.patch_deepspeed_comm()
    hpz = topology.ranks_per_node
    engines = {
        "zero3": build("stock", ds_config(args, topology), topology, args),
        f"zero++ hpZ({hpz})": build("stock", ds_config(args, topology, zero_hpz_partition_size=hpz), topology, args),
        "ours": build("ours", ds_config(args, topology), topology, args),
    }
    counters = {name: comm.CommCounter(topology) for name in engines}
    times: dict[str, list[float]] = {name: [] for name in engines}
    counts: dict[str, dict] = {}
    for step in range(args.warmup + args.steps):
        for name, engine in engines.items():
            counters[name].reset()
            with comm.counting(counters[name]):
                seconds = one_step(engine, counters[name], step, args)
            if step >= args.warmup:
                times[name].append(seconds)
                counts[name] = counters[name].snapshot()
    ours = engines["ours"].hierarchical_zero
    from benchmarks.cluster import write_result

    write_result({"times": times, "counts": counts, "level": ours.levels.secondary_level,
                  "params": sum(ours.model.param_numels), "args": vars(args),
                  "topology": [topology.world_size, topology.ranks_per_node, topology.ranks_per_package]})


if __name__ == "__main__":
    main()
