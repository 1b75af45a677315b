"""What one emulated device computes per second: peak rates, memory bandwidth and efficiencies,
each with its source. A stand-in rank charges its intercepted ops to these figures
(:mod:`benchmarks.device.standin`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .gemm_fit import FIT_PRESET, GemmModel, fit, graph_rows


@dataclass(frozen=True)
class DeviceTable:
    """One accelerator (one GPU, or one GCD of an MI250X) as the stand-in charges it."""

    name: str
    """The ``--device`` value."""
    matmul_tflops: dict[torch.dtype, float]
    """Dense matrix peak in TFLOP/s per operand dtype (no sparsity)."""
    gemm_efficiency: float
    """Share of the peak a GEMM's arithmetic reaches once its tail is paid."""
    gemm_tail_us: float
    """Fixed time every GEMM kernel adds, however large (launch, first and last wave)."""
    attention_efficiency: float
    """Share of the peak fused attention (forward and backward) reaches."""
    memory_gbps: float
    """Peak memory bandwidth in GB/s."""
    memory_efficiency: float
    """Share of the memory bandwidth an element-wise or reduction kernel reaches."""
    kernel_floor_us: float
    """Shortest time any other kernel takes, however small its work (launch and tail)."""
    sources: tuple[str, ...]
    """Where each figure comes from; "assumed" marks a figure nothing here measured."""

    def matmul_peak(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for operands of ``dtype`` (integer and unknown types at the fp32 rate)."""
        return self.matmul_tflops.get(dtype, self.matmul_tflops[torch.float32]) * 1e12

    def memory_rate(self) -> float:
        """Bytes per second an element-wise or reduction kernel moves."""
        return self.memory_gbps * 1e9 * self.memory_efficiency

    def gemm_model(self) -> GemmModel:
        """What one GEMM kernel costs on this device."""
        return GemmModel(self.gemm_tail_us * 1e-6, self.gemm_efficiency)

    def gemm_seconds(self, flops: float, moved: float, dtype: torch.dtype) -> float:
        """One GEMM kernel of ``flops`` that reads and writes ``moved`` bytes."""
        return self.gemm_model().seconds(flops, moved, self.matmul_peak(dtype), self.memory_rate())


# NVIDIA H100 SXM5 datasheet: 989.4 TFLOP/s dense bf16/fp16, 66.9 fp32 (non-tensor; torch keeps
# fp32 matmuls off TF32 by default), 3.35 TB/s HBM3.
H100_BF16_TFLOPS, H100_MEMORY_GBPS, MEMORY_EFFICIENCY = 989.4, 3350.0, 0.8
H100_GEMM = fit(graph_rows(FIT_PRESET), H100_BF16_TFLOPS * 1e12, H100_MEMORY_GBPS * 1e9 * MEMORY_EFFICIENCY)
H100 = DeviceTable(
    name="h100",
    matmul_tflops={torch.bfloat16: 989.4, torch.float16: 989.4, torch.float32: 66.9},
    gemm_efficiency=H100_GEMM.efficiency,
    gemm_tail_us=round(H100_GEMM.tail_s * 1e6, 2),
    attention_efficiency=0.35,
    memory_gbps=H100_MEMORY_GBPS,
    memory_efficiency=MEMORY_EFFICIENCY,
    kernel_floor_us=3.0,
    sources=(
        "peaks and bandwidth: NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
        f"gemm_efficiency, gemm_tail_us: fitted to the {FIT_PRESET} graph-replayed GEMMs (1 to 8 slices) of "
        "benchmarks/results/gpu/sliced_gemm.json, checked on the other preset's (benchmarks.device.validation)",
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
    gemm_tail_us=H100.gemm_tail_us,
    attention_efficiency=0.35,
    memory_gbps=1638.4,
    memory_efficiency=MEMORY_EFFICIENCY,
    kernel_floor_us=3.0,
    sources=(
        "peaks and bandwidth: AMD Instinct MI250X datasheet, halved per GCD (OLCF Frontier user guide)",
        "gemm_efficiency, gemm_tail_us: assumed equal to the H100's fitted ones (no MI250X was measured)",
        "attention_efficiency, memory_efficiency 0.8, kernel_floor_us 3: assumed as for the H100",
    ),
)

TABLES = {table.name: table for table in (H100, MI250X)}
