"""Node benchmark: the node loader against Megatron's data path as upstream runs it, 8 ranks of one
node, TP = 1, 2, 4, 8 (DP = 8 / TP), cold reads from a slowed filesystem.

    sudo .venv/bin/python -m benchmarks.data_loader.node [--repeats 5] [--steps 30] [--quick]

Method in full: benchmarks/results/methods.md, `benchmarks.data_loader.node`.
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

from benchmarks.data_loader import node_report, node_storage
from benchmarks.data_loader.corpus import OUT, QUIET, RAW, ROOT, drop_cache, make_corpus
from benchmarks.data_loader.node_rank import DEFAULT_WORKERS
from mdsp_base.shutdown import exit_without_teardown
from multirank import rank_env

FULL = dict(repeats=5, steps=30, warmup=5, seq_length=4096, step_ms=100.0, mask_calls=3, tps=[1, 2, 4, 8])
QUICK = dict(repeats=1, steps=8, warmup=3, seq_length=2048, step_ms=100.0, mask_calls=2, tps=[1, 8])
PARTS = ("layouts", "mask")
MMAP_THRESHOLD = 64 * 1024  # glibc's, fixed for the mask part's rank


def launch(
    world: int,
    mode: str,
    options: list[str],
    args: argparse.Namespace,
    tag: str,
    storage: node_storage.Storage,
    env_extra: dict | None = None,
) -> dict:
    """``world`` rank processes of ``mode``; their results, the load average and the device reads
    around them."""
    if args.cold:
        drop_cache(storage.prefix)
    load_before, started, t0 = list(os.getloadavg()), time.monotonic(), time.time()
    device0 = storage.device_read()
    with tempfile.TemporaryDirectory(prefix="node-bench-") as tmp:
        procs, logs = [], []
        for rank in range(world):
            env = rank_env(rank, world, **QUIET, **(env_extra or {}))
            common = {
                "--mode": mode,
                "--prefix": storage.prefix,
                "--cache": os.path.join(RAW, "cache"),
                "--rendezvous": os.path.join(tmp, "rdv"),
                "--out": os.path.join(tmp, f"rank{rank}.json"),
                "--job": f"node{os.getpid()}{tag}",
                "--mbs": args.mbs,
                "--seq-length": args.seq_length,
                "--warmup": args.warmup,
                "--slots": args.slots,
                "--node-workers": args.node_workers,
            }
            cmd = [sys.executable, "-m", "benchmarks.data_loader.node_rank"]
            cmd += [str(x) for kv in common.items() for x in kv] + options + (["--cold"] if args.cold else [])
            logs.append(open(os.path.join(RAW, f"node-{tag}-rank{rank}.log"), "w"))  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    env=env,
                    stdout=logs[-1],
                    stderr=subprocess.STDOUT,
                    preexec_fn=storage.enter if storage.throttled else None,
                )
            )
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
        for rank, p in zip(range(world), procs):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
            # Phases, seconds from the launch: imports done, set up (gloo, dataset), measured, exited.
            phases = {**ranks[-1]["times"], "exited": ended[p.pid]}
            ranks[-1]["times"] = {k: round(v - t0, 1) for k, v in phases.items()}
    device1 = storage.device_read()
    wall = time.monotonic() - started
    return {
        "ranks": ranks,
        "load_before": load_before,
        "load_after": list(os.getloadavg()),
        "wall_s": wall,
        "device": {k: device1[k] - device0[k] for k in device0},
    }


def revision() -> str:
    """The checkout measured: its commit, and whether tracked files differ from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "-uno"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return "unknown (no git)"
    if head.returncode:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


def order(tps: list[int], rep: int) -> list[tuple[int, str]]:
    """Repetition ``rep``'s launches: layouts rotated, the first path alternating, the baseline moving."""
    shift = rep % len(tps)
    paths = node_report.SCHEMES if rep % 2 == 0 else node_report.SCHEMES[::-1]
    cases = [(tp, scheme) for tp in tps[shift:] + tps[:shift] for scheme in paths]
    cases.insert(rep % (len(cases) + 1), (tps[0], "none"))
    return cases


def log_causes(tag: str, world: int) -> list[str]:
    """The last error line of each rank's log of launch ``tag``."""
    causes: list[str] = []
    for rank in range(world):
        try:
            with open(os.path.join(RAW, f"node-{tag}-rank{rank}.log")) as f:
                lines = [line.strip() for line in f if "Error" in line or "error:" in line]
        except OSError:
            continue
        if lines:
            causes.append(f"rank {rank}: {lines[-1].split(']: ', 1)[-1]}")
    return causes


def run_layouts(args: argparse.Namespace, storage: node_storage.Storage) -> dict:
    launches, failures = [], []
    for rep in range(args.repeats):
        for tp, scheme in order(args.tps, rep):
            options = ["--tp", str(tp), "--steps", str(args.steps), "--scheme", scheme]
            options += ["--step-ms", str(args.step_ms), "--num-workers", str(args.num_workers)]
            tag = f"tp{tp}-{scheme}"
            out = None
            for attempt in range(1 + args.retries):
                try:
                    out = launch(args.ranks, "layout", options, args, tag, storage)
                    break
                except RuntimeError as e:  # recorded and reported; the launch is run again
                    failure = {"repeat": rep, "tp": tp, "scheme": scheme, "attempt": attempt, "error": str(e)}
                    failures.append({**failure, "causes": log_causes(tag, args.ranks)})
                    print(f"rep {rep} TP={tp} {scheme} failed: {e}; {failures[-1]['causes']}", flush=True)
            if out is None:
                continue
            x = {
                "index": len(launches),
                "repeat": rep,
                "tp": tp,
                "scheme": scheme,
                "load_before": out["load_before"],
                "load_after": out["load_after"],
                "launch_s": out["wall_s"],
                "rank_times_s": [r["times"] for r in sorted(out["ranks"], key=lambda r: r["rank"])],
                **node_report.launch_figures(out["ranks"], out["device"], args.ranks),
            }
            launches.append(x)
            f = x["figures"]
            print(
                f"rep {rep} TP={tp} {scheme}: {out['wall_s']:.1f} s, wait {f['wait_ms']:.2f} ms, "
                f"step {f['step_ms']:.1f} ms, CPU {f['cpu_us_per_step']:.0f} us/step, "
                f"{f['processes']} processes, device {f['device_read_mib']:.1f} MiB, "
                f"load {out['load_before'][0]:.2f} -> {out['load_after'][0]:.2f}",
                flush=True,
            )
    rate = node_report.subtract_baseline(launches)
    table = node_report.rows(launches, args.tps)
    return {
        "storage": storage.label,
        "throttled": storage.throttled,
        "read_mib_s": storage.read_bps / 2**20 if storage.throttled else None,
        "readahead_kb": storage.readahead_kb or None,
        "baseline_cpu_us_per_s": rate,
        "rows": table,
        "failures": failures,
        "comparisons": node_report.comparisons(table),
        "targets": node_report.targets(table, args.cold, storage.throttled),
    }


def run_mask(args: argparse.Namespace, storage: node_storage.Storage) -> dict:
    options = ["--steps", "1", "--mask-calls", str(args.mask_calls), "--tp", "1"]
    # Every block of 64 KiB or more mapped when allocated and unmapped when freed: else glibc's
    # dynamic threshold (up to 32 MiB) serves a block from freed heap pages, unseen by VmHWM.
    out = launch(1, "mask", options, args, "mask", storage, {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)})
    return {**out["ranks"][0]["result"], "load_average": [out["load_before"][0], out["load_after"][0]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 launch per row, TP 1 and 8, seq 2048")
    for name in ("--repeats", "--steps", "--warmup", "--seq-length", "--mask-calls"):
        p.add_argument(name, type=int, default=None)
    p.add_argument("--step-ms", type=float, default=None, help="sleep per step standing in for compute")
    p.add_argument("--tps", type=int, nargs="+", default=None, help="TP sizes (DP = ranks / TP)")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument(
        "--node-workers", type=int, default=DEFAULT_WORKERS, help="the node loader's producer workers"
    )
    p.add_argument("--num-workers", type=int, default=2, help="Megatron's DataLoader workers (--num-workers)")
    p.add_argument("--tokens", type=int, default=64_000_000, help="corpus size (2 bytes each)")
    p.add_argument("--throttle-mib-s", type=float, default=16.0, help="read limit of the slowed device")
    p.add_argument("--readahead-kb", type=int, default=node_storage.DEFAULT_READAHEAD_KB)
    p.add_argument("--no-throttle", action="store_true", help="read the corpus where it is, unslowed")
    p.add_argument(
        "--warm-cache", dest="cold", action="store_false", help="keep the corpus in the page cache"
    )
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="results hold these only")
    p.add_argument("--timeout-s", type=float, default=240, help="per launch")
    p.add_argument("--retries", type=int, default=1, help="launches run again after a failure (reported)")
    p.add_argument("--out", default=OUT, help="folder of node.json / node.md")
    args = p.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if any(args.ranks % tp for tp in args.tps):
        p.error(f"--tps {args.tps}: each must divide --ranks {args.ranks}")
    prefix = os.path.join(RAW, f"random{args.tokens}")
    os.makedirs(RAW, exist_ok=True)
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex")  # megatron-core's import
    make_corpus(prefix, args.tokens)
    steps = args.warmup + args.steps + args.slots + 16
    needed = steps * args.ranks * args.mbs * (args.seq_length + 1)
    if needed > args.tokens:
        print(f"--tokens {args.tokens}: a launch re-reads samples; {needed} avoids it", file=sys.stderr)

    if args.no_throttle:
        storage = node_storage.plain(prefix, "--no-throttle")
    else:
        try:
            storage = node_storage.throttled(prefix, RAW, args.throttle_mib_s, args.readahead_kb)
        except node_storage.StorageError as e:
            print(f"no slowed filesystem: {e}; reading the corpus unthrottled", file=sys.stderr, flush=True)
            storage = node_storage.plain(prefix, str(e))
    print(f"storage: {storage.label}", flush=True)
    started = time.time()
    results: dict = {"errors": {}}
    try:
        for part, fn in (("layouts", run_layouts), ("mask", run_mask)):
            if part in args.parts:
                try:
                    results[part] = fn(args, storage)
                except Exception as e:  # a part that fails is reported; the others still run
                    results["errors"][part] = f"{type(e).__name__}: {e}"
                    print(f"{part} failed: {e}", file=sys.stderr, flush=True)
    finally:
        storage.close()
    settings = {
        **{k: v for k, v in vars(args).items() if k != "out"},
        "corpus_bytes": os.path.getsize(prefix + ".bin"),
        "cpus": len(os.sched_getaffinity(0)),
        "wall_s": round(time.time() - started, 1),
        "command": " ".join(["python -m benchmarks.data_loader.node", *sys.argv[1:]]),
        "revision": revision(),
    }
    results["settings"] = settings
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "node.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = node_report.markdown(results)
    with open(os.path.join(args.out, "node.md"), "w") as f:
        f.write(text)
    print(text)
    sys.exit(1 if results["errors"] else 0)


if __name__ == "__main__":
    main()
    exit_without_teardown()
