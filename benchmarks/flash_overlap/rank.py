"""One rank of the Flash-Overlap benchmark: tune the MLP width to each regime, then time every schedule.

Started by ``benchmarks.flash_overlap.run`` (loopback) or by the emulated cluster's launcher, with
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set; the rank's result goes through ``write_result``.

Regimes (c: compute of one sequence slice of one GEMM, p: transfer of one slice between two ranks,
both measured here before the run; the width ffn sets c):
  hideable: c = 2p, communication can be hidden entirely (p <= c);
  balanced: T_comp = T_comm per GEMM, i.e. N*c = (N-1)*p.
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings

import torch
import torch.distributed as dist

from benchmarks.cluster import write_result
from benchmarks.flash_overlap.schedules import METHODS, MLP, Recorder, Schedule, comm_only, compute_only

REGIMES = ("hideable", "balanced")
_PROBE_COLUMNS = 256


def _steps(
    mlp: MLP, x: torch.Tensor, fns: dict[str, Schedule], warmup: int, steps: int
) -> dict[str, list[dict]]:
    """Run every schedule warmup + steps times, interleaved step by step (load drifts on a shared
    host hit all alike), each run after a barrier; keep the timed steps' records."""
    out: dict[str, list[dict]] = {name: [] for name in fns}
    for i in range(warmup + steps):
        for name, fn in fns.items():
            gc.collect()  # a collection inside a step would pause it by milliseconds: never during one
            gc.disable()
            dist.barrier()
            rec = Recorder()
            fn(mlp, x, rec)
            step = time.perf_counter() - rec.t0
            gc.enable()
            if i >= warmup:
                out[name].append(
                    {
                        "step": step,
                        "compute": rec.total("compute"),
                        "wait": rec.total("wait"),
                        "events": [(k, label, round(a, 6), round(b, 6)) for k, label, a, b in rec.events],
                    }
                )
    return out


def _tune_ffn(
    regime: str, hidden: int, x: torch.Tensor, group: dist.ProcessGroup, warmup: int
) -> tuple[int, dict]:
    """Pick ffn so that the measured slice compute c and slice transfer p match the regime (rank 0 decides)."""
    n = group.size()
    probe = MLP(hidden, _PROBE_COLUMNS * n, group, "direct")
    # Minima, not medians: other work on the host only ever adds time, the minimum is the machine's own speed.
    comm = _steps(probe, x, {"comm_only": comm_only}, warmup, 7)["comm_only"]
    p = min(s["wait"] for s in comm) / (2 * (n - 1))
    w = torch.randn(hidden, _PROBE_COLUMNS)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        x @ w
        times.append(time.perf_counter() - start)
    per_column = min(times) / _PROBE_COLUMNS
    c = 2 * p if regime == "hideable" else (n - 1) * p / n
    decided = torch.tensor([max(1, round(c / per_column)) * n], dtype=torch.int64)
    dist.broadcast(decided, src=0, group=group)
    return int(decided.item()), {"probe_p_s": p, "probe_c_target_s": c, "probe_s_per_column": per_column}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--seq-per-rank", type=int, default=96, help="sequence slice per rank (multiple of 4)"
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--regimes", nargs="+", choices=REGIMES, default=list(REGIMES))
    parser.add_argument("--ffn", type=int, default=None, help="fixed MLP width instead of tuning per regime")
    parser.add_argument(
        "--mode", choices=("direct", "ring"), default="direct", help="P2P pattern of flash_overlap"
    )
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if args.seq_per_rank % 4:
        parser.error(
            f"--seq-per-rank {args.seq_per_rank} must be a multiple of 4 (the chunked baseline cuts it in 4)"
        )

    warnings.filterwarnings("ignore")  # gloo's tensor collectives warn on every call in torch 2.13
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    group = dist.group.WORLD
    torch.manual_seed(0)
    x = torch.randn(args.seq_per_rank, args.batch, args.hidden)
    result: dict = {"world_size": group.size(), "args": vars(args), "regimes": {}}
    for regime in args.regimes:
        ffn, probe = (args.ffn, {}) if args.ffn else _tune_ffn(regime, args.hidden, x, group, args.warmup)
        mlp = MLP(args.hidden, ffn, group, args.mode)
        fns = {"compute_only": compute_only, "comm_only": comm_only, **METHODS}
        runs = _steps(mlp, x, fns, args.warmup, args.steps)
        result["regimes"][regime] = {"ffn": ffn, **probe, "runs": runs}
        if group.rank() == 0:
            print(f"regime {regime}: ffn={ffn} done", flush=True)
    dist.barrier()
    write_result(result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
