"""The cost model's host term against a real step: 4 ranks on this host, as two torchrun agents of 2.

  python -m benchmarks.zero.loopback [--steps 10] [--out benchmarks/results]

What a user runs on two nodes, on one host: the probe, then ``deepspeed_ext.zero.bench --quick``
with the probe's profile, and one traced step per variant. The bench's rows carry the cost model's
prediction (compute, the engine's host cost the probe measured, communication) beside the measured
steps; the validation table
(``benchmarks.device.validation``) compares them. The ranks compute on the host's cores, so other
work on the host stretches the probe's timings and the steps alike: the bench records the load,
and the command refuses to start above ``--max-load``.

Method in full: benchmarks/results/methods.md, `benchmarks.device.validation`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from multirank.processes import REPO_ROOT, RankError, free_port, kill_all, wait_all

RESULTS = Path(__file__).resolve().parents[1] / "results"
NODES, PER_NODE = 2, 2
TOPOLOGY = {"topology": {"ranks_per_node": PER_NODE, "ranks_per_package": 1}}
PROBE = ["-m", "deepspeed_ext.zero.probe", "--largest", str(2**20), "--repeats", "7"]


def agents(module_argv: list[str], port: int) -> list[list[str]]:
    """One torchrun agent per emulated node, all on 127.0.0.1, each running ``module_argv``."""
    return [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--node-rank", str(node)]
        + ["--nproc-per-node", str(PER_NODE), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        + module_argv
        for node in range(NODES)
    ]


def run_agents(module_argv: list[str], timeout: float) -> None:
    """Run both agents to completion; on a failure or past ``timeout`` both are killed and the
    error names the command."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(argv, cwd=REPO_ROOT, env=env, start_new_session=True)
        for argv in agents(module_argv, free_port())
    ]
    try:
        wait_all(procs, timeout)
    except (RankError, TimeoutError) as e:
        raise type(e)(
            f"`{' '.join(module_argv)}` (agents, one per node): {e}; raise --timeout if only slow"
        ) from e
    finally:
        kill_all(procs)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (paired)")
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="results folder (writes zero/bench_quick_loopback*)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch, a hang bound")
    parser.add_argument(
        "--max-load",
        type=float,
        default=3.0,
        help="refuse to start above this 1-minute load average: the ranks compute on the host",
    )
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    if load > args.max_load:
        raise SystemExit(
            f"load average {load:.1f} > --max-load {args.max_load:g}: other work would stretch the probe and "
            "the steps; wait for it, or raise --max-load and read the load on the result"
        )
    out = args.out / "zero"
    out.mkdir(parents=True, exist_ok=True)
    config, profile, result = (
        out / f"bench_quick_loopback{s}" for s in ("_ds_config.json", "_profile.json", ".json")
    )
    config.write_text(json.dumps(TOPOLOGY, indent=1) + "\n")
    run_agents([*PROBE, "--deepspeed-config", str(config), "--out", str(profile)], args.timeout)
    bench = [
        "-m",
        "deepspeed_ext.zero.bench",
        "--quick",
        "--steps",
        str(args.steps),
        "--deepspeed-config",
        str(config),
    ]
    trace = out / "bench_quick_loopback_trace"  # one more step per variant, after the timed ones
    run_agents(
        [*bench, "--profile", str(profile), "--json", str(result), "--trace", str(trace)], args.timeout
    )
    for row in json.loads(result.read_text()):
        if row["ran"]:
            print(
                f"{row['variant']}: predicted {row['predicted_step_s']:.3f} s {row['predicted']}, "
                f"measured median {statistics.median(row['step_s']):.3f} s"
            )
    return result


if __name__ == "__main__":
    main()
