"""The A/B command's run (``python -m deepspeed_ext.zero.bench``): each variant built, stepped, timed and
counted on every rank. Apart from the command line, so that ``--help`` loads no torch."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepspeed_ext.zero.cost.profile import Profile
from deepspeed_ext.zero.cost.profile import load as load_profile
from deepspeed_ext.zero.cost.workload import Model
from deepspeed_ext.zero.tools.ab import trace_report
from deepspeed_ext.zero.tools.ab.engine import (
    EmulatedDevice,
    build,
    check_fits,
    one_step,
    peak_bytes,
    release,
)
from deepspeed_ext.zero.tools.ab.gather_wait import GatherWait
from deepspeed_ext.zero.tools.ab.model import flops_per_step
from deepspeed_ext.zero.tools.ab.prediction import compute_steps, predicted, slowest
from deepspeed_ext.zero.tools.ab.step_trace import StepTrace, gather_spans
from deepspeed_ext.zero.tools.ab.variants import Variant, ds_config, variants
from mdsp_base import comm
from mdsp_base.spans import Span
from mdsp_base.topology import Topology, TopologyConfig, detect_topology
from mdsp_base.volume import LINK_CLASSES


def run_variants(
    runnable: list[Variant],
    user: dict,
    shape: Model,
    topology: Topology,
    args: argparse.Namespace,
    device: torch.device,
    emulated: EmulatedDevice | None = None,
) -> dict[str, dict[str, Any]]:
    """Every variant's engine built, then stepped in rounds, one step of each per round, the order
    reversed every other round, so that each round's steps form a pair under the same load.

    Args:
        runnable: the variants that run here.
        user: the user's DeepSpeed JSON.
        shape: the model.
        topology: the job's ranks.
        args: the command's flags (steps, warm-up, profile).
        device: this rank's device.
        emulated: an emulated device the steps' tensor work runs on.

    Returns:
        Per variant name: its timed steps' seconds, collective counter, parameter-fetch wait, the
        spans of its traced step (None without ``--trace``), micro batch and accumulation.
    """
    engines = {v.name: build(v, ds_config(user, v, args.profile), shape, topology, device) for v in runnable}
    counters = {v.name: comm.CommCounter(topology) for v in runnable}
    seconds: dict[str, list[float]] = {v.name: [] for v in runnable}
    waits = {v.name: GatherWait() for v in runnable}
    for step in range(args.warmup + args.steps):
        order = runnable if step % 2 == 0 else runnable[::-1]
        for v in order:
            if step < args.warmup:
                one_step(engines[v.name], shape, step, device, emulated)
                continue
            with comm.counting(counters[v.name]), waits[v.name]:
                seconds[v.name].append(one_step(engines[v.name], shape, step, device, emulated))
    traced: dict[str, list[Span]] = {}
    if args.trace:  # after the paired steps, so that tracing costs none of them
        for v in runnable:
            with comm.counting(comm.CommCounter(topology)), StepTrace() as trace:
                one_step(engines[v.name], shape, args.warmup + args.steps, device, emulated)
            traced[v.name] = trace.spans
    out = {}
    for v in runnable:
        engine = engines.pop(v.name)
        out[v.name] = {
            "seconds": seconds[v.name],
            "counter": counters[v.name],
            "wait": waits[v.name],
            "traced": traced.get(v.name),
            "micro": engine.train_micro_batch_size_per_gpu(),
            "accumulation": engine.gradient_accumulation_steps(),
        }
        release(engine)
    return out


def variant_row(
    variant: Variant,
    measured: dict[str, Any],
    user: dict,
    shape: Model,
    topology: Topology,
    args: argparse.Namespace,
    device: torch.device,
    compute_s: float | None = None,
    profile: Profile | None = None,
) -> dict:
    """One variant's row of the report (a collective: every rank calls it).

    Args:
        variant: the variant.
        measured: its entry of :func:`run_variants`.
        user: the user's DeepSpeed JSON.
        shape: the model.
        topology: the job's ranks.
        args: the command's flags.
        device: this rank's device.
        compute_s: the measured single-rank step (the prediction's compute).
        profile: the probe profile; None: no prediction.

    Returns:
        Steps, TFLOPS, bytes per link class and per NIC, fetch wait, peak and, with a profile and
        ``compute_s``, the predicted step and the collectives per step.
    """
    cfg = ds_config(user, variant, args.profile)
    seconds, counter, waited = measured["seconds"], measured["counter"], measured["wait"]
    sent = torch.tensor(
        [counter.per_link()[link] / args.steps for link in LINK_CLASSES], dtype=torch.float64, device=device
    )
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)
    wait = torch.tensor([waited.seconds, waited.forward_seconds], dtype=torch.float64, device=device)
    dist.all_reduce(wait, op=dist.ReduceOp.SUM)
    wait_s, forward_wait_s = (x / args.steps / topology.world_size for x in wait.tolist())  # the mean rank's
    peak = None
    if not args.no_peak:
        fresh = peak_bytes(
            lambda: build(variant, cfg, shape, topology, device),
            lambda engine, index: one_step(engine, shape, index, device),
            device,
        )
        peak = int(slowest(float(fresh), device))
    flops = flops_per_step(
        shape, measured["micro"] * measured["accumulation"] * shape.seq * topology.world_size
    )
    row: dict[str, Any] = {"variant": variant.name, "ran": True, "reason": None}
    row.update(
        step_s=seconds,
        tflops=[flops / s / topology.world_size / 1e12 for s in seconds],
        bytes_per_step=dict(zip(LINK_CLASSES, (int(x) for x in sent.tolist()))),
        **comm.nic_bytes_per_step(counter, args.steps, device=device),
        peak_bytes=peak,
        gather_wait_s=wait_s,
        gather_wait_share=wait_s / statistics.median(seconds),
        forward_gather_wait_s=forward_wait_s,
    )
    if profile is not None and compute_s is not None:
        calls = {call: count / args.steps for call, count in counter.calls.items()}
        fetches = waited.fetches / args.steps
        prediction = predicted(
            calls, cfg, profile, topology, variant, measured["accumulation"], compute_s, fetches
        )
        row.update(
            predicted_step_s=prediction.step_s,
            predicted=asdict(prediction),
            calls_per_step=[{**call._asdict(), "count": count} for call, count in sorted(calls.items())],
        )
    return row


def traced_rows(rows: list[dict], measured: dict[str, dict[str, Any]], directory: Path) -> None:
    """Each run variant's traced step gathered on rank 0, which writes its trace file and the table
    and adds to its row ``trace`` (the mean rank's sums) and ``trace_file`` (a collective)."""
    summaries = {}
    for row in rows:
        if not row["ran"]:
            continue
        per_rank = gather_spans(measured[row["variant"]]["traced"])
        if per_rank is None:
            continue
        path = trace_report.trace_path(directory, row["variant"])
        trace_report.write_trace(per_rank, path)
        row.update(
            trace=trace_report.mean_summary([trace_report.summarize(r) for r in per_rank]),
            trace_file=str(path),
        )
        summaries[row["variant"]] = row["trace"]
    if summaries:
        (directory / "trace.md").write_text(trace_report.table(summaries) + "\n")


def run(args: argparse.Namespace, shape: Model, emulated: EmulatedDevice | None = None) -> list[dict]:
    """Run every variant; rank 0 prints the table and writes the JSON and plot.

    Args:
        args: the command's parsed flags.
        shape: the model the variants train (the command's flags and preset).
        emulated: an emulated device the steps' tensor work runs on; None: this rank's own device.

    Returns:
        One row per variant, those not run with the reason.
    """
    from deepspeed_ext.zero.tools.ab.report import comparison, paired, plot, predictions, table, write_json

    user = json.loads(Path(args.deepspeed_config).read_text()) if args.deepspeed_config else {}

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
        compute = None
        if profile is not None or emulated is not None:
            compute = compute_steps(shape, user, args.steps, args.warmup, device, emulated)
        compute_s = statistics.median(compute) if compute else None
        every = variants(topology, device, args.quantized_hops)
        runnable = [v for v in every if v.skipped is None]
        measured = run_variants(runnable, user, shape, topology, args, device, emulated)
        args.no_peak = args.no_peak or emulated is not None  # an emulated device holds no tensors
        rows = [
            variant_row(v, measured[v.name], user, shape, topology, args, device, compute_s, profile)
            if v.skipped is None
            else {"variant": v.name, "ran": False, "reason": v.skipped}
            for v in every
        ]
        if args.trace:
            traced_rows(rows, measured, Path(args.trace))
        run = {
            "world_size": topology.world_size, "ranks_per_node": topology.ranks_per_node,
            "ranks_per_package": topology.ranks_per_package, "device": str(device), "shape": vars(shape),
            "steps": args.steps, "loadavg_before": before, "loadavg_after": os.getloadavg(),
            "compute_step_s": compute, "paired": paired(rows),
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
