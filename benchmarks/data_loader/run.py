"""Data-loader benchmark: 8 ranks on one node, three loading schemes side by side in one run.

    .venv/bin/python -m benchmarks.data_loader.run [--tp 2 8] [--steps 200] [--tokens 48000000]

For each TP size and scheme it drops the dataset's pages from the page cache
(``posix_fadvise(DONTNEED)``), launches 8 fresh rank processes (``benchmarks.data_loader.rank``)
and reports, per node: bytes of the ``.bin`` the samples span (what the loaders asked for), bytes
the kernel read from the block device (``read_bytes`` of every rank and every process they
reaped) and ``rchar``; per-rank batch latency p50/p99 (the first batches, which include start-up,
left out); CPU seconds of all processes; peak RSS. Writes ``benchmarks/results/data_loader/``
``results.json`` and ``results.md``. The corpus (random tokens, built once) lives under
``benchmarks/results/raw/``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.data_loader.rank import SCHEMES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAW = os.path.join(ROOT, "benchmarks", "results", "raw", "data_loader")
OUT = os.path.join(ROOT, "benchmarks", "results", "data_loader")
WORLD = 8
WARMUP = 5


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


def launch(scheme: str, tp: int, prefix: str, extra: list[str], timeout_s: float) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="dl-bench-") as tmp:
        procs = []
        for rank in range(WORLD):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            cmd = [sys.executable, "-m", "benchmarks.data_loader.rank", "--scheme", scheme, "--tp", str(tp),
                   "--prefix", prefix, "--cache", os.path.join(RAW, "cache"),
                   "--rendezvous", os.path.join(tmp, "rdv"), *extra]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
        outputs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{scheme} TP={tp}: ranks exited with {[p.returncode for p in procs]}")
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


def summarise(ranks: list[dict]) -> dict:
    lat = [np.array(r["latencies_s"][WARMUP:]) * 1e3 for r in ranks]
    return {
        "logical_bytes_per_node": sum(r["counters"]["bytes_read"] for r in ranks),
        "kernel_read_bytes_per_node": sum(r["read_bytes"] for r in ranks),
        "rchar_per_node": sum(r["rchar"] for r in ranks),
        "p50_ms_median_rank": float(np.median([np.percentile(x, 50) for x in lat])),
        "p99_ms_worst_rank": float(max(np.percentile(x, 99) for x in lat)),
        "p99_ms_per_rank": [round(float(np.percentile(x, 99)), 3) for x in lat],
        "wait_s_per_rank": [round(r["counters"]["wait_s"], 3) for r in ranks],
        "cpu_s_all_processes": sum(r["cpu_s"] for r in ranks),
        "peak_rss_mb_rank": max(r["max_rss_kb"] for r in ranks) / 1024,
        "peak_rss_mb_child": max(r["children_max_rss_kb"] for r in ranks) / 1024,
        "setup_s_max": max(r["setup_s"] for r in ranks),
    }


def table(results: list[dict]) -> str:
    mb = 1 << 20
    lines = ["| TP | scheme | asked MiB/node | kernel read MiB/node | rchar MiB | p50 ms | p99 ms (worst rank) "
             "| CPU s (all) | peak RSS MiB rank / child |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["summary"]
        lines.append(
            f"| {r['tp']} | {r['scheme']} | {s['logical_bytes_per_node'] / mb:.1f} | "
            f"{s['kernel_read_bytes_per_node'] / mb:.1f} | {s['rchar_per_node'] / mb:.1f} | "
            f"{s['p50_ms_median_rank']:.3f} | {s['p99_ms_worst_rank']:.3f} | {s['cpu_s_all_processes']:.1f} | "
            f"{s['peak_rss_mb_rank']:.0f} / {s['peak_rss_mb_child']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--tokens", type=int, default=48_000_000, help="corpus size (2 bytes each)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--step-ms", type=float, default=20.0, help="sleep standing in for a training step")
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader workers of the stock schemes")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--timeout-s", type=float, default=1200)
    args = parser.parse_args()

    prefix = os.path.join(RAW, f"random{args.tokens}")
    make_corpus(prefix, args.tokens)
    extra = ["--steps", str(args.steps), "--mbs", str(args.mbs), "--seq-length", str(args.seq_length),
             "--step-ms", str(args.step_ms), "--num-workers", str(args.num_workers), "--slots", str(args.slots)]
    results = []
    for tp in args.tp:
        for scheme in SCHEMES:
            drop_cache(prefix)
            start = time.time()
            ranks = launch(scheme, tp, prefix, extra, args.timeout_s)
            results.append({"tp": tp, "scheme": scheme, "wall_s": time.time() - start, "summary": summarise(ranks)})
            print(table(results[-1:]).splitlines()[-1], flush=True)
    os.makedirs(OUT, exist_ok=True)
    meta = {"world": WORLD, "corpus_bytes": os.path.getsize(prefix + ".bin"), "load_average": os.getloadavg(),
            "cpus": os.cpu_count(), **vars(args)}
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump({"settings": meta, "results": results}, f, indent=1)
    with open(os.path.join(OUT, "results.md"), "w") as f:
        f.write(f"Settings: {json.dumps(meta)}\n\n{table(results)}\n")
    print(table(results))


if __name__ == "__main__":
    main()
