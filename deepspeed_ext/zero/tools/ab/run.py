"""The A/B command's run (``python -m deepspeed_ext.zero.bench``): each variant built, stepped, timed and
counted on every rank. Apart from the command line, so that ``--help`` loads no torch."""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepspeed_ext.zero.cost.profile import Profile
from deepspeed_ext.zero.cost.profile import load as load_profile
from deepspeed_ext.zero.cost.workload import Model
from deepspeed_ext.zero.tools.ab.cli import model_shape
from deepspeed_ext.zero.tools.ab.gather_wait import GatherWait
from deepspeed_ext.zero.tools.ab.model import build_model, flops_per_step
from deepspeed_ext.zero.tools.ab.prediction import compute_steps, predicted, slowest
from deepspeed_ext.zero.tools.ab.variants import Variant, ds_config, variants
from mdsp_base import comm
from mdsp_base.topology import Topology, TopologyConfig, detect_topology
from mdsp_base.volume import LINK_CLASSES


def build(variant: Variant, cfg: dict, shape: Model, topology: Topology, device: torch.device) -> Any:
    import deepspeed

    from deepspeed_ext import zero

    net = build_model(shape).to(device)
    if variant.ours:
        return zero.initialize(model=net, config=cfg, topology=topology, model_parameters=net.parameters())[0]
    return deepspeed.initialize(model=net, config=cfg, model_parameters=net.parameters())[0]


def one_step(engine: Any, shape: Model, step: int, device: torch.device) -> float:
    """One optimizer step (all micro-batches), the slowest rank's seconds from a barrier."""
    dist.barrier()
    start = time.perf_counter()
    for micro in range(engine.gradient_accumulation_steps()):
        g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
        tokens = torch.randint(
            shape.vocab, (engine.train_micro_batch_size_per_gpu(), shape.seq + 1), generator=g
        )
        tokens = tokens.to(device)
        logits = engine(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return slowest(time.perf_counter() - start, device)


def _release(engine: Any) -> None:
    """Free an engine and what DeepSpeed left in its globals (hpZ's group, the mpu)."""
    from deepspeed.utils import groups

    engine.destroy()
    groups.mpu, groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None, None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cpu_peak(variant: Variant, cfg: dict, shape: Model, topology: Topology, device: torch.device) -> int:
    """Most bytes the process held at once during a fresh engine's second step."""
    from torch.profiler import record_function

    from mdsp_base.allocations import AllocationTrace

    with AllocationTrace() as trace:
        engine = build(variant, cfg, shape, topology, device)
        one_step(engine, shape, 0, device)
        with record_function("measured step"):
            one_step(engine, shape, 1, device)
    _release(engine)
    return trace.process_peak("measured step")


def check_fits(shape: Model, device: torch.device) -> None:
    """Each rank builds the model whole before ZeRO partitions it (as the suite's main job does):
    refuse a shape whose fp32 weights do not fit this device's free memory, naming the fix."""
    if device.type != "cuda":
        return
    need = 4 * sum(p.numel() for p in build_model(shape, device="meta").parameters())
    free, _ = torch.cuda.mem_get_info(device)
    if need > 0.8 * free:
        raise ValueError(
            f"the A/B model ({vars(shape)}) needs {need / 2**30:.1f} GiB of fp32 weights on each rank before "
            f"partitioning, {free / 2**30:.1f} GiB are free: pass --layers to shrink it or a smaller preset"
        )


def run_variant(
    variant: Variant,
    user: dict,
    shape: Model,
    topology: Topology,
    args: argparse.Namespace,
    device: torch.device,
    compute_s: float | None = None,
    profile: Profile | None = None,
) -> dict:
    """Build, warm up, time ``args.steps`` steps, count bytes and read the peak of one variant;
    with a ``profile`` also its predicted step (``compute_s``: the measured single-rank step)."""
    cfg = ds_config(user, variant, args.profile)
    row: dict[str, Any] = {"variant": variant.name, "ran": False, "reason": variant.skipped}
    if variant.skipped is not None:
        return row
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine = build(variant, cfg, shape, topology, device)
    counter = comm.CommCounter(topology)
    for step in range(args.warmup):
        one_step(engine, shape, step, device)
    seconds = []
    with comm.counting(counter), GatherWait() as waited:
        for step in range(args.steps):
            seconds.append(one_step(engine, shape, args.warmup + step, device))
    sent = torch.tensor(
        [counter.per_link()[link] / args.steps for link in LINK_CLASSES], dtype=torch.float64, device=device
    )
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)
    wait = torch.tensor([waited.seconds, waited.forward_seconds], dtype=torch.float64, device=device)
    dist.all_reduce(wait, op=dist.ReduceOp.SUM)
    wait_s, forward_wait_s = (x / args.steps / topology.world_size for x in wait.tolist())  # the mean rank's
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    _release(engine)
    if peak is None and not args.no_peak:
        peak = cpu_peak(variant, cfg, shape, topology, device)
    peak = None if peak is None else int(slowest(float(peak), device))
    flops = flops_per_step(shape, micro * accumulation * shape.seq * topology.world_size)
    row.update(
        ran=True,
        step_s=seconds,
        tflops=[flops / s / topology.world_size / 1e12 for s in seconds],
        bytes_per_step=dict(zip(LINK_CLASSES, (int(x) for x in sent.tolist()))),
        peak_bytes=peak,
        gather_wait_s=wait_s,
        gather_wait_share=wait_s / statistics.median(seconds),
        forward_gather_wait_s=forward_wait_s,
    )
    if profile is not None and compute_s is not None:
        calls = {call: count / args.steps for call, count in counter.calls.items()}
        prediction = predicted(calls, cfg, profile, topology, variant, accumulation, compute_s)
        row.update(
            predicted_step_s=prediction.step_s,
            predicted=asdict(prediction),
            calls_per_step=[{**call._asdict(), "count": count} for call, count in sorted(calls.items())],
        )
    return row


def run(args: argparse.Namespace) -> list[dict]:
    """Run every variant of the parsed flags; rank 0 prints the table and writes the JSON and plot.
    Returns the rows."""
    from deepspeed_ext.zero.tools.ab.report import comparison, plot, predictions, table, write_json

    user = json.loads(Path(args.deepspeed_config).read_text()) if args.deepspeed_config else {}
    shape = model_shape(args)

    gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo", device_id=device if gpu else None)
    patched = comm.patch_deepspeed_comm()  # counts DeepSpeed's collectives while a counter is active
    try:
        topology = detect_topology(
            TopologyConfig.parse(user.get("topology"), "topology"), world_size=dist.get_world_size()
        )
        check_fits(shape, device)
        before = os.getloadavg()
        # read once, before any variant runs: a profile that does not fit this job stops it here
        profile = load_profile(args.profile, topology) if args.profile is not None else None
        compute = compute_steps(shape, user, args.steps, args.warmup, device) if profile else None
        compute_s = statistics.median(compute) if compute else None
        rows = [
            run_variant(v, user, shape, topology, args, device, compute_s, profile)
            for v in variants(topology, device)
        ]
        run = {
            "world_size": topology.world_size, "ranks_per_node": topology.ranks_per_node,
            "ranks_per_package": topology.ranks_per_package, "device": str(device), "shape": vars(shape),
            "steps": args.steps, "loadavg_before": before, "loadavg_after": os.getloadavg(),
            "compute_step_s": compute,
        }  # fmt: skip
        if dist.get_rank() == 0:
            header = (f"{topology.world_size} ranks ({topology.ranks_per_node}/node, {topology.ranks_per_package}/package) "
                      f"on {device.type}; model {vars(shape)}; {args.steps} timed steps; load {before[0]:.2f} -> {run['loadavg_after'][0]:.2f}")  # fmt: skip
            print(table(rows, header))
            print("\n".join(comparison(rows) + predictions(rows)))
            if args.json:
                write_json(rows, args.json, run)
            if args.plot:
                plot(rows, args.plot, header)
        return rows
    finally:
        if patched:
            comm.unpatch_deepspeed_comm()
        dist.destroy_process_group()
