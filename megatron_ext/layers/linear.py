"""Drop-in replacements for megatron-core's ColumnParallelLinear / RowParallelLinear whose
sequence-parallel all-gather and reduce-scatter run as overlapped P2P schedules (Flash-Overlap).

The classes subclass megatron-core's layers and call their constructors unchanged, so the
constructor arguments, the weight initialisation (same RNG consumption: same seed, bitwise equal
weights), the parameter attributes (tensor_model_parallel, partition_dim, partition_stride,
allreduce, sequence_parallel on the row bias), checkpoint sharding and extra state are megatron-core's.
Only ``forward`` differs, and the options it cannot honour are rejected at construction.

Activations are [s, b, h] with the sequence split over the TP group (sequence parallelism):
column forward gathers the sequence fused with its GEMM; column backward computes dgrad with
GEMM + reduce-scatter and wgrad while gathering the input again (memory as in megatron-core, which
also re-gathers: the full-sequence input is never kept); row forward is GEMM + reduce-scatter and
row backward gathers the output gradient fused with both its dgrad and wgrad GEMMs.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_ext.layers.p2p_overlap import (
    DEFAULT_TIMEOUT_S,
    Mode,
    OverlapGroup,
    all_gather_compute,
    compute_reduce_scatter,
)


def _rows(t: torch.Tensor, j: int, n: int) -> torch.Tensor:
    """Rank j's slice of the sequence (dim 0) of ``t``, split in n equal parts."""
    size = t.shape[0] // n
    return t[j * size : (j + 1) * size]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _AllGatherLinear(torch.autograd.Function):
    """Fwd: sequence all-gather fused with X W^T, own slice first; bwd: dgrad GEMM+reduce-scatter, wgrad over re-gathered X (CommFuse: decomposed AG and RS, TPSP)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, og: OverlapGroup) -> torch.Tensor:
        n = og.size
        out = x.new_empty((x.shape[0] * n, *x.shape[1:-1], weight.shape[0]))

        def gemm(j: int, xj: torch.Tensor) -> None:
            torch.matmul(xj, weight.t(), out=_rows(out, j, n))

        all_gather_compute(x, gemm, og)
        # Frozen weights need no wgrad, hence no saved input (as megatron-core's frozen path).
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        ctx.og = og
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        og: OverlapGroup = ctx.og
        n = og.size
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = compute_reduce_scatter(lambda j: torch.matmul(_rows(grad_out, j, n), weight), og)
        if ctx.needs_input_grad[1]:
            acc: list[torch.Tensor] = []

            def wgrad(j: int, xj: torch.Tensor) -> None:
                g = _flat(_rows(grad_out, j, n)).t()
                if acc:
                    acc[0].addmm_(g, _flat(xj))
                else:
                    acc.append(g.matmul(_flat(xj)))

            all_gather_compute(x, wgrad, og)
            grad_w = acc[0]
        return grad_x, grad_w, None


class _LinearReduceScatter(torch.autograd.Function):
    """Fwd: X W^T fused with the sequence reduce-scatter, own slice last; bwd: gradient all-gather fused with dgrad and wgrad (CommFuse: decomposed RS and AG, TPSP)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, og: OverlapGroup) -> torch.Tensor:
        n = og.size
        out = compute_reduce_scatter(lambda j: torch.matmul(_rows(x, j, n), weight.t()), og)
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        ctx.og = og
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        og: OverlapGroup = ctx.og
        n = og.size
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (want_x or want_w):
            return None, None, None
        grad_x = grad_out.new_empty((grad_out.shape[0] * n, *grad_out.shape[1:-1], weight.shape[1])) if want_x else None
        acc: list[torch.Tensor] = []

        def step(j: int, gj: torch.Tensor) -> None:
            if want_x:
                torch.matmul(gj, weight, out=_rows(grad_x, j, n))
            if want_w:
                g, xj = _flat(gj).t(), _flat(_rows(x, j, n))
                if acc:
                    acc[0].addmm_(g, xj)
                else:
                    acc.append(g.matmul(xj))

        all_gather_compute(grad_out.contiguous(), step, og)
        return grad_x, acc[0] if want_w else None, None


class _GatherLastDim(torch.autograd.Function):
    """Fwd: all-gather of the TP-split last dimension (gather_output, megatron-core's, not overlapped); bwd: keep own part."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group = group
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.chunk(ctx.group.size(), dim=-1)[ctx.group.rank()].contiguous(), None


class _FlashOverlapMixin:
    """Option checks and the P2P settings shared by both layers."""

    p2p_mode: ClassVar[Mode] = "direct"
    """P2P pattern used when the constructor gets none (the spec sets it per config)."""
    p2p_timeout_s: ClassVar[float] = DEFAULT_TIMEOUT_S
    """Wait bound used when the constructor gets none."""

    def _setup_overlap(self, mode: Mode | None, timeout_s: float | None, name: str | None, sequence_parallel: bool) -> None:
        kind = type(self).__name__
        cfg = self.config
        tp = 1 if self.tp_group is None else self.tp_group.size()
        unsupported = {
            "is_expert=True": self.is_expert,
            "config.gradient_accumulation_fusion": cfg.gradient_accumulation_fusion,
            "config.defer_embedding_wgrad_compute": cfg.defer_embedding_wgrad_compute,
            "config.cpu_offloading": cfg.cpu_offloading,
        }
        for option, present in unsupported.items():
            if present:
                raise ValueError(f"{kind} does not support {option}: disable it, or use megatron-core's {kind.removeprefix('FlashOverlap')}")
        if tp > 1 and not sequence_parallel:
            raise ValueError(
                f"{kind} overlaps the sequence-parallel all-gather/reduce-scatter and needs "
                f"config.sequence_parallel=True at tensor-parallel size {tp}: pass --sequence-parallel, "
                "or disable flash_overlap"
            )
        self.overlap = OverlapGroup(
            group=self.tp_group if tp > 1 else None,
            mode=mode or self.p2p_mode,
            timeout_s=timeout_s if timeout_s is not None else self.p2p_timeout_s,
            name=name or kind,
        )

    def _check_input(self, x: torch.Tensor, weight: torch.Tensor, features: int) -> None:
        name = self.overlap.name
        if x.dim() < 2 or x.shape[-1] != features:
            raise ValueError(f"layer {name!r}: input of shape {tuple(x.shape)} must be [s, b, {features}] (sequence first)")
        if x.dtype != weight.dtype:
            raise TypeError(
                f"layer {name!r}: input dtype {x.dtype} differs from the weight dtype {weight.dtype}: cast the "
                "input, or build the model with config.params_dtype matching the activations"
            )
        if x.device != weight.device:
            raise ValueError(f"layer {name!r}: input is on {x.device} but the weight on {weight.device}: move one of them")


class FlashOverlapColumnParallelLinear(_FlashOverlapMixin, ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear (same arguments, same ``(output, bias)`` return) whose
    sequence all-gather is fused with the GEMM. Extra keyword arguments: ``p2p_mode`` ("direct" or
    "ring") and ``timeout_s``; ``tp_comm_buffer_name`` names the layer in error messages."""

    def __init__(self, input_size: int, output_size: int, *, p2p_mode: Mode | None = None,
                 timeout_s: float | None = None, **megatron_kwargs: Any) -> None:
        super().__init__(input_size, output_size, **megatron_kwargs)
        self._setup_overlap(p2p_mode, timeout_s, megatron_kwargs.get("tp_comm_buffer_name"), self.sequence_parallel)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if weight is None:
            if self.weight is None:
                raise RuntimeError(
                    f"layer {self.overlap.name!r} was built with skip_weight_param_allocation=True: pass weight= to forward"
                )
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise RuntimeError(
                f"layer {self.overlap.name!r}: supplied weight has shape {tuple(weight.shape)}, expected "
                f"{(self.output_size_per_partition, self.input_size)}"
            )
        self._check_input(input_, weight, self.input_size)
        output = _AllGatherLinear.apply(input_, weight, self.overlap)
        if self.bias is not None and not self.skip_bias_add:
            output = output + self.bias
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and self.overlap.group is not None:
            output = _GatherLastDim.apply(output, self.overlap.group)
        return output, self.bias if self.skip_bias_add else None


class FlashOverlapRowParallelLinear(_FlashOverlapMixin, RowParallelLinear):
    """megatron-core's RowParallelLinear (same arguments, same ``(output, bias)`` return) whose
    sequence reduce-scatter is fused with the GEMM. Extra keyword arguments as for the column layer."""

    def __init__(self, input_size: int, output_size: int, *, p2p_mode: Mode | None = None,
                 timeout_s: float | None = None, **megatron_kwargs: Any) -> None:
        super().__init__(input_size, output_size, **megatron_kwargs)
        self._setup_overlap(p2p_mode, timeout_s, megatron_kwargs.get("tp_comm_buffer_name"), self.sequence_parallel)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._check_input(input_, self.weight, self.input_size_per_partition)
        n = self.overlap.size
        if input_.shape[0] % n:
            raise ValueError(
                f"layer {self.overlap.name!r}: sequence length {input_.shape[0]} is not divisible by the "
                f"tensor-parallel size {n}: pad the sequence to a multiple of {n}"
            )
        output = _LinearReduceScatter.apply(input_, self.weight, self.overlap)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None
