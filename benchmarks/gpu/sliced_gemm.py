"""How much GEMM efficiency the Flash-Overlap schedules give up by cutting each GEMM into slices.

    python -m benchmarks.gpu.sliced_gemm [--out benchmarks/results/gpu]

Method in full: benchmarks/results/methods.md, `benchmarks.gpu.sliced_gemm`.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.gpu.report import write_report
from mdsp_base.shutdown import exit_without_teardown

REPO = Path(__file__).resolve().parents[2]

# (hidden, ffn hidden, sequence length, micro batch) of the presets in scripts/presets/.
MODELS = {"gpt-1.3b": (2048, 8192, 2048, 4), "gpt-20b": (6144, 24576, 2048, 1)}


@dataclass(frozen=True)
class Row:
    """One GEMM shape, sliced ``slices`` ways."""

    model: str
    """Preset the shape comes from."""
    tp: int
    """Tensor-parallel size the per-rank weight shape is cut for."""
    gemm: str
    """Layer GEMM: qkv, proj, fc1 or fc2."""
    kind: str
    """fwd (M sliced), wgrad (K sliced, accumulated)."""
    mode: str
    """eager (launched from Python) or graph (replayed from a CUDA graph)."""
    m: int
    """Rows of the activation (tokens) for fwd; the reduction length for wgrad."""
    n: int
    """Output features."""
    k: int
    """Input features (fwd) or weight rows (wgrad)."""
    slices: int
    """Number of GEMMs the work is cut into (1 = the unsliced GEMM)."""
    ms_min: float
    """Fastest per-call time, milliseconds."""
    ms_median: float
    """Median per-call time, milliseconds."""
    ms_max: float
    """Slowest per-call time, milliseconds."""
    tflops: float
    """Achieved bf16 TFLOP/s at the median."""


def layer_gemms(hidden: int, ffn: int, tp: int) -> dict[str, tuple[int, int]]:
    """(input features, output features) of each per-rank GEMM of a GPT layer at TP = ``tp``."""
    return {
        "qkv": (hidden, 3 * hidden // tp),
        "proj": (hidden // tp, hidden),
        "fc1": (hidden, ffn // tp),
        "fc2": (ffn // tp, hidden),
    }


def time_ms(fn: Callable[[], None], inner: int, reps: int) -> list[float]:
    """Per-call milliseconds of ``fn``, one figure per repetition of ``inner`` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / inner)
    return out


def graphed(fn: Callable[[], None], inner: int) -> Callable[[], None]:
    """``inner`` calls of ``fn`` captured once in a CUDA graph; each call of the result replays them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return graph.replay


def forward_call(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, slices: int) -> Callable[[], None]:
    """Y = X W^T computed as ``slices`` GEMMs over row blocks of X, each into its rows of Y."""
    rows = x.shape[0] // slices

    def call() -> None:
        for j in range(slices):
            torch.matmul(x[j * rows : (j + 1) * rows], w.t(), out=out[j * rows : (j + 1) * rows])

    return call


def wgrad_call(g: torch.Tensor, x: torch.Tensor, acc: torch.Tensor, slices: int) -> Callable[[], None]:
    """dW = G^T X with the token (reduction) dimension cut into ``slices`` accumulated GEMMs."""
    rows = x.shape[0] // slices

    def call() -> None:
        torch.mm(g[:rows].t(), x[:rows], out=acc)
        for j in range(1, slices):
            acc.addmm_(g[j * rows : (j + 1) * rows].t(), x[j * rows : (j + 1) * rows])

    return call


def measure(models: list[str], tps: list[int], slices: list[int], inner: int, reps: int) -> list[Row]:
    rows: list[Row] = []
    dev = torch.device("cuda")
    for model in models:
        hidden, ffn, seq, mbs = MODELS[model]
        m = seq * mbs
        for tp in tps:
            for gemm, (k, n) in layer_gemms(hidden, ffn, tp).items():
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
                y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                g = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
                dw = torch.empty(n, k, device=dev, dtype=torch.bfloat16)
                flops = 2.0 * m * n * k
                for s in slices:
                    for kind, fn in (("fwd", forward_call(x, w, y, s)), ("wgrad", wgrad_call(g, x, dw, s))):
                        eager = time_ms(fn, inner, reps)
                        graph = [t / inner for t in time_ms(graphed(fn, inner), 1, reps)]
                        for mode, t in (("eager", eager), ("graph", graph)):
                            med = statistics.median(t)
                            rows.append(
                                Row(
                                    model,
                                    tp,
                                    gemm,
                                    kind,
                                    mode,
                                    m,
                                    n,
                                    k,
                                    s,
                                    min(t),
                                    med,
                                    max(t),
                                    flops / med / 1e9,
                                )
                            )
                del x, w, y, g, dw
    return rows


def table(rows: list[Row]) -> str:
    """Markdown: per shape and kind, the unsliced GEMM's time and each slicing's efficiency, eager
    and replayed from a CUDA graph."""
    base = {(r.model, r.tp, r.gemm, r.kind): r for r in rows if r.slices == 1 and r.mode == "graph"}
    one = {(r.model, r.tp, r.gemm, r.kind, r.mode): r for r in rows if r.slices == 1}
    counts = sorted({r.slices for r in rows if r.slices > 1})
    head = [
        "model",
        "TP",
        "GEMM",
        "kind",
        "M x N x K",
        "1 GEMM ms, graph (min/med/max)",
        "TFLOP/s",
        *[f"{s} slices: eff. eager / graph" for s in counts],
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_key = {(r.model, r.tp, r.gemm, r.kind, r.mode, r.slices): r for r in rows}
    for key, g in base.items():
        cells = [
            g.model,
            str(g.tp),
            g.gemm,
            g.kind,
            f"{g.m} x {g.n} x {g.k}",
            f"{g.ms_min:.3f}/{g.ms_median:.3f}/{g.ms_max:.3f}",
            f"{g.tflops:.0f}",
        ]
        for s in counts:
            eff = [
                one[(*key, mode)].ms_median / by_key[(*key, mode, s)].ms_median for mode in ("eager", "graph")
            ]
            cells.append(f"{eff[0]:.2f} / {eff[1]:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--slices", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--inner", type=int, default=10, help="back-to-back calls per timed repetition")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: sliced_gemm needs a CUDA (or ROCm) GPU: run it on a GPU node")
    if 1 not in args.slices:
        args.slices = [1, *args.slices]
    rows = measure(args.models, args.tp, args.slices, args.inner, args.reps)
    device = {"name": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    text = (
        f"Device: {device['name']}, torch {device['torch']} (CUDA {device['cuda']}); bf16; "
        f"{args.reps} repetitions of {args.inner} calls.\n\n{table(rows)}\n"
    )
    write_report(args.out, "sliced_gemm", {"device": device, "rows": [asdict(r) for r in rows]}, text)
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
