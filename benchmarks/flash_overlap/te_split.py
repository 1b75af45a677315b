"""TransformerEngine's published comm-GEMM overlap split, rebuilt on the project's P2P exchange so
that it shares Flash-Overlap's transport.

TE's userbuffers configurations (the defaults of ``transformer_engine.pytorch.module.base.initialize_ub``
and the published per-model YAMLs) use:

Method in full: benchmarks/results/methods.md, `benchmarks.flash_overlap.te_split`.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from benchmarks.flash_overlap.chunked import CHUNKS, _chunk_rows, _with_bias
from megatron_ext.layers.p2p.link import Link, OverlapGroup
from megatron_ext.layers.p2p.overlap import all_gather_compute, span, start_all_gather, start_reduce_scatter

# Tags clear of the project's schedules (steps 1 .. n-1 and k << 20 for k = 1..4).
_PIPELINE_TAG = 5 << 20


def _ring(group: Any, name: str) -> OverlapGroup:
    return OverlapGroup(group, "ring", name=name)


def pipelined_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, og: OverlapGroup) -> torch.Tensor:
    """TE's pipelined GEMM + reduce-scatter: y = RS(x W^T) with x [s, b, i/N], chunk by chunk, each
    chunk's partials [N, q, b, o] sent (direct P2P, posted at once) as soon as its GEMM ends; this
    rank's own rows of every chunk summed at the end. Returns [s/N, b, o]."""
    n, r = og.size, og.rank
    link = Link(og, x.device, "pipelined reduce-scatter")
    own, incoming = [], []
    for i in range(CHUNKS):
        partial = (_chunk_rows(x, n, i) @ weight.t()).contiguous()  # [n, q, b, o]
        own.append(partial[r])
        for k in range(1, n):
            src, dst = (r - k) % n, (r + k) % n
            buf = torch.empty_like(partial[r])
            incoming.append(
                (i, buf, link.exchange(buf, src, partial[dst], dst, _PIPELINE_TAG + i * n + k), src)
            )
    for i, buf, posted, src in incoming:
        link.wait(posted, True, src, f"partial of chunk {i} from rank {src}")
        own[i].add_(buf)
    link.finish()
    return torch.cat(own)


class _RingExchangeColumn(torch.autograd.Function):
    """qkv/fc1: fprop ring exchange (slice GEMMs under the ring all-gather); dgrad/wgrad bulk."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, og: OverlapGroup) -> torch.Tensor:
        n = og.size
        out = x.new_empty((x.shape[0] * n, *x.shape[1:-1], weight.shape[0]))
        all_gather_compute(x, lambda js, xj: torch.matmul(xj, weight.t(), out=span(out, js, n)), og)
        ctx.save_for_backward(x, weight)
        ctx.og = og
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        og, grad = ctx.og, grad.contiguous()
        gathered = start_all_gather(x, og, x.new_empty((grad.shape[0], *x.shape[1:])))
        scattered = start_reduce_scatter(grad @ weight, og)
        grad_w = grad.flatten(0, -2).t() @ gathered().flatten(0, -2)
        return scattered(), grad_w, None


class _PipelinedRow(torch.autograd.Function):
    """proj/fc2: fprop pipelined GEMM + reduce-scatter; dgrad ring exchange (dY slices passed around
    the ring under the slice dgrad GEMMs), then one wgrad GEMM over the gathered dY."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, og: OverlapGroup) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.og = og
        return pipelined_reduce_scatter(x, weight, og)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        og, grad = ctx.og, grad.contiguous()
        n = og.size
        grad_x = grad.new_empty((*x.shape[:-1], weight.shape[1]))
        gathered = grad.new_empty((x.shape[0], *grad.shape[1:]))
        all_gather_compute(
            grad, lambda js, gj: torch.matmul(gj, weight, out=span(grad_x, js, n)), og, out=gathered
        )
        return grad_x, gathered.flatten(0, -2).t() @ x.flatten(0, -2), None


class TESplitColumnParallelLinear(ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear (same construction) with TE's ring-exchange fprop and bulk
    backward, on P2P."""

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        weight = self.weight if weight is None else weight
        og = _ring(self.tp_group, "TE split column (ring exchange)")
        return _with_bias(self, _RingExchangeColumn.apply(input_, weight, og))


class TESplitRowParallelLinear(RowParallelLinear):
    """megatron-core's RowParallelLinear (same construction) with TE's pipelined fprop and
    ring-exchange dgrad, on P2P."""

    def forward(self, input_: torch.Tensor):
        og = _ring(self.tp_group, "TE split row (pipelined)")
        return _with_bias(self, _PipelinedRow.apply(input_, self.weight, og))
