"""The ``symm_mem`` backend of the Flash-Overlap linears: torch's symmetric-memory fused
all-gather + GEMM and GEMM + reduce-scatter, paired into autograd functions.

torch's ``fused_all_gather_matmul`` and ``fused_matmul_reduce_scatter`` are forward-only, so each
is the other's backward here. No op gathers without a GEMM to hide it under, so the column layers
keep the gathered input for backward (TP times the shard that p2p and megatron-core keep): hence
p2p is the default and this backend an opt-in (:mod:`megatron_ext.layers.backend`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from megatron_ext.layers.wgrad import GemmPrecision, LinearContext, save_linear, saved_linear, weight_gradient

AllGatherMatmul = Callable[..., tuple[torch.Tensor | None, list[torch.Tensor]]]
"""(A_shard, [B, ...], gather_dim, group_name, *, return_A) -> (gathered A or None, [A @ B, ...])."""
MatmulReduceScatter = Callable[[torch.Tensor, torch.Tensor, str, int, str], torch.Tensor]
"""(A, B, reduce_op, scatter_dim, group_name) -> this rank's part of reduce_scatter(A @ B)."""


@dataclass(frozen=True)
class FusedOps:
    """The two fused collective GEMMs the symm_mem layers call (:func:`torch_fused_ops`, or
    :func:`torch_reference_ops` where symmetric memory does not exist)."""

    all_gather_matmul: AllGatherMatmul
    matmul_reduce_scatter: MatmulReduceScatter


def torch_fused_ops() -> FusedOps:
    """torch's symmetric-memory ops (importing the module registers ``torch.ops.symm_mem``)."""
    import torch.distributed._symmetric_memory

    return FusedOps(
        torch.ops.symm_mem.fused_all_gather_matmul, torch.ops.symm_mem.fused_matmul_reduce_scatter
    )


def torch_reference_ops() -> FusedOps:
    """torch's reference implementations of the same two ops (their meta kernels, built from
    functional collectives): they run over any backend, gloo included, and return what the fused
    ops return, so they stand in for them where symmetric memory does not exist (CPU checks and
    measurements)."""
    from torch.distributed._symmetric_memory import (
        _fused_all_gather_matmul_fallback,
        _fused_matmul_reduce_scatter_fallback,
    )

    # torch types its group_name GroupName, a NewType of the str the layers pass
    return FusedOps(
        _fused_all_gather_matmul_fallback, cast(MatmulReduceScatter, _fused_matmul_reduce_scatter_fallback)
    )


@dataclass(frozen=True)
class FusedGroup:
    """Where the fused ops run: the TP group's name, its size, the ops, the layer name for errors."""

    group_name: str
    size: int
    ops: FusedOps
    name: str = "flash_overlap"


class SymmMemAllGatherLinear(torch.autograd.Function):
    """Fwd: fused sequence all-gather + Y = X W^T, keeping the gathered X; bwd: dgrad GEMM fused with
    the sequence reduce-scatter, then wgrad over the kept X. GEMMs: fwd n x [s/n*b, h] x [h, o/n];
    bwd dgrad n x [s/n*b, o/n] x [o/n, h], wgrad [o/n, s*b] x [s*b, h]."""

    @staticmethod
    def forward(
        ctx: LinearContext[FusedGroup],
        x: torch.Tensor,
        weight: torch.Tensor,
        fg: FusedGroup,
        fuse_wgrad: bool,
    ) -> torch.Tensor:
        precision = GemmPrecision.of(x)
        keep = weight.requires_grad  # frozen weights need no wgrad, hence no gathered input
        with precision.exact():
            gathered, (out,) = fg.ops.all_gather_matmul(
                precision.cast(x).contiguous(), [precision.cast(weight).t()], 0, fg.group_name, return_A=keep
            )
        # The gathered input costs n times the shard's memory until backward; the P2P path keeps the
        # shard and gathers again under the dgrad GEMM, which torch's forward-only ops cannot do.
        save_linear(ctx, gathered, weight, fg, precision, fuse_wgrad)
        return out

    @staticmethod
    def backward(  # type: ignore[override]  # torch declares backward(ctx, *grad_outputs)
        ctx: LinearContext[FusedGroup], grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        saved = saved_linear(ctx)
        fg, precision = saved.group, saved.precision
        g = precision.cast(grad_out).contiguous()
        with precision.exact():
            grad_x = (
                fg.ops.matmul_reduce_scatter(g, precision.cast(saved.weight), "sum", 0, fg.group_name)
                if saved.want_x
                else None
            )
            grad_w = (
                weight_gradient(g, saved.kept(), saved.weight, saved.fuse_wgrad) if saved.want_w else None
            )
        return grad_x, grad_w, None, None


class SymmMemLinearReduceScatter(torch.autograd.Function):
    """Fwd: Y = X W^T fused with the sequence reduce-scatter; bwd: output-gradient all-gather fused
    with the dgrad GEMM, then one wgrad GEMM over the gathered gradient. GEMMs: fwd
    n x [s/n*b, i/n] x [i/n, o]; bwd dgrad n x [s/n*b, o] x [o, i/n], wgrad [o, s*b] x [s*b, i/n]."""

    @staticmethod
    def forward(
        ctx: LinearContext[FusedGroup],
        x: torch.Tensor,
        weight: torch.Tensor,
        fg: FusedGroup,
        fuse_wgrad: bool,
    ) -> torch.Tensor:
        precision = GemmPrecision.of(x)
        xc = precision.cast(x).contiguous()
        with precision.exact():
            out = fg.ops.matmul_reduce_scatter(xc, precision.cast(weight).t(), "sum", 0, fg.group_name)
        save_linear(ctx, xc, weight, fg, precision, fuse_wgrad)
        return out

    @staticmethod
    def backward(  # type: ignore[override]  # torch declares backward(ctx, *grad_outputs)
        ctx: LinearContext[FusedGroup], grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        saved = saved_linear(ctx)
        fg, precision = saved.group, saved.precision
        if not (saved.want_x or saved.want_w):
            return None, None, None, None
        g = precision.cast(grad_out).contiguous()
        with precision.exact():
            # One fused op gathers the gradient for both: its dgrad is dropped when only wgrad is wanted.
            gathered, (grad_x,) = fg.ops.all_gather_matmul(
                g, [precision.cast(saved.weight)], 0, fg.group_name, return_A=saved.want_w
            )
            grad_w = (
                weight_gradient(gathered, saved.kept(), saved.weight, saved.fuse_wgrad)
                if gathered is not None  # returned where the weight wants a gradient
                else None
            )
        return (grad_x if saved.want_x else None), grad_w, None, None
