"""Megatron-DeepSpeed's transformer layer at TP=2 with and without ``--flash-overlap``, as its users
run it: the patched tree's ``pretrain_gpt.py`` (one layer, ``--sequence-parallel``, DeepSpeed ZeRO-1)
on two ranks of one emulated package whose links are shaped to ``--mbit``.

    python -m benchmarks.studies.flash_overlap.mds_layer --tree PATH/TO/Megatron-DeepSpeed --data-path PREFIX

Method in full: benchmarks/results/methods.md, `benchmarks.studies.flash_overlap.mds_layer`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from mdsp_base.shutdown import exit_without_teardown
from multirank import launch_ranks

REPO_ROOT = Path(__file__).resolve().parents[3]
RANK = ["-m", "benchmarks.studies.flash_overlap.mds_rank"]
# method: (the rank's options, the upstream flags it adds)
METHODS = {
    "stock": ([], []),
    "stock_on_p2p": (["--on-p2p"], []),
    "flash_overlap": ([], ["--flash-overlap"]),
}
TP = 2


def _flags(args: argparse.Namespace, tp: int, work: Path) -> list[str]:
    """The upstream flags of one launch: TP=2 with sequence parallelism, or the TP=1 twin."""
    heads, ffn = args.heads // (TP // tp), args.ffn // (TP // tp)
    config = work / "ds_config.json"
    config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": args.batch,
                "train_batch_size": args.batch,
                "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": 1},
                "steps_per_print": 100000,
            }
        )
    )
    size = {
        "--num-layers": 1, "--hidden-size": args.hidden, "--num-attention-heads": heads,
        "--kv-channels": args.hidden // args.heads, "--ffn-hidden-size": ffn, "--seq-length": args.seq,
        "--max-position-embeddings": args.seq, "--micro-batch-size": args.batch,
        "--global-batch-size": args.batch, "--train-iters": args.warmup + args.iters,
        "--tensor-model-parallel-size": tp, "--vocab-size": 256, "--lr": 1e-4, "--log-interval": 1,
        "--eval-iters": 0, "--eval-interval": 10**6, "--num-workers": 0, "--hidden-dropout": 0,
        "--attention-dropout": 0, "--zero-stage": 1,
    }  # fmt: skip
    flags = [str(part) for item in size.items() for part in item]
    flags += ["--tokenizer-type", "NullTokenizer", "--split", "100,0,0", "--no-gradient-accumulation-fusion"]
    flags += ["--use-rotary-position-embeddings", "--deepspeed", "--no-pipeline-parallel"]
    flags += ["--deepspeed_config", str(config), "--data-path", args.data_path]
    flags += ["--data-cache-path", str(work / "index")]
    return flags + (["--sequence-parallel"] if tp > 1 else [])


def launch_step_ms(per_rank: list[dict], warmup: int) -> float:
    """A launch's step: the median of the last rank's iterations after the warm-up."""
    times = [ms for it, ms in per_rank[-1]["iteration_ms"] if it > warmup]
    if not times:
        raise RuntimeError(f"the last rank printed no iteration after {warmup}: {per_rank[-1]}")
    return statistics.median(times)


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def measure(args: argparse.Namespace) -> dict:
    """Every repetition's step per method and the twin's, and the exposed times."""
    from benchmarks.cluster import ClusterSpec, EmulatedCluster

    script = str(args.tree / "pretrain_gpt.py")
    work = Path(tempfile.mkdtemp(prefix="mds-layer-"))  # the DeepSpeed JSON and the dataset's index maps
    steps: dict[str, list[float]] = {name: [] for name in (*METHODS, "compute_only")}
    load = [os.getloadavg()[0]]
    spec = ClusterSpec(1, 1, TP, args.mbit, args.mbit, args.mbit, name=f"mds-layer-tp{TP}")
    env = {"DS_ACCELERATOR": "cpu"}
    try:
        with EmulatedCluster(spec, prefix="emmds") as cluster:
            for rep in range(args.repeats):
                for name, (options, extra) in METHODS.items():
                    argv = [*RANK, *options, script, *_flags(args, TP, work), *extra]
                    steps[name].append(
                        launch_step_ms(cluster.launch(argv, timeout=args.timeout, env=env), args.warmup)
                    )
                twin = launch_ranks(
                    [*RANK, script, *_flags(args, 1, work)], world_size=1, timeout=args.timeout, env=env
                )
                steps["compute_only"].append(launch_step_ms(twin, args.warmup))
                print(
                    f"repetition {rep + 1}: " + ", ".join(f"{k} {v[-1]:.1f} ms" for k, v in steps.items()),
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load.append(os.getloadavg()[0])
    exposed = {name: [s - c for s, c in zip(steps[name], steps["compute_only"])] for name in METHODS}
    return {
        "args": {k: v for k, v in vars(args).items() if not isinstance(v, Path) and k != "data_path"},
        "load_average": load,
        "step_ms": steps,
        "exposed_ms": exposed,
    }


def report(result: dict) -> str:
    """The markdown table: step and exposed time per method, the ratio where the ranges part."""
    a = result["args"]
    lines = [
        f"Megatron-DeepSpeed, TP=2 x 1 layer (hidden {a['hidden']}, heads {a['heads']}, ffn {a['ffn']}, "
        f"seq {a['seq']}, micro-batch {a['batch']}), emulated package at {a['mbit']:g} Mbit/s; "
        f"{a['repeats']} launches per method, each the median of {a['iters']} iterations after {a['warmup']}; "
        f"load average {result['load_average'][0]:.1f} before, {result['load_average'][1]:.1f} after. "
        "Measured. ms, median (min-max) over launches.",
        "",
        "| method | step | exposed = step - compute-only twin |",
        "|---|---:|---:|",
    ]
    for name in (*METHODS, "compute_only"):
        s = _spread(result["step_ms"][name])
        cell = f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"
        e = result["exposed_ms"].get(name)
        ex = "" if e is None else "{median:.1f} ({min:.1f}-{max:.1f})".format(**_spread(e))
        lines.append(f"| {name} | {cell} | {ex} |")
    lines.append("")
    for what, key in (("step", "step_ms"), ("exposed time", "exposed_ms")):
        ours = _spread(result[key]["flash_overlap"])
        for baseline in ("stock", "stock_on_p2p"):
            other = _spread(result[key][baseline])
            separated = ours["max"] < other["min"] or other["max"] < ours["min"]
            verdict = f"{ours['median'] / other['median']:.2f}x" if separated else "not separated"
            lines.append(f"Flash-Overlap's {what} against {baseline}'s: {verdict}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", type=Path, required=True, help="Megatron-DeepSpeed checkout with the patch")
    parser.add_argument("--data-path", required=True, help="a dataset prefix the tree reads (--data-path)")
    parser.add_argument("--mbit", type=float, default=400.0, help="link rate between the two ranks")
    parser.add_argument("--repeats", type=int, default=5, help="launches per method (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=8, help="timed iterations per launch")
    parser.add_argument("--warmup", type=int, default=2, help="iterations left out per launch")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12, help="attention heads (even)")
    parser.add_argument("--ffn", type=int, default=3072, help="MLP width (even)")
    parser.add_argument("--seq", type=int, default=384, help="sequence length (even)")
    parser.add_argument(
        "--batch", type=int, default=1, help="micro-batch size (the tree's CoreAttention takes 1 only)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "flash_overlap")
    args = parser.parse_args(argv)
    if not (args.tree / "pretrain_gpt.py").is_file():
        parser.error(f"--tree {args.tree}: no pretrain_gpt.py there; pass the Megatron-DeepSpeed checkout")
    for name in ("heads", "ffn", "seq"):
        if getattr(args, name) % TP:
            parser.error(f"--{name} {getattr(args, name)} must be a multiple of TP={TP}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = measure(args)
    table = report(result)
    print(table)
    (args.out / "mds_layer_tp2.json").write_text(json.dumps(result, indent=1))
    (args.out / "mds_layer_tp2.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
    exit_without_teardown()
