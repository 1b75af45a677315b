"""The main job on one GPU with and without the plugins: losses and tokens per second.

    python -m benchmarks.gpu.main_job [--out benchmarks/results/gpu]

Method in full: benchmarks/results/methods.md, `benchmarks.gpu.main_job`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.gpu.report import write_report
from mdsp_base.shutdown import exit_without_teardown

REPO = Path(__file__).resolve().parents[2]
MODEL = [
    "--num-layers",
    "8",
    "--hidden-size",
    "2048",
    "--num-attention-heads",
    "16",
    "--seq-length",
    "2048",
    "--micro-batch-size",
    "4",
    "--lr",
    "2e-4",
    "--bf16",
]


SECTIONS = ("shm_data_loader", "hierarchical_zero", "flash_overlap")
CONFIGS = {
    "no plugins": (),
    "shm loader": ("shm_data_loader",),
    "hierarchical ZeRO": ("hierarchical_zero",),
    "Flash-Overlap": ("flash_overlap",),
    "all plugins": SECTIONS,
}


def ds_config(plugins: tuple[str, ...]) -> dict:
    config = {
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 100000},
        "optimizer": {"type": "Adam", "params": {"torch_adam": True, "betas": [0.9, 0.95]}},
    }
    for section in SECTIONS:
        config[section] = {"enabled": section in plugins}
    return config


def launch(work: Path, plugins: tuple[str, ...], iters: int, tag: str) -> list[dict]:
    config = work / f"ds-{tag}.json"
    config.write_text(json.dumps(ds_config(plugins)))
    log = work / f"{tag}.jsonl"
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "pretrain_gpt.py"),
        *MODEL,
        "--train-iters",
        str(iters),
        "--deepspeed-config",
        str(config),
        "--data-cache-path",
        str(work / "data"),
        "--log-json",
        str(log),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"error: the main job failed ({tag}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in log.read_text().splitlines()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu")
    p.add_argument("--iters", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5, help="iterations left out of the tokens/s figures")
    p.add_argument("--launches", type=int, default=2)
    p.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        choices=list(CONFIGS),
        metavar="CONFIG",
        help=f"which of: {', '.join(CONFIGS)}",
    )
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="main-job-gpu-"))
    runs = []
    for i in range(args.launches):
        for name in args.configs:
            records = launch(work, CONFIGS[name], args.iters, f"{name.replace(' ', '_')}-{i}")
            rate = [r["tokens_per_s"] for r in records[args.warmup :]]
            runs.append(
                {
                    "config": name,
                    "launch": i,
                    "losses": [r["loss"] for r in records],
                    "tokens_per_s": [min(rate), statistics.median(rate), max(rate)],
                }
            )
            print(json.dumps(runs[-1]), flush=True)
    equal = all(r["losses"] == runs[0]["losses"] for r in runs)
    meta = {
        "command": "python -m benchmarks.gpu.main_job " + " ".join(sys.argv[1:]),
        "model": " ".join(MODEL),
        "iters": args.iters,
        "load_avg": os.getloadavg(),
        "losses_identical": equal,
    }
    lines = [
        f"Model: `{meta['model']}`, {args.iters} iterations, TP=1, ZeRO-3; tokens/s over iterations "
        f"{args.warmup + 1}-{args.iters}. Losses identical in every launch: {equal}.",
        "",
        "| run | launch | loss it 1 | loss it 10 | loss last | tokens/s min/med/max |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        lo, med, hi = r["tokens_per_s"]
        lines.append(
            f"| {r['config']} | {r['launch']} | {r['losses'][0]:.4f} | {r['losses'][9]:.4f} | {r['losses'][-1]:.4f} | "
            f"{lo:.0f}/{med:.0f}/{hi:.0f} |"
        )
    write_report(args.out, "main_job", {"meta": meta, "runs": runs}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
