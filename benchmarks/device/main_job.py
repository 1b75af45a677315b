"""The one GPU record against the stand-in: the main job on a virtual H100, beside its measured tokens/s.

    python -m benchmarks.device.main_job [--configs "no plugins" ...] [--out benchmarks/results/gpu]

Method in full: benchmarks/results/methods.md, `benchmarks.device.main_job`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.device import H100, StandIn
from benchmarks.gpu.main_job import CONFIGS, MODEL, ds_config
from benchmarks.gpu.report import write_report

RESULTS = Path(__file__).resolve().parents[1] / "results" / "gpu"
RECORDS = (RESULTS / "main_job.json", RESULTS / "main_job_per_plugin.json")
"""The H100 launches of ``benchmarks.gpu.main_job`` (tokens/s min / median / max per launch)."""
TOLERANCE = 0.25
"""How far the stand-in's median may lie from the record's and still count as a prediction."""


class PerIteration:
    """The loop's ``iteration_context``: one stand-in for the whole run (its zero buffer and shape
    cache grow once), entered around each iteration, with what each iteration was charged."""

    def __init__(self) -> None:
        self.stand_in = StandIn(H100, dilation=1.0, contention=0.0)
        self.charged: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        stats = self.stand_in.stats
        ops, busy, waited, kinds = stats.ops, stats.busy_s, stats.waited_s, dict(stats.by_kind)
        cpu = time.thread_time()
        with self.stand_in:  # leaving it waits for the device, before the loop stops its clock
            yield
        self.charged.append(
            {
                # the host's own work, which other processes on the cores do not stretch
                "host_cpu_s": time.thread_time() - cpu,
                "ops": stats.ops - ops,
                "busy_s": stats.busy_s - busy,
                "waited_s": stats.waited_s - waited,
                "busy_s_by_kind": {k: v - kinds.get(k, 0.0) for k, v in stats.by_kind.items()},
            }
        )


def run_job(model: list[str], config: str, iters: int, work: Path) -> tuple[list[dict], PerIteration]:
    """Run the main job with ``model`` flags and the record's DeepSpeed JSON for ``config``, each
    iteration on the stand-in; returns the job's per-iteration log records and the charges."""
    from mdsp_base.installer import Installer
    from megatron_ext.trainer.cli import parse_args

    deepspeed_json, log = work / "ds.json", work / "log.jsonl"
    deepspeed_json.write_text(json.dumps(ds_config(CONFIGS[config])))
    log.unlink(missing_ok=True)
    args = parse_args(
        [
            *model,
            "--train-iters",
            str(iters),
            "--deepspeed-config",
            str(deepspeed_json),
            "--data-cache-path",
            str(work / "data"),
            "--log-json",
            str(log),
        ]
    )
    per_iteration = PerIteration()
    with Installer() as installer:
        # the job's warnings are collected from its first import on, as scripts/pretrain_gpt.py does
        from megatron_ext.trainer.notices import quiet

        notices = quiet(installer)
        from megatron_ext.trainer.main import run

        status = run(args, installer, notices, iteration_context=per_iteration)
    if status != 0:
        raise SystemExit(f"error: the main job failed ({config}, exit status {status})")
    return [json.loads(line) for line in log.read_text().splitlines()], per_iteration


def summarize(records: list[dict], per_iteration: PerIteration, warmup: int) -> dict[str, Any]:
    """Tokens/s (min / median / max) and the mean charges per iteration, over the iterations after
    ``warmup``, as the record takes them."""
    timed, charged = records[warmup:], per_iteration.charged[warmup:]
    rates = [r["tokens_per_s"] for r in timed]
    tokens = round(timed[0]["tokens_per_s"] * timed[0]["ms_per_iter"] / 1e3)  # the global batch's
    elapsed = statistics.fmean(r["ms_per_iter"] / 1e3 for r in timed)
    busy = statistics.fmean(c["busy_s"] for c in charged)
    kinds = sorted({k for c in charged for k in c["busy_s_by_kind"]})
    return {
        "tokens_per_s": [min(rates), statistics.median(rates), max(rates)],
        "iteration_s": elapsed,
        "device_busy_s": busy,
        "device_busy_s_by_kind": {
            k: statistics.fmean(c["busy_s_by_kind"].get(k, 0.0) for c in charged) for k in kinds
        },
        "device_ops": statistics.fmean(c["ops"] for c in charged),
        "host_waited_s": statistics.fmean(c["waited_s"] for c in charged),
        "host_cpu_s": statistics.fmean(c["host_cpu_s"] for c in charged),
        # one stream: the time the device had nothing to run is the host's own, uncovered
        "device_idle_s": elapsed - busy,
        "device_bound_tokens_per_s": tokens / busy,
        "skipped_steps": sum(bool(r["skipped"]) for r in records),
        "losses": [r["loss"] for r in records],
    }


def recorded(config: str) -> dict[str, Any]:
    """The record's launches of ``config``: each launch's median, and the whole range."""
    launches = [
        run["tokens_per_s"]
        for path in RECORDS
        for run in json.loads(path.read_text())["runs"]
        if run["config"] == config
    ]
    return {
        "sources": [str(path.relative_to(RESULTS.parents[2])) for path in RECORDS],
        "launch_medians": [med for _, med, _ in launches],
        "median": statistics.median(med for _, med, _ in launches) if launches else None,
        "min": min((lo for lo, _, _ in launches), default=None),
        "max": max((hi for _, _, hi in launches), default=None),
    }


def compare(predicted: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """The stand-in's median tokens/s against the record's median of launch medians."""
    if record["median"] is None:
        return {"error": None, "within_tolerance": None}
    error = predicted["tokens_per_s"][1] / record["median"] - 1
    return {"error": error, "within_tolerance": abs(error) <= TOLERANCE}


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The report: one row per configuration, then the charges per iteration."""
    lines = [
        f"Model: `{meta['model']}`, {meta['iters']} iterations, TP=1, ZeRO-3, one rank; tokens/s over "
        f"iterations {meta['warmup'] + 1}-{meta['iters']}. Command: `{meta['command']}`.",
        "",
        f"Prediction: {meta['prediction']} (not measured); H100 table, dilation 1, contention 0, GEMM efficiency "
        f"{H100.gemm_efficiency} (measured: benchmarks/results/gpu/sliced_gemm.json). Record: H100, measured.",
        "",
        "| config | stand-in tokens/s min/med/max | record launch medians | record min-max | error | "
        f"within {TOLERANCE:.0%} |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lo, med, hi = row["stand_in"]["tokens_per_s"]
        rec, cmp = row["record"], row["comparison"]
        medians = ", ".join(f"{m:.0f}" for m in rec["launch_medians"]) or "none"
        span = f"{rec['min']:.0f}-{rec['max']:.0f}" if rec["median"] is not None else "-"
        error = f"{cmp['error']:+.1%}" if cmp["error"] is not None else "-"
        lines.append(
            f"| {row['config']} | {lo:.0f}/{med:.0f}/{hi:.0f} | {medians} | {span} | {error} | "
            f"{cmp['within_tolerance']} |"
        )
    lines += [
        "",
        "Per timed iteration (means; seconds): the device's charges per kind; the time it sat idle while "
        "the host issued work (iteration minus device busy); the issuing thread's CPU time (what other "
        "processes on the cores do not stretch); the tokens/s the device alone allows (batch / busy). "
        f"Load average over the run: {meta['load_avg']}.",
        "",
        "| config | iteration | device busy | matmul | attention | memory | ops | device idle | host CPU | "
        "host waited | device-bound tokens/s | skipped steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        s = row["stand_in"]
        kinds = s["device_busy_s_by_kind"]
        lines.append(
            f"| {row['config']} | {s['iteration_s']:.3f} | {s['device_busy_s']:.3f} | "
            f"{kinds.get('matmul', 0.0):.3f} | {kinds.get('attention', 0.0):.3f} | {kinds.get('memory', 0.0):.3f} | "
            f"{s['device_ops']:.0f} | {s['device_idle_s']:.3f} | {s['host_cpu_s']:.3f} | {s['host_waited_s']:.3f} | "
            f"{s['device_bound_tokens_per_s']:.0f} | {s['skipped_steps']} |"
        )
    lines += ["", "Where the time goes:", ""]
    for row in rows:
        s, rec = row["stand_in"], row["record"]
        if rec["median"] is None:
            continue
        bound, tokens = s["device_bound_tokens_per_s"], s["device_bound_tokens_per_s"] * s["device_busy_s"]
        setter = "the host" if s["device_idle_s"] > s["device_busy_s"] else "the device"
        lines.append(
            f"- {row['config']}: the device alone allows {bound:.0f} tokens/s ({bound / rec['median'] - 1:+.1%} "
            f"against the record); the record's iteration takes {tokens / rec['median']:.3f} s, the issuing "
            f"thread's CPU time here {s['host_cpu_s']:.3f} s: {setter} sets the stand-in's rate."
        )
    lines.append(
        "- Collectives run for real over gloo on host memory (at one rank DeepSpeed's gradient reduce-scatter "
        "still moves the whole bf16 gradient), where the H100 ran them on the device."
    )
    return "\n".join(lines) + "\n"


PREDICTION = "stand-in, computed from the device table"


def measure(model: list[str], configs: list[str], iters: int, warmup: int) -> list[dict[str, Any]]:
    """One stand-in run of each configuration, with the record beside it."""
    rows: list[dict[str, Any]] = []
    for config in configs:
        with tempfile.TemporaryDirectory(prefix="standin-main-job-") as work:
            records, per_iteration = run_job(model, config, iters, Path(work))
        predicted, record = summarize(records, per_iteration, warmup), recorded(config)
        rows.append(
            {
                "config": config,
                "stand_in": predicted,
                "device": per_iteration.stand_in.describe(),
                "record": record,
                "comparison": compare(predicted, record),
            }
        )
        print(json.dumps({"config": config, **rows[-1]["comparison"]}), flush=True)
    return rows


def main() -> int:
    """Run the configurations asked for and write the report."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--iters", type=int, default=20, help="as the record's launches")
    p.add_argument("--warmup", type=int, default=5, help="iterations left out of the tokens/s figures")
    p.add_argument("--configs", nargs="+", default=["no plugins"], choices=list(CONFIGS), metavar="CONFIG")
    args = p.parse_args()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):  # one rank, as the record's launch
        os.environ.pop(name, None)
    rows = measure(MODEL, args.configs, args.iters, args.warmup)
    meta = {
        "command": "python -m benchmarks.device.main_job " + " ".join(sys.argv[1:]),
        "model": " ".join(MODEL),
        "iters": args.iters,
        "warmup": args.warmup,
        "prediction": PREDICTION,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    write_report(args.out, "standin_main_job", {"meta": meta, "rows": rows}, markdown(meta, rows))
    return 0


if __name__ == "__main__":
    from mdsp_base.shutdown import exit_without_teardown

    exit_without_teardown(main())
