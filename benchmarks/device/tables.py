"""What one emulated device computes per second: peak rates, memory bandwidth and efficiencies,
each with its source. A stand-in rank charges its intercepted ops to these figures
(:mod:`benchmarks.device.standin`)."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

SLICED_GEMM = Path(__file__).resolve().parents[1] / "results" / "gpu" / "sliced_gemm.json"
"""The H100 GEMM measurement (``python -m benchmarks.gpu.sliced_gemm``) the efficiency comes from."""


@dataclass(frozen=True)
class DeviceTable:
    """One accelerator (one GPU, or one GCD of an MI250X) as the stand-in charges it."""

    name: str
    """The ``--device`` value."""
    matmul_tflops: dict[torch.dtype, float]
    """Dense matrix peak in TFLOP/s per operand dtype (no sparsity)."""
    gemm_efficiency: float
    """Share of the peak a large GEMM reaches."""
    attention_efficiency: float
    """Share of the peak fused attention (forward and backward) reaches."""
    memory_gbps: float
    """Peak memory bandwidth in GB/s."""
    memory_efficiency: float
    """Share of the memory bandwidth an element-wise or reduction kernel reaches."""
    kernel_floor_us: float
    """Shortest time one kernel takes, however small its work (launch and tail)."""
    sources: tuple[str, ...]
    """Where each figure comes from; "assumed" marks a figure nothing here measured."""

    def matmul_peak(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for operands of ``dtype`` (integer and unknown types at the fp32 rate)."""
        return self.matmul_tflops.get(dtype, self.matmul_tflops[torch.float32]) * 1e12


def measured_h100_gemm_efficiency(path: Path = SLICED_GEMM) -> float:
    """Median TFLOP/s of the unsliced eager bf16 GEMMs of the H100 measurement over the bf16 peak."""
    rows = json.loads(path.read_text())["rows"]
    tflops = [r["tflops"] for r in rows if r["slices"] == 1 and r["mode"] == "eager"]
    return statistics.median(tflops) / H100_BF16_TFLOPS


# NVIDIA H100 SXM5 datasheet: 989.4 TFLOP/s dense bf16/fp16, 66.9 fp32 (non-tensor; torch keeps
# fp32 matmuls off TF32 by default), 3.35 TB/s HBM3.
H100_BF16_TFLOPS = 989.4
H100 = DeviceTable(
    name="h100",
    matmul_tflops={torch.bfloat16: 989.4, torch.float16: 989.4, torch.float32: 66.9},
    gemm_efficiency=round(measured_h100_gemm_efficiency(), 3),
    attention_efficiency=0.35,
    memory_gbps=3350.0,
    memory_efficiency=0.8,
    kernel_floor_us=3.0,
    sources=(
        "peaks and bandwidth: NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
        "gemm_efficiency: measured, median of the 48 unsliced eager bf16 GEMMs of "
        "benchmarks/results/gpu/sliced_gemm.json (689 TFLOP/s)",
        "attention_efficiency: FlashAttention-3 paper (Shah et al., 2024): FlashAttention-2 reaches 35 % of "
        "the H100's peak",
        "memory_efficiency 0.8, kernel_floor_us 3: assumed",
    ),
)

# AMD Instinct MI250X datasheet: 383 TFLOP/s dense bf16/fp16 and 95.7 fp32 matrix per module of two
# GCDs, 3.2 TB/s HBM2e per module; a rank is one GCD, half of each (OLCF Frontier user guide).
MI250X = DeviceTable(
    name="mi250x",
    matmul_tflops={torch.bfloat16: 191.5, torch.float16: 191.5, torch.float32: 47.9},
    gemm_efficiency=H100.gemm_efficiency,
    attention_efficiency=0.35,
    memory_gbps=1638.4,
    memory_efficiency=0.8,
    kernel_floor_us=3.0,
    sources=(
        "peaks and bandwidth: AMD Instinct MI250X datasheet, halved per GCD (OLCF Frontier user guide)",
        "gemm_efficiency: assumed equal to the H100's measured share (no MI250X was measured)",
        "attention_efficiency, memory_efficiency 0.8, kernel_floor_us 3: assumed as for the H100",
    ),
)

TABLES = {table.name: table for table in (H100, MI250X)}
