"""What one GEMM kernel costs on a device: a fixed tail plus the longer of its arithmetic and its
memory traffic, fitted to the H100 sliced-GEMM measurement (``python -m benchmarks.gpu.sliced_gemm``).

A constant share of the peak says that cutting a GEMM into slices is free; the measurement says
otherwise (at TP=4 the 1.3B preset's projection cut in 4 keeps 78 % of its speed, graph-replayed).
The tail and the efficiency are fitted on one preset's rows (graph mode: device time, no Python
launch) and checked on the other preset's, which the fit never saw.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SLICED_GEMM = Path(__file__).resolve().parents[1] / "results" / "gpu" / "sliced_gemm.json"
"""The H100 GEMM measurement the fit reads."""
FIT_PRESET, HELD_OUT_PRESET = "gpt-20b", "gpt-1.3b"
BF16_BYTES = 2


@dataclass(frozen=True)
class GemmModel:
    """One GEMM kernel takes ``tail_s + max(flops / (peak * efficiency), bytes / bandwidth)``."""

    tail_s: float
    """Fixed time every GEMM kernel adds (launch, first and last wave), seconds."""
    efficiency: float
    """Share of the matrix peak the arithmetic runs at once the tail is paid."""

    def seconds(self, flops: float, moved: float, peak: float, bandwidth: float) -> float:
        """One kernel of ``flops`` reading and writing ``moved`` bytes."""
        return self.tail_s + max(flops / (peak * self.efficiency), moved / bandwidth)


def kernels(row: dict) -> list[tuple[float, float]]:
    """(FLOPs, bytes) of each kernel of one measured row: ``slices`` GEMMs of the row's shape.

    fwd cuts the M rows ([m/s, k] x [k, n] into [m/s, n]); wgrad cuts the reduction
    ([n, m/s] x [m/s, k] into [n, k]), every kernel after the first reading the sum it adds to."""
    m, n, k, s = row["m"], row["n"], row["k"], row["slices"]
    flops = 2.0 * m * n * k / s
    if row["kind"] == "fwd":
        return [(flops, BF16_BYTES * (m / s * k + k * n + m / s * n))] * s
    first = BF16_BYTES * (m / s * (n + k) + n * k)
    return [(flops, first)] + [(flops, first + BF16_BYTES * n * k)] * (s - 1)


def predicted_ms(model: GemmModel, row: dict, peak: float, bandwidth: float) -> float:
    """The row's whole call (all its slices) as the model charges it, milliseconds."""
    return sum(model.seconds(f, b, peak, bandwidth) for f, b in kernels(row)) * 1e3


def graph_rows(preset: str, path: Path = SLICED_GEMM) -> list[dict]:
    """The measured rows of ``preset`` replayed from a CUDA graph (device time alone)."""
    rows = json.loads(path.read_text())["rows"]
    return [r for r in rows if r["model"] == preset and r["mode"] == "graph"]


def fit(rows: Iterable[dict], peak: float, bandwidth: float) -> GemmModel:
    """The tail and efficiency that minimise the squared relative error over ``rows``.

    For a given efficiency the best tail is closed-form (the error is linear in it); the
    efficiency is searched on a grid of 0.01, then of 0.001 around the best."""
    rows = list(rows)
    if not rows:
        raise ValueError(
            "no measured rows to fit the GEMM model to: run python -m benchmarks.gpu.sliced_gemm"
        )
    # error_i = (slices_i * tail + work_i) / measured_i - 1 = a_i * tail + b_i
    a = [r["slices"] / (r["ms_median"] * 1e-3) for r in rows]

    def best_at(efficiency: float) -> tuple[float, GemmModel]:
        work = GemmModel(0.0, efficiency)
        b = [predicted_ms(work, r, peak, bandwidth) / r["ms_median"] - 1 for r in rows]
        tail = max(0.0, -sum(x * y for x, y in zip(a, b)) / sum(x * x for x in a))
        return sum((x * tail + y) ** 2 for x, y in zip(a, b)), GemmModel(tail, efficiency)

    coarse = min((best_at(c / 100) for c in range(30, 101)), key=lambda t: t[0])[1].efficiency
    lo, hi = round(coarse * 1000) - 10, round(coarse * 1000) + 10
    return min((best_at(m / 1000) for m in range(max(lo, 1), min(hi, 1000) + 1)), key=lambda t: t[0])[1]


def errors(model: GemmModel, rows: Iterable[dict], peak: float, bandwidth: float) -> list[float]:
    """Relative error of the model's time for each row (predicted / measured - 1)."""
    return [predicted_ms(model, r, peak, bandwidth) / r["ms_median"] - 1 for r in rows]


def held_out_summary(model: GemmModel, peak: float, bandwidth: float) -> tuple[int, float, float]:
    """(rows, median |error|, largest |error|) of the model on the preset it was not fitted to."""
    errs = [abs(e) for e in errors(model, graph_rows(HELD_OUT_PRESET), peak, bandwidth)]
    return len(errs), statistics.median(errs), max(errs)
