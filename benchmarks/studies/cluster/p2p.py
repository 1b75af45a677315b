"""Rank side of the calibration: timed gloo send/recv between chosen pairs of ranks.

Run by EmulatedCluster.launch(["-m", "benchmarks.studies.cluster.p2p", ...]); every rank takes part in
the barriers, only the two ranks of the current pair move data. Each rank returns the transfers
it sent as {"link", "src", "dst", "seconds", "bytes"} records.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from mdsp_base.shutdown import exit_without_teardown
from multirank.processes import write_result


def timed_send(src: int, dst: int, payload: torch.Tensor, ack: torch.Tensor) -> float | None:
    """Move payload from src to dst; on src return seconds until dst acknowledged it, else None."""
    rank = dist.get_rank()
    if rank == src:
        # gloo pairs a send with an already posted receive: post the ack's irecv first.
        ack_req = dist.irecv(ack, dst)
        start = time.perf_counter()
        dist.isend(payload, dst).wait()
        ack_req.wait()
        return time.perf_counter() - start
    if rank == dst:
        dist.irecv(payload, src).wait()
        dist.isend(ack, src).wait()
    return None


def timed_together(pairs: list[list[int]], payload: torch.Tensor) -> float | None:
    """Every pair moves payload src -> dst at the same time; on each receiver, seconds until its
    payload arrived (from a common barrier), else None."""
    rank = dist.get_rank()
    dist.barrier()
    start = time.perf_counter()
    sends = [dist.isend(payload, dst) for src, dst in pairs if src == rank]
    recvs = [dist.irecv(torch.empty_like(payload), src) for src, dst in pairs if dst == rank]
    for req in sends + recvs:
        req.wait()
    return time.perf_counter() - start if recvs else None


def main() -> None:
    """Measure every pair in --pairs in both directions, --repeats times after one warm-up."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", required=True, help="JSON list of [link, rank_a, rank_b]")
    parser.add_argument("--mbytes", type=float, default=4.0, help="payload per transfer in MB (1e6 bytes)")
    parser.add_argument(
        "--concurrent", default="[]", help="JSON list of [label, [[src, dst], ...]] timed together"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300.0, help="gloo operation timeout in seconds")
    args = parser.parse_args()

    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=args.timeout))
    payload = torch.zeros(int(args.mbytes * 1e6) // 4, dtype=torch.float32)
    ack = torch.zeros(1, dtype=torch.float32)
    records = []
    for link, a, b in json.loads(args.pairs):
        for src, dst in ((a, b), (b, a)):
            # Warm-up: first use of a pair pays for connection and buffer set-up, not the link.
            dist.barrier()
            timed_send(src, dst, payload, ack)
            for i in range(args.repeats):
                dist.barrier()  # nothing else is on the wire while this pair is timed
                seconds = timed_send(src, dst, payload, ack)
                if seconds is not None:
                    nbytes = payload.numel() * payload.element_size()
                    records.append(
                        {"link": link, "src": src, "dst": dst, "seconds": seconds, "bytes": nbytes}
                    )
                    mbit = nbytes * 8 / seconds / 1e6
                    print(
                        f"{link:>10} {src}->{dst} repeat {i + 1}/{args.repeats}: {mbit:7.1f} Mbit/s",
                        flush=True,
                    )
    # Round trips of one float per pair (a -> b, b's one-float reply): two one-way delays plus gloo's
    # own time; the first of each pair is a warm-up.
    token = torch.zeros(1, dtype=torch.float32)
    for link, a, b in json.loads(args.pairs):
        for i in range(args.repeats + 1):
            dist.barrier()
            seconds = timed_send(a, b, token, ack)
            if seconds is not None and i > 0:
                records.append(
                    {"link": f"{link} round trip", "src": a, "dst": b, "seconds": seconds, "bytes": 4}
                )
    nbytes = payload.numel() * payload.element_size()
    for label, pairs in json.loads(args.concurrent):
        timed_together(pairs, payload)  # warm-up
        for _ in range(args.repeats):
            seconds = timed_together(pairs, payload)
            if seconds is not None:
                records.append(
                    {"link": label, "src": -1, "dst": dist.get_rank(), "seconds": seconds, "bytes": nbytes}
                )
    dist.barrier()
    dist.destroy_process_group()
    write_result(records)


if __name__ == "__main__":
    main()
    exit_without_teardown()
