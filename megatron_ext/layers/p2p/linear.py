"""The P2P backend of the Flash-Overlap linears: the autograd functions that run the GEMMs of
both layers inside the overlapped P2P schedules of :mod:`megatron_ext.layers.p2p.overlap`.

The column function keeps only the input shard for backward and gathers it again under the dgrad
GEMM, as megatron-core does, so its activation memory is megatron-core's; the row function keeps
its (already TP-split) input. :mod:`megatron_ext.layers.symm_mem` holds the same pair over torch's
fused symmetric-memory ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_ext.layers.p2p.link import OverlapGroup
from megatron_ext.layers.p2p.overlap import (
    all_gather_compute,
    compute_reduce_scatter,
    span,
    start_all_gather,
    start_reduce_scatter,
)
from megatron_ext.layers.wgrad import GemmPrecision, LinearContext, save_linear, saved_linear, weight_gradient


class P2PAllGatherLinear(torch.autograd.Function):
    """Fwd: sequence all-gather fused with Y = X W^T, own slice first (CommFuse decomposed AG, TPSP);
    bwd: as megatron-core, X re-gathered under the dgrad GEMM and dgrad reduce-scattered under the
    wgrad GEMM, both P2P. GEMMs: fwd n x [s/n*b, h] x [h, o/n]; bwd dgrad [s*b, o/n] x [o/n, h],
    wgrad [o/n, s*b] x [s*b, h]."""

    @staticmethod
    def forward(
        ctx: LinearContext[OverlapGroup],
        x: torch.Tensor,
        weight: torch.Tensor,
        og: OverlapGroup,
        fuse_wgrad: bool,
    ) -> torch.Tensor:
        n, precision = og.size, GemmPrecision.of(x)
        xc, wc = precision.cast(x), precision.cast(weight)
        out = xc.new_empty((x.shape[0] * n, *x.shape[1:-1], weight.shape[0]))
        with precision.exact():
            all_gather_compute(xc, lambda js, xj: torch.matmul(xj, wc.t(), out=span(out, js, n)), og)
        save_linear(ctx, xc, weight, og, precision, fuse_wgrad)
        return out

    @staticmethod
    def backward(  # type: ignore[override]  # torch declares backward(ctx, *grad_outputs)
        ctx: LinearContext[OverlapGroup], grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        saved = saved_linear(ctx)
        og, precision = saved.group, saved.precision
        g = precision.cast(grad_out).contiguous()
        with precision.exact():
            gathered: Callable[[], torch.Tensor] | None = None
            if saved.want_w:  # at TP=1 the saved input is the whole sequence already
                x = saved.kept()
                gathered = (
                    start_all_gather(x, og, x.new_empty((g.shape[0], *x.shape[1:])))
                    if og.size > 1
                    else lambda: x
                )
            scattered = (
                start_reduce_scatter(torch.matmul(g, precision.cast(saved.weight)), og)
                if saved.want_x
                else None
            )
            grad_w = (
                weight_gradient(g, gathered(), saved.weight, saved.fuse_wgrad)
                if gathered is not None
                else None
            )
            grad_x = scattered() if scattered is not None else None
        return grad_x, grad_w, None, None


class P2PLinearReduceScatter(torch.autograd.Function):
    """Fwd: Y = X W^T fused with the sequence reduce-scatter, own slice last (CommFuse decomposed RS,
    TPSP); bwd: output-gradient all-gather fused with the dgrad GEMM, own slice first, then one wgrad
    GEMM over the gathered gradient (megatron-core gathers first and overlaps nothing). GEMMs: fwd
    n x [s/n*b, i/n] x [i/n, o]; bwd dgrad n x [s/n*b, o] x [o, i/n], wgrad [o, s*b] x [s*b, i/n]."""

    @staticmethod
    def forward(
        ctx: LinearContext[OverlapGroup],
        x: torch.Tensor,
        weight: torch.Tensor,
        og: OverlapGroup,
        fuse_wgrad: bool,
    ) -> torch.Tensor:
        n, precision = og.size, GemmPrecision.of(x)
        xc, wc = precision.cast(x), precision.cast(weight)
        with precision.exact():
            out = compute_reduce_scatter(lambda js: torch.matmul(span(xc, js, n), wc.t()), og)
        save_linear(ctx, xc, weight, og, precision, fuse_wgrad)
        return out

    @staticmethod
    def backward(  # type: ignore[override]  # torch declares backward(ctx, *grad_outputs)
        ctx: LinearContext[OverlapGroup], grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        saved = saved_linear(ctx)
        og, precision, weight = saved.group, saved.precision, saved.weight
        n = og.size
        if not (saved.want_x or saved.want_w):
            return None, None, None, None
        g, wc = precision.cast(grad_out).contiguous(), precision.cast(weight)
        grad_x = g.new_empty((g.shape[0] * n, *g.shape[1:-1], weight.shape[1])) if saved.want_x else None
        gathered = g.new_empty((g.shape[0] * n, *g.shape[1:])) if saved.want_w else None

        def dgrad(js: range, gj: torch.Tensor) -> None:
            if grad_x is not None:
                torch.matmul(gj, wc, out=span(grad_x, js, n))

        with precision.exact():
            all_gather_compute(g, dgrad, og, out=gathered)
            grad_w = (
                weight_gradient(gathered, saved.kept(), weight, saved.fuse_wgrad)
                if gathered is not None
                else None
            )
        return grad_x, grad_w, None, None
