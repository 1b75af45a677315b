"""Scale invariance of the device stand-in: the compute-only step at several cluster sizes.

  python -m benchmarks.zero.compute_only --device mi250x [--quick] [--nodes 2 4 8]

Method in full: benchmarks/results/methods.md, `benchmarks.zero.compute_only`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from contextlib import nullcontext
from pathlib import Path

from benchmarks.cluster.spec import dilation_of
from benchmarks.device import add_device_flags, device_flags
from benchmarks.zero.ab import RANK_IMPORTS, REGIMES, job_config
from benchmarks.zero.run import OUT
from mdsp_base.shutdown import exit_without_teardown
from multirank.warm import WarmLauncher

TARGET = 0.05
"""Largest spread of the compute-only step over the sizes: (max - min) / min."""
STEPS, WARMUP = 10, 2


def rank_main(argv: list[str]) -> None:
    """On a rank: the compute-only steps of the A/B's model, on the stand-in the flags ask for."""
    import torch
    import torch.distributed as dist

    from benchmarks.cluster import write_result
    from benchmarks.device import stand_in
    from deepspeed_ext.zero.tools.ab import cli
    from deepspeed_ext.zero.tools.ab.prediction import compute_steps

    parser = argparse.ArgumentParser()
    add_device_flags(parser)
    device, rest = parser.parse_known_args(argv)
    args = cli.parse_args(rest)
    user = json.loads(Path(args.deepspeed_config).read_text())
    dist.init_process_group("gloo")
    seconds = compute_steps(cli.model_shape(args), user, STEPS, WARMUP, torch.device("cpu"), stand_in(device))
    dist.destroy_process_group()
    write_result(seconds)
    sys.stdout.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--regime", choices=sorted(REGIMES), default="frontier")
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8], help="cluster sizes, in nodes")
    parser.add_argument("--quick", action="store_true", help="the A/B's quick model and micro-batch")
    parser.add_argument("--warm", action="store_true", help="fork the ranks after their imports")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    parser.add_argument("--out", default=str(OUT), help="where the results go")
    add_device_flags(parser, dilation=None)
    args = parser.parse_args(argv)
    if args.device == "host":
        parser.error(
            "--device host computes on the shared cores, which is what this checks the stand-in avoids"
        )
    from benchmarks.cluster import EmulatedCluster

    regime, out = REGIMES[args.regime], Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"compute_only_{args.device}" + ("_quick" if args.quick else "")
    sizes: list[dict] = []
    launcher = WarmLauncher(dict(os.environ), preload=RANK_IMPORTS) if args.warm else nullcontext()
    with launcher as warm:
        for nodes in args.nodes:
            spec = regime.spec(nodes, 2)
            if args.dilation is None:  # the links are Frontier's divided by it (the same NIC at every size)
                args.dilation = dilation_of(spec)
            config = out / f"{name}_{nodes}_ds_config.json"
            config.write_text(json.dumps(job_config(regime, spec, args.quick, args.device)) + "\n")
            flags = ["--deepspeed-config", str(config), *(["--quick"] if args.quick else regime.model)]
            with EmulatedCluster(spec, prefix="emco", warm=warm) as cluster:
                argv_rank = ["-m", "benchmarks.zero.compute_only", "--rank", *flags, *device_flags(args)]
                seconds = cluster.launch(argv_rank, timeout=args.timeout)[0]
            sizes.append(
                {
                    "nodes": nodes,
                    "ranks": spec.world_size,
                    "step_s": seconds,
                    "median_s": statistics.median(seconds),
                }
            )
            print(f"{spec.world_size} ranks: compute-only step {sizes[-1]['median_s']:.3f} s", flush=True)
    medians = [s["median_s"] for s in sizes]
    spread = (max(medians) - min(medians)) / min(medians)
    command = f"python -m benchmarks.zero.compute_only --device {args.device} --nodes {' '.join(map(str, args.nodes))}"
    result = {
        "command": command + (" --quick" if args.quick else ""),
        "device": args.device,
        "dilation": args.dilation,
        "sizes": sizes,
        "spread": spread,
        "target": TARGET,
        "loadavg": os.getloadavg(),
    }
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"Command: `{result['command']}` (measured; {STEPS} steps after {WARMUP}, slowest rank per step).",
        "",
    ]
    lines += ["| ranks | compute-only step s, median (min-max) |", "|---|---|"]
    lines += [
        f"| {s['ranks']} | {s['median_s']:.3f} ({min(s['step_s']):.3f}-{max(s['step_s']):.3f}) |"
        for s in sizes
    ]
    verdict = "met" if spread <= TARGET else "missed"
    lines += ["", f"Spread of the medians: {spread:.1%} (target <= {TARGET:.0%}: {verdict})."]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(sys.argv[2:])
    else:
        main()
    exit_without_teardown()
