"""Data-loader benchmark: Megatron's path (DataLoader workers 0, 1, 2) against the node loader.

    .venv/bin/python -m benchmarks.data_loader.run [--repeats 5] [--steps 50] [--cpus 0 1]

Four ranks on one node in two layouts: TP=2 x DP=2, and TP=1 x CP=2 x DP=2. For each repetition
every scheme runs once, in an order rotated per repetition, as 4 fresh rank processes
(``benchmarks.data_loader.rank``) pinned to the same CPUs (``--cpus``; children inherit it), after
the corpus was dropped from the page cache (``posix_fadvise(DONTNEED)``). Measured per run: bytes
the ranks and every process they reaped asked of the filesystem (``rchar``; the ``.bin`` is read
with file reads, not a memory map) and read from the block device (``read_bytes``), CPU seconds of
all of them, the median step time (data wait + a fixed CPU computation standing in for the training
step) and data wait, and peak RSS. Reported as min / median / max over the repetitions, with the
load average before and after. Writes ``results.{json,md}`` under ``--out``
(``benchmarks/results/data_loader``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import numpy as np

from multirank import RankError, launch_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAW = os.path.join(ROOT, "benchmarks", "results", "raw", "data_loader")
OUT = os.path.join(ROOT, "benchmarks", "results", "data_loader")
WORLD = 4
WARMUP = 5
LAYOUTS = ((2, 1), (1, 2))  # (TP, CP); DP = 4 / (TP * CP) = 2
SCHEMES = (("megatron", 0), ("megatron", 1), ("megatron", 2), ("shm", 0))  # (scheme, DataLoader workers)


def make_corpus(prefix: str, tokens: int, seed: int = 0) -> None:
    """Random byte tokens (the ByteTokenizer's vocabulary) in documents of 500-4000 tokens."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if os.path.exists(prefix + ".idx"):
        return
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    written = 0
    while written < tokens:
        doc = rng.integers(0, 256, size=int(rng.integers(500, 4000)), dtype=np.uint16)
        doc[-1] = 256  # end of document
        builder.add_document(doc, [doc.size])
        written += doc.size
    builder.finalize(prefix + ".idx")
    os.sync()  # dirty pages cannot be dropped from the cache


def drop_cache(prefix: str) -> None:
    for path in (prefix + ".bin", prefix + ".idx"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# megatron-core's import warnings, printed once per rank, would bury the progress lines.
QUIET = {"PYTHONWARNINGS": "ignore"}


def launch(
    scheme: str,
    workers: int,
    tp: int,
    cp: int,
    prefix: str,
    extra: list[str],
    cpus: set[int],
    timeout_s: float,
) -> list[dict]:
    """One run of ``scheme``: ``WORLD`` fresh rank processes pinned to ``cpus``; their results by rank."""
    with tempfile.TemporaryDirectory(prefix="dl-bench-") as tmp:
        argv = [
            "-m",
            "benchmarks.data_loader.rank",
            "--scheme",
            scheme,
            "--tp",
            str(tp),
            "--cp",
            str(cp),
            "--num-workers",
            str(workers),
            "--prefix",
            prefix,
            "--cache",
            os.path.join(RAW, "cache"),
            "--rendezvous",
            os.path.join(tmp, "rdv"),
            *extra,
        ]
        try:
            return launch_ranks(argv, WORLD, timeout_s, env=QUIET, cpus=cpus)
        except RankError as e:
            raise RankError(f"{scheme} TP={tp} CP={cp}: {e}") from None


def measure(ranks: list[dict]) -> dict[str, float]:
    """One run's figures for the node (sums) or its median rank (times)."""
    return {
        "rchar_mib": sum(r["rchar"] for r in ranks) / 2**20,
        "read_bytes_mib": sum(r["read_bytes"] for r in ranks) / 2**20,
        "samples_read": sum(r["samples_read"] for r in ranks),
        "cpu_s": sum(r["cpu_s"] for r in ranks),
        "step_ms": statistics.median(statistics.median(r["step_s"][WARMUP:]) for r in ranks) * 1e3,
        "wait_ms": statistics.median(statistics.median(r["wait_s"][WARMUP:]) for r in ranks) * 1e3,
        "wait_p99_ms": max(float(np.percentile(r["wait_s"][WARMUP:], 99)) for r in ranks) * 1e3,
        "rss_mib": (max(r["max_rss_kb"] for r in ranks) + max(r["children_max_rss_kb"] for r in ranks))
        / 1024,
    }


FIGURES = (
    ("rchar_mib", "filesystem MiB (rchar)", 1),
    ("read_bytes_mib", "device MiB (read_bytes)", 1),
    ("cpu_s", "CPU s", 1),
    ("step_ms", "step ms", 1),
    ("wait_ms", "data wait ms", 2),
    ("wait_p99_ms", "wait p99 ms (worst rank)", 1),
    ("rss_mib", "peak RSS MiB rank+child", 0),
)


def spread(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def table(rows: list[dict]) -> str:
    lines = [
        "| TP x CP x DP | scheme | " + " | ".join(name for _, name, _ in FIGURES) + " |",
        "|---" * (len(FIGURES) + 2) + "|",
    ]
    for row in rows:
        runs = row["runs"]
        cells = [spread([r[key] for r in runs], d) for key, _, d in FIGURES]
        lines.append(
            f"| {row['tp']} x {row['cp']} x {WORLD // (row['tp'] * row['cp'])} | {row['label']} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=16_000_000, help="corpus size (2 bytes each)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument(
        "--step-ms", type=float, default=40.0, help="CPU work standing in for a training step"
    )
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--cpus", type=int, nargs="+", default=sorted(os.sched_getaffinity(0)))
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--out", default=OUT, help="folder of results.json / results.md")
    args = parser.parse_args()

    prefix = os.path.join(RAW, f"random{args.tokens}")
    make_corpus(prefix, args.tokens)
    extra = [
        "--steps",
        str(args.steps),
        "--mbs",
        str(args.mbs),
        "--seq-length",
        str(args.seq_length),
        "--step-ms",
        str(args.step_ms),
        "--slots",
        str(args.slots),
    ]
    cpus = set(args.cpus)
    rows = [
        {
            "tp": tp,
            "cp": cp,
            "scheme": scheme,
            "workers": workers,
            "label": f"Megatron, {workers} workers" if scheme == "megatron" else "node loader",
            "runs": [],
            "load_average": [],
        }
        for tp, cp in LAYOUTS
        for scheme, workers in SCHEMES
    ]
    for rep in range(args.repeats):
        for layout in range(len(LAYOUTS)):
            group = rows[layout * len(SCHEMES) : (layout + 1) * len(SCHEMES)]
            for row in group[rep % len(group) :] + group[: rep % len(group)]:  # order rotated per repetition
                drop_cache(prefix)
                before = os.getloadavg()[0]
                ranks = launch(
                    row["scheme"], row["workers"], row["tp"], row["cp"], prefix, extra, cpus, args.timeout_s
                )
                row["runs"].append(measure(ranks))
                row["load_average"].append([before, os.getloadavg()[0]])
                print(f"rep {rep} {table([{**row, 'runs': row['runs'][-1:]}]).splitlines()[-1]}", flush=True)
    loads = [x for row in rows for pair in row["load_average"] for x in pair]
    meta = {
        "world": WORLD,
        "corpus_bytes": os.path.getsize(prefix + ".bin"),
        "cpus": sorted(cpus),
        "load_average_min_max": [min(loads), max(loads)],
        **{k: v for k, v in vars(args).items() if k not in ("cpus", "out")},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"settings": meta, "rows": rows}, f, indent=1)
    text = (
        f"Settings: {json.dumps(meta)}\n\nmedian (min-max) over {args.repeats} repetitions\n\n{table(rows)}\n"
    )
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
