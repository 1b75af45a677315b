"""How many GEMMs each Flash-Overlap collective should run in (``flash_overlap.compute_slices``),
chosen from the device table and the link: the count whose forward schedules end first.

One GEMM per rank's slice overlaps the most, but each GEMM pays the device's fixed tail
(:mod:`benchmarks.device.gemm_fit`), and at TP=8 the slices of a 1.3B layer are small. Merging the
slices of consecutive steps pays fewer tails and hides less of the transfers. This module times
both sides of that trade on the device table (computed, not measured): for one layer's four
linears at TP=n,

- all-gather + GEMM (qkv, fc1): the own slice's GEMM at once, each later GEMM when the last slice
  of its run has arrived and the previous GEMM is done, slices arriving back to back;
- GEMM + reduce-scatter (proj, fc2): the other ranks' GEMMs first, each run's partials sent when
  its GEMM is done, one after another on the link, the own slice's GEMM last;

and returns the count with the earliest end (0, one GEMM per rank, on a tie).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.device.gemm_fit import BF16_BYTES as BF16
from benchmarks.device.tables import DeviceTable
from megatron_ext.layers.p2p.overlap import step_runs


def gathered_gemms_end_s(gemm_s: Callable[[int], float], n: int, gemms: int, transfer_s: float) -> float:
    """Device time until the last GEMM of an all-gather + GEMM ends; ``gemm_s(slices)`` is one
    GEMM over that many ranks' slices, ``transfer_s`` one slice's transfer."""
    end = gemm_s(1)  # the own slice, no wait
    for run in step_runs(n, gemms):
        end = max(end, run[-1] * transfer_s) + gemm_s(len(run))
    return end


def scattered_gemms_end_s(gemm_s: Callable[[int], float], n: int, gemms: int, transfer_s: float) -> float:
    """Device time until a GEMM + reduce-scatter is done: its last GEMM (the own slice's) and its
    last transfer."""
    computed = link_free = 0.0
    for run in step_runs(n, gemms):
        computed += gemm_s(len(run))
        for _ in run:
            link_free = max(link_free, computed) + transfer_s
    return max(computed + gemm_s(1), link_free)


def layer_forward_s(
    table: DeviceTable, tokens: int, hidden: int, ffn: int, n: int, gemms: int, link_bytes_per_s: float
) -> float:
    """The four fused linears of one layer's forward at TP=n with ``gemms`` GEMMs each."""
    rows = tokens // n  # one rank's slice of the sequence (times the micro-batch)
    transfer_s = rows * hidden * BF16 / link_bytes_per_s  # a slice of activations or of partial sums

    def gemm(k: int, out: int) -> Callable[[int], float]:
        def seconds(slices: int) -> float:
            m = rows * slices
            moved = BF16 * (m * k + k * out + m * out)
            return table.gemm_seconds(2.0 * m * k * out, moved, torch.bfloat16)

        return seconds

    return (
        gathered_gemms_end_s(gemm(hidden, 3 * hidden // n), n, gemms, transfer_s)  # qkv
        + scattered_gemms_end_s(gemm(hidden // n, hidden), n, gemms, transfer_s)  # proj
        + gathered_gemms_end_s(gemm(hidden, ffn // n), n, gemms, transfer_s)  # fc1
        + scattered_gemms_end_s(gemm(ffn // n, hidden), n, gemms, transfer_s)  # fc2
    )


def best_compute_slices(
    table: DeviceTable, tokens: int, hidden: int, ffn: int, n: int, link_bytes_per_s: float
) -> tuple[int, dict[int, float]]:
    """The ``compute_slices`` whose layer forward ends first (0: one GEMM per rank), and the
    computed forward time of every candidate, seconds."""
    candidates = [0, *range(2, n)]
    times = {k: layer_forward_s(table, tokens, hidden, ffn, n, k, link_bytes_per_s) for k in candidates}
    return min(candidates, key=lambda k: (times[k], k != 0)), times
