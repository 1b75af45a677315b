"""Node benchmark: the node loader where its gain shows (8 ranks of one node), against Megatron's path.

    .venv/bin/python -m benchmarks.data_loader.node [--repeats 3] [--steps 20] [--quick]

Every rank is a fresh process (``benchmarks.data_loader.node_rank``, gloo over a file rendezvous)
reading a synthetic corpus of random byte tokens (``run.make_corpus``) through megatron-core's
GPTDataset. The corpus is dropped from the page cache before each loader starts (``--warm-cache``
keeps it) and is large enough (``--tokens``) that no run reads a sample twice. All parts run in one
invocation; figures are min / median / max over ``--repeats`` repetitions, with the load average
(``os.getloadavg``) before and after each launch.

(A) Producer throughput against demand. 8 ranks, TP=1 x DP=8: the producer fills 8 streams of
    mbs x seq tokens per step. Ranks do no compute, calling ``next()`` back to back, so the producer
    sets the pace unless copying out does. Measured: steps the producer published per second of
    wall clock over ``--throughput-steps`` steps after ``--warmup`` (the samples it reports over
    8 x mbs), the ranks' own steps per second, and the CPU time of the producer's process tree:
    utime + stime + cutime + cstime of the producer and of each live descendant (its workers) from
    ``/proc/<pid>/stat``, read by the node's first rank (the producer's parent) at both ends of the
    window (``node_proc``); as a cross-check, that rank's getrusage(RUSAGE_CHILDREN) over the
    loader's whole life, start-up and warm-up included (it reaps the producer, which reaps its
    workers). Computed: throughput over ``--demand`` steps/s (target >= 3), and the window's
    producer CPU time per published step and per second (cores kept busy). One launch runs every
    repetition and worker count (``--workers``), each with a fresh loader and producer, in an order
    rotated per repetition.
(B) Data-path CPU and memory per node, TP=8 x DP=1 (one TP group of 8). Megatron's path: this
    project's stock path (TP rank 0 iterates a DataLoader with ``--num-workers`` workers, then
    broadcasts each key over the TP group) plus, on the 7 other TP ranks, a DataLoader iterator with
    as many workers that is started but never read: upstream Megatron-LM builds the dataset and the
    loaders on every rank (the GPT provider is ``is_distributed``) and starts their workers, but
    uses only TP rank 0's batches. Ours: the node loader (one producer of ``--node-workers``
    processes). Ranks compute nothing: each step is ``next()`` then a fixed sleep, so the CPU time
    of the ranks and their descendants is the data path's plus the ranks' own, which a third launch
    of ranks that only sleep (no loader) measures. Measured, summed over the 8 rank trees: CPU
    seconds per step over the steady-state window (``/proc`` as in A); CPU seconds over the
    loader's whole life (getrusage of each rank and its reaped children, start-up and shut-down
    included); RSS and PSS (``/proc/<pid>/smaps_rollup``) at the end of the window, in total and
    above the same trees just before the loader was built (each rank has imported torch and built
    its dataset by then, on every path). Computed: ours over Megatron's (target <= 0.5), as
    measured and, for CPU, less the sleeping ranks' figure on both sides. PSS splits a shared
    library's pages between all processes mapping it, unrelated ones included, so PSS totals move
    with whatever else runs; the "added" columns compare each launch with itself.
(C) Step time, from the same runs as B: the sleep (``--step-ms``) stands in for compute done off
    the loader's cores. Measured: median step time, and median data wait per rank.
(D) Peak memory of ``next()`` on one rank, node loader, mbs x seq with create_attention_mask and
    reset_attention_mask. Measured: the rise of the process's VmHWM above its VmRSS just before the
    call (VmHWM reset through ``/proc/self/clear_refs``). It counts every page the call touches,
    torch's and numpy's alike, once warm-up has mapped every ring slot; glibc's mmap threshold is
    fixed at 64 KiB for that rank, so a block is mapped when allocated and unmapped when freed
    rather than reusing freed heap pages, which VmHWM would not see. On separate calls, the peak of
    torch's CPU allocator (``benchmarks.allocations``; torch tensors only). Computed: over the
    mask's own size, mbs x seq x seq bytes (target <= 1.1).

Caveats: on a 2-core machine the ranks, the producer and its workers (or the 2 x 8 DataLoader
workers) all share those cores: more producer workers add parallel reads and copies but no cores,
and A's ranks poll on the same cores. Megatron's path here has upstream's train loader only
(upstream also starts valid and test loaders with workers on every rank) and no attention mask
(Megatron's default builds one per sample in the dataset, a far larger cost). Per-process CPU time
is read in clock ticks (10 ms). With a ``shm_data_loader`` section that has no ``workers`` field,
A runs the 1-worker case only and says why the others are missing. Rank logs:
``benchmarks/results/raw/data_loader/node-*.log``; results: ``benchmarks/results/data_loader/
node.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

from benchmarks.data_loader import node_report
from benchmarks.data_loader.node_rank import DEFAULT_WORKERS
from benchmarks.data_loader.run import OUT, QUIET, RAW, ROOT, make_corpus
from multirank import rank_env

FULL = dict(repeats=3, steps=20, throughput_steps=200, warmup=5, seq_length=8192, step_ms=200.0, mask_calls=3)
QUICK = dict(repeats=1, steps=6, throughput_steps=40, warmup=4, seq_length=2048, step_ms=100.0, mask_calls=2)
PARTS = ("throughput", "footprint", "mask")
MMAP_THRESHOLD = 64 * 1024  # glibc's, fixed for part D's rank


def launch(
    world: int,
    mode: str,
    options: list[str],
    args: argparse.Namespace,
    tag: str,
    env_extra: dict | None = None,
) -> dict:
    """``world`` rank processes of ``mode``; their results and the load average around them."""
    load_before, started = os.getloadavg()[0], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="node-bench-") as tmp:
        procs, logs = [], []
        for rank in range(world):
            env = rank_env(rank, world, **QUIET, **(env_extra or {}))
            common = {
                "--mode": mode,
                "--prefix": args.prefix,
                "--cache": os.path.join(RAW, "cache"),
                "--rendezvous": os.path.join(tmp, "rdv"),
                "--out": os.path.join(tmp, f"rank{rank}.json"),
                "--job": f"node{os.getpid()}{tag}",
                "--mbs": args.mbs,
                "--seq-length": args.seq_length,
                "--warmup": args.warmup,
                "--slots": args.slots,
            }
            cmd = [sys.executable, "-m", "benchmarks.data_loader.node_rank"]
            cmd += [str(x) for kv in common.items() for x in kv] + options + (["--cold"] if args.cold else [])
            logs.append(open(os.path.join(RAW, f"node-{tag}-rank{rank}.log"), "w"))  # noqa: SIM115
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
        deadline = time.monotonic() + args.timeout_s
        ended = {}
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
                ended[p.pid] = time.time()
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.wait()
            raise RuntimeError(f"{tag}: ranks still running after {args.timeout_s:.0f} s") from None
        finally:
            for log in logs:
                log.close()
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RuntimeError(f"{tag}: ranks exited with {codes}; see {RAW}/node-{tag}-rank*.log")
        ranks = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    wall = time.monotonic() - started
    print(f"{tag}: {world} ranks, {wall:.1f} s", flush=True)
    t0 = time.time() - wall  # phases per rank, seconds from the launch (the exit as the launcher saw it)
    for rank, p in zip(ranks, procs):
        rank["times"] = {k: round(v - t0, 1) for k, v in {**rank["times"], "exited": ended[p.pid]}.items()}
    return {"ranks": ranks, "load_average": [load_before, os.getloadavg()[0]], "wall_s": wall}


def run_throughput(args: argparse.Namespace) -> dict:
    options = ["--tp", "1", "--steps", str(args.throughput_steps), "--repeats", str(args.repeats)]
    options += ["--workers", *map(str, args.workers)]
    out = launch(args.ranks, "throughput", options, args, "throughput")
    return node_report.throughput_rows(out, args)


def run_footprint(args: argparse.Namespace) -> dict:
    schemes = ["megatron", "shm", "none"]
    rows = {scheme: {"runs": [], "load_average": []} for scheme in schemes}
    for rep in range(args.repeats):
        shift = rep % len(schemes)
        for scheme in schemes[shift:] + schemes[:shift]:  # order rotated per repetition
            options = ["--tp", str(args.ranks), "--steps", str(args.steps), "--scheme", scheme]
            options += ["--step-ms", str(args.step_ms), "--num-workers", str(args.num_workers)]
            options += ["--node-workers", str(args.node_workers)]
            out = launch(args.ranks, "footprint", options, args, f"footprint-{scheme}")
            rows[scheme]["runs"].append(node_report.footprint_run(out))
            rows[scheme]["load_average"].append(out["load_average"])
            print(
                f"footprint rep {rep} {scheme}: {json.dumps(rows[scheme]['runs'][-1]['summary'])}", flush=True
            )
    return rows


def run_mask(args: argparse.Namespace) -> dict:
    options = ["--steps", "1", "--mask-calls", str(args.mask_calls), "--node-workers", str(args.node_workers)]
    # Every block of 64 KiB or more mapped when allocated and unmapped when freed: else glibc's
    # dynamic threshold (up to 32 MiB) serves a block from freed heap pages, unseen by VmHWM.
    out = launch(1, "mask", options, args, "mask", {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)})
    return {**out["ranks"][0]["result"], "load_average": out["load_average"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 repetition, few steps, seq 2048")
    for name in ("--repeats", "--steps", "--throughput-steps", "--warmup", "--seq-length", "--mask-calls"):
        p.add_argument(name, type=int, default=None)
    p.add_argument(
        "--step-ms", type=float, default=None, help="sleep per step standing in for compute (B, C)"
    )
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="producer workers (A)")
    p.add_argument(
        "--node-workers",
        type=int,
        default=DEFAULT_WORKERS,
        help="producer workers (B, C, D): the config's default",
    )
    p.add_argument("--num-workers", type=int, default=2, help="Megatron's DataLoader workers (B, C)")
    p.add_argument("--demand", type=float, default=1.0, help="steps/s the training step asks for (A)")
    p.add_argument("--tokens", type=int, default=64_000_000, help="corpus size (2 bytes each)")
    p.add_argument(
        "--warm-cache", dest="cold", action="store_false", help="keep the corpus in the page cache"
    )
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="results hold these only")
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--out", default=OUT, help="folder of node.json / node.md")
    args = p.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.prefix = os.path.join(RAW, f"random{args.tokens}")
    os.makedirs(RAW, exist_ok=True)
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex")  # megatron-core's import
    make_corpus(args.prefix, args.tokens)
    steps = args.warmup + max(args.throughput_steps, args.steps) + args.slots + 8  # + the producer's lead
    needed = steps * args.ranks * args.mbs * (args.seq_length + 1)
    if needed > args.tokens:
        print(f"--tokens {args.tokens}: A re-reads samples (cached); {needed} avoids it", file=sys.stderr)

    started = time.time()
    results: dict = {"errors": {}}
    for part, fn in (("throughput", run_throughput), ("footprint", run_footprint), ("mask", run_mask)):
        if part in args.parts:
            try:
                results[part] = fn(args)
            except Exception as e:  # a part that fails is reported; the others still run
                results["errors"][part] = f"{type(e).__name__}: {e}"
                print(f"{part} failed: {e}", file=sys.stderr, flush=True)
    settings = {
        **{k: v for k, v in vars(args).items() if k not in ("prefix", "out")},
        "corpus_bytes": os.path.getsize(args.prefix + ".bin"),
        "cpus": len(os.sched_getaffinity(0)),
        "wall_s": round(time.time() - started, 1),
        "command": " ".join(["python -m benchmarks.data_loader.node", *sys.argv[1:]]),
    }
    results["settings"] = settings
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "node.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = node_report.markdown(results, args)
    with open(os.path.join(args.out, "node.md"), "w") as f:
        f.write(text)
    print(text)
    sys.exit(1 if results["errors"] else 0)


if __name__ == "__main__":
    main()
