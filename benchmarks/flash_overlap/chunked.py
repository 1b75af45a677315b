"""The 4-chunk slicing baseline (``chunked_4``): megatron-core's linears with every forward
sequence-parallel collective, all-gathers included, cut into CHUNKS asynchronous collectives, each
chunk's GEMM running while the next chunk travels, on gloo's collectives (the process group's
all_gather_into_tensor / reduce_scatter_tensor). The first gather and the last reduce-scatter of each
GEMM stay exposed. Backward keeps megatron-core's overlap for the column layer and pipelines the
row layer's gather of dY the same way as the forward.

Method in full: benchmarks/results/methods.md, `benchmarks.flash_overlap.chunked`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

CHUNKS = 4  # Megatron / TransformerEngine "pipeline" overlap splits a GEMM in 4 by default


def _chunk_rows(full: torch.Tensor, n: int, i: int) -> torch.Tensor:
    """Rows of chunk i of every rank's slice of ``full`` [s, ...], as a [n, q, ...] view."""
    per_rank = full.view(n, full.shape[0] // n, *full.shape[1:])
    q = per_rank.shape[1] // CHUNKS
    return per_rank[:, i * q : (i + 1) * q]


def _gather_chunks(shard: torch.Tensor, group: dist.ProcessGroup) -> list[tuple[torch.Tensor, dist.Work]]:
    """Post the all-gather of each of the CHUNKS chunks of ``shard`` [s/N, ...]; [N*q, ...] buffers."""
    out = []
    for chunk in shard.chunk(CHUNKS):
        buf = chunk.new_empty((chunk.shape[0] * group.size(), *chunk.shape[1:]))
        out.append((buf, dist.all_gather_into_tensor(buf, chunk.contiguous(), group=group, async_op=True)))
    return out


class _ChunkedAllGatherLinear(torch.autograd.Function):
    """Forward: y = AG(x) W^T, gathered in CHUNKS pieces, GEMM [N q, b, h] x [h, f/N] per piece.
    Backward (megatron-core's): re-gather x under dgrad [s, b, f/N] x [f/N, h], reduce-scatter dgrad
    under wgrad [f/N, s b] x [s b, h]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        n = group.size()
        out = x.new_empty((x.shape[0] * n, *x.shape[1:-1], weight.shape[0]))
        for i, (buf, work) in enumerate(_gather_chunks(x, group)):
            work.wait()
            _chunk_rows(out, n, i).copy_((buf @ weight.t()).view(n, -1, *out.shape[1:]))
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        group, grad = ctx.group, grad.contiguous()
        full = x.new_empty((grad.shape[0], *x.shape[1:]))
        gather = dist.all_gather_into_tensor(full, x, group=group, async_op=True)
        dgrad = grad @ weight
        gather.wait()
        grad_x = torch.empty_like(x)
        scatter = dist.reduce_scatter_tensor(grad_x, dgrad, group=group, async_op=True)
        grad_w = grad.flatten(0, -2).t() @ full.flatten(0, -2)
        scatter.wait()
        return grad_x, grad_w, None


class _ChunkedLinearReduceScatter(torch.autograd.Function):
    """Forward: y = RS(x W^T), GEMM [N q, b, f/N] x [f/N, h] per chunk, each chunk's reduce-scatter
    posted at once. Backward: dY gathered in CHUNKS pieces, dgrad [N q, b, h] x [h, f/N] per piece,
    then wgrad [h, s b] x [s b, f/N]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        n = group.size()
        parts, works = [], []
        for i in range(CHUNKS):
            partial = _chunk_rows(x, n, i) @ weight.t()  # [n, q, b, h], contiguous
            parts.append(partial.new_empty(partial.shape[1:]))
            works.append(
                dist.reduce_scatter_tensor(parts[-1], partial.flatten(0, 1), group=group, async_op=True)
            )
        for work in works:
            work.wait()
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        group = ctx.group
        n = group.size()
        grad_x = torch.empty_like(x)
        full = grad.new_empty((x.shape[0], *grad.shape[1:]))
        for i, (buf, work) in enumerate(_gather_chunks(grad.contiguous(), group)):
            work.wait()
            rows = buf.view(n, -1, *buf.shape[1:])
            _chunk_rows(full, n, i).copy_(rows)
            _chunk_rows(grad_x, n, i).copy_(rows @ weight)
        grad_w = full.flatten(0, -2).t() @ x.flatten(0, -2)
        return grad_x, grad_w, None


def _with_bias(layer: Any, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    if layer.bias is None or layer.skip_bias_add:
        return out, layer.bias
    return out + layer.bias, None


class ChunkedColumnParallelLinear(ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear (same construction) with the chunked all-gather forward."""

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        weight = self.weight if weight is None else weight
        return _with_bias(self, _ChunkedAllGatherLinear.apply(input_, weight, self.tp_group))


class ChunkedRowParallelLinear(RowParallelLinear):
    """megatron-core's RowParallelLinear (same construction) with the chunked reduce-scatter forward."""

    def forward(self, input_: torch.Tensor):
        return _with_bias(self, _ChunkedLinearReduceScatter.apply(input_, self.weight, self.tp_group))
