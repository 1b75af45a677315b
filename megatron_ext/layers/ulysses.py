"""Ulysses sequence parallelism with its all-to-alls decomposed and overlapped with the projections
around attention (Flash-Overlap's UP case, arXiv 2604.24013).

DeepSpeed-Ulysses' ``DistributedAttention`` waits for each all-to-all before the GEMM after it. Here
the block owns both projections: QKV (:class:`_QKVAllToAll`) is computed per destination head group
and each group sent when ready; the output projection (:class:`_AllToAllOutput`) consumes each
context block as it arrives. Numerics are ``DistributedAttention``'s up to the order of the output
projection's sums. Layout: Megatron's [s, b, ...]; the QKV weight is [q | k | v] or group-major
(:class:`HeadSplit`). Schedules, weight layouts and launch counts: docs/flash_overlap.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from megatron_ext.layers.autograd_ctx import SavingContext
from megatron_ext.layers.p2p.all_to_all import all_to_all_compute, compute_all_to_all
from megatron_ext.layers.p2p.link import OverlapGroup


@dataclass(frozen=True)
class HeadSplit:
    """How the attention heads split over the ``ranks`` of the sequence-parallel group."""

    heads: int
    """Query heads of the layer."""
    kv_heads: int
    """Key/value heads (fewer than ``heads`` with grouped-query attention)."""
    head_dim: int
    """Channels per head."""
    ranks: int
    """Ranks of the sequence-parallel group."""
    group_major: bool = False
    """QKV weight rows grouped by destination rank ([q0 k0 v0 | q1 k1 v1 | ...]: one GEMM per
    group) instead of Megatron-DeepSpeed's [q heads | k heads | v heads] (three per group)."""

    def __post_init__(self) -> None:
        problems = [
            f"{name}={value} is not divisible by {by_name}={by}"
            for name, value, by_name, by in (
                ("heads", self.heads, "sequence-parallel size", self.ranks),
                ("kv_heads", self.kv_heads, "sequence-parallel size", self.ranks),
                ("heads", self.heads, "kv_heads", self.kv_heads),
            )
            if value % by
        ]
        if problems:
            raise ValueError(
                f"Ulysses attention with heads={self.heads}, kv_heads={self.kv_heads}, sequence-parallel size "
                f"{self.ranks}: {'; '.join(problems)}. Each rank takes whole query heads with their key/value "
                "heads: choose a sequence-parallel size that divides both head counts"
            )

    def qkv_rows(self, group: int) -> tuple[slice, slice, slice]:
        """Rows of Megatron-DeepSpeed's [q | k | v] QKV weight that produce head group ``group``'s
        q, k and v (contiguous each, so the per-group GEMMs read views of the weight)."""
        q, kv, d = (
            self.heads // self.ranks * self.head_dim,
            self.kv_heads // self.ranks * self.head_dim,
            self.head_dim,
        )
        starts = (group * q, self.heads * d + group * kv, (self.heads + self.kv_heads) * d + group * kv)
        return cast(tuple[slice, slice, slice], tuple(slice(a, a + n) for a, n in zip(starts, (q, kv, kv))))

    def qkv_blocks(self, group: int) -> list[tuple[slice, slice]]:
        """(rows of this split's QKV weight, columns of the group's [q | k | v] block) per GEMM that
        produces head group ``group``: one pair when the weight is group-major, else three."""
        if self.group_major:
            width = (self.heads + 2 * self.kv_heads) // self.ranks * self.head_dim
            return [(slice(group * width, (group + 1) * width), slice(0, width))]
        return list(zip(self.qkv_rows(group), self.block_columns()))

    def group_major_order(self) -> torch.Tensor:
        """Row indices that take a [q | k | v] QKV weight (or bias) to the group-major layout:
        ``group_major = standard[order]``, ``standard = group_major[order.argsort()]``."""
        return torch.cat([torch.arange(r.start, r.stop) for g in range(self.ranks) for r in self.qkv_rows(g)])

    def block_columns(self) -> tuple[slice, slice, slice]:
        """Columns of one rank's QKV block that hold its q, k and v."""
        q, kv = self.heads // self.ranks * self.head_dim, self.kv_heads // self.ranks * self.head_dim
        return slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)

    def context_columns(self, group: int) -> slice:
        """Columns of the output weight that take head group ``group``'s context."""
        width = self.heads // self.ranks * self.head_dim
        return slice(group * width, (group + 1) * width)

    def split(self, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[s, b, width] -> q [s, b, heads/n, d], k and v [s, b, kv_heads/n, d] (views)."""
        q, kv = self.heads // self.ranks, self.kv_heads // self.ranks
        s, b, d = full.shape[0], full.shape[1], self.head_dim
        return (
            full[..., : q * d].view(s, b, q, d),
            full[..., q * d : (q + kv) * d].view(s, b, kv, d),
            full[..., (q + kv) * d :].view(s, b, kv, d),
        )


def _sequence_blocks(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``t`` [s, ...] cut into n blocks of s/n rows (views)."""
    return list(t.chunk(n, dim=0))


def _matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` ([..., k] x [k, m]) for 16-bit operands, summed and returned in fp32, so that the
    partial products UP adds up per head group are rounded once, after the last one, as one GEMM
    rounds them: straight from the GEMM's accumulator (``out_dtype``, one 16-bit GEMM) wherever
    the backend has that GEMM, else (torch's CPU kernels) on operands made fp32."""
    a2d = a.reshape(-1, a.shape[-1])
    return _mm_into_fp32(a2d, b).view(*a.shape[:-1], b.shape[-1])


def _mm_into_fp32(a2d: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    try:  # CUDA and ROCm have the kernel, and so does a dispatch mode in front of the CPU (an emulated device)
        return torch.mm(a2d, b, out_dtype=torch.float32)
    except NotImplementedError:  # torch's CPU kernels do not
        return a2d.float() @ b.float()


def _sums_in_fp32(t: torch.Tensor) -> bool:
    return t.dtype in (torch.bfloat16, torch.float16)


class _HeadsContext(SavingContext):
    """What the two Ulysses functions keep on their autograd context."""

    split: HeadSplit
    og: OverlapGroup
    has_bias: bool


class _QKVAllToAll(torch.autograd.Function):
    """Fwd: QKV projection per destination head group, remote groups first, each sent when ready
    (UP, sec. decomposed all-to-all); bwd: gradient blocks consumed as they arrive (dgrad and wgrad
    per head group, the dgrads summed in fp32 for 16-bit activations). GEMMs on views of the weight,
    one per group if it is group-major, else one each for q, k and v: fwd n x [s/n*b, h] x [h, w/n];
    bwd n x ([s/n*b, w/n] x [w/n, h] and [w/n, s/n*b] x [s/n*b, h]); w = (heads + 2 kv_heads) * head_dim."""

    @staticmethod
    def forward(
        ctx: _HeadsContext,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        split: HeadSplit,
        og: OverlapGroup,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.split, ctx.og, ctx.has_bias = split, og, bias is not None

        def project(j: int) -> torch.Tensor:
            parts = [
                F.linear(x, weight[rows], None if bias is None else bias[rows])
                for rows, _ in split.qkv_blocks(j)
            ]
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

        return torch.cat(compute_all_to_all(project, og), dim=0)  # block i: rank i's tokens

    @staticmethod
    def backward(ctx: _HeadsContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]  # torch declares backward(ctx, *grad_outputs)
        x, weight = ctx.saved_tensors
        split, og = ctx.split, ctx.og
        wide = _sums_in_fp32(x)  # n (or 3n) dgrad products add up to grad_x: in fp32, rounded once
        grad_x = torch.zeros_like(x, dtype=torch.float32 if wide else x.dtype)
        grad_w = torch.empty_like(weight)  # every row is written: each group's rows, once
        grad_b = (
            torch.empty(weight.shape[0], dtype=weight.dtype, device=weight.device) if ctx.has_bias else None
        )
        x2d = x.reshape(-1, x.shape[-1])

        def consume(group: int, g: torch.Tensor) -> None:
            g2d = g.reshape(-1, g.shape[-1])
            for rows, columns in split.qkv_blocks(group):
                grad_x.add_(
                    _matmul_fp32(g[..., columns], weight[rows]) if wide else g[..., columns] @ weight[rows]
                )
                torch.matmul(g2d[:, columns].t(), x2d, out=grad_w[rows])
                if grad_b is not None:
                    torch.sum(g2d[:, columns], dim=0, out=grad_b[rows])

        all_to_all_compute(_sequence_blocks(grad.contiguous(), og.size), consume, og)
        return grad_x.to(x.dtype), grad_w, grad_b, None, None


class _AllToAllOutput(torch.autograd.Function):
    """Fwd: context slices posted at once, each fed to the output projection as it arrives, own first,
    the products summed in fp32 for 16-bit activations (UP, sec. decomposed all-to-all); bwd: dgrad per destination head group, remote first, sent when
    ready, with the wgrad GEMM under the transfers. GEMMs: fwd n x [s/n*b, c/n] x [c/n, h]; bwd
    n x [s/n*b, h] x [h, c/n] and [h, s/n*b] x [s/n*b, c]; c = heads * head_dim."""

    @staticmethod
    def forward(
        ctx: _HeadsContext, context: torch.Tensor, weight: torch.Tensor, split: HeadSplit, og: OverlapGroup
    ) -> torch.Tensor:
        received: list[torch.Tensor | None] = [None] * og.size
        out: list[torch.Tensor] = []
        wide = _sums_in_fp32(context)  # the n head groups' products add up in fp32, rounded once

        def project(group: int, block: torch.Tensor) -> None:
            received[group] = block
            w = weight[:, split.context_columns(group)]
            partial = _matmul_fp32(block, w.t()) if wide else F.linear(block, w)
            if out:
                out[0].add_(partial)
            else:
                out.append(partial)

        all_to_all_compute(_sequence_blocks(context.contiguous(), og.size), project, og)
        # [s/n, b, c]: the gathered context (every group's block has arrived)
        ctx.save_for_backward(torch.cat(cast(list[torch.Tensor], received), dim=-1), weight)
        ctx.split, ctx.og = split, og
        return out[0].to(context.dtype)

    @staticmethod
    def backward(ctx: _HeadsContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]  # torch declares backward(ctx, *grad_outputs)
        gathered, weight = ctx.saved_tensors
        split, og = ctx.split, ctx.og
        grad = grad.contiguous()
        grad_w: list[torch.Tensor] = []

        def dgrad(group: int) -> torch.Tensor:
            if group == og.rank:  # computed last: the weight gradient runs under the last transfers
                g2d = grad.reshape(-1, grad.shape[-1])
                grad_w.append(g2d.t() @ gathered.reshape(-1, gathered.shape[-1]))
            return grad @ weight[:, split.context_columns(group)]

        grad_context = torch.cat(compute_all_to_all(dgrad, og), dim=0)
        return grad_context, grad_w[0], None, None


LocalAttention = Callable[..., torch.Tensor]
"""(q [s, b, heads/n, d], k, v [s, b, kv_heads/n, d], *args) -> context [s, b, heads/n * d] (or
[s, b, heads/n, d]): attention over the whole sequence for this rank's heads, e.g. Megatron's
CoreAttention or the ``local_attention`` a DistributedAttention wraps."""


def ulysses_attention(
    hidden: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    output_weight: torch.Tensor,
    local_attention: LocalAttention,
    split: HeadSplit,
    og: OverlapGroup,
    *args: object,
) -> torch.Tensor:
    """Self-attention of this rank's tokens over the whole sequence: QKV projection, local attention
    of this rank's heads, output projection without its bias (Megatron's ``skip_bias_add``).

    Args:
        hidden (torch.Tensor): [s/n, b, h], this rank's tokens.
        qkv_weight (torch.Tensor): [(heads + 2 kv_heads) * head_dim, h], laid out as ``split`` says.
        qkv_bias (torch.Tensor, optional): the QKV bias, in the weight's row layout.
        output_weight (torch.Tensor): [h, heads * head_dim].
        local_attention (LocalAttention): called as ``local_attention(q, k, v, *args)``.
        split (HeadSplit): the heads and their split over the sequence-parallel group.
        og (OverlapGroup): the sequence-parallel group.
        *args: passed on to ``local_attention`` (e.g. the attention mask).

    Returns:
        torch.Tensor: [s/n, b, h].

    Raises:
        ValueError: ``split`` is for another number of ranks than the group's.
    """
    if split.ranks != og.size:
        raise ValueError(f"the head split is for {split.ranks} ranks but the sequence group has {og.size}")
    full = _QKVAllToAll.apply(hidden, qkv_weight, qkv_bias, split, og)
    context = local_attention(*split.split(full), *args)
    context = context.reshape(context.shape[0], context.shape[1], -1)
    return _AllToAllOutput.apply(context, output_weight, split, og)


def check_sequence_length(seq_length: int, ranks: int) -> None:
    """Refuse a sequence the group cannot split into equal blocks, naming both numbers."""
    if seq_length % ranks:
        raise ValueError(
            f"sequence length {seq_length} is not divisible by the sequence-parallel size {ranks}: every rank "
            f"holds an equal block of tokens; use a --seq-length that is a multiple of {ranks}"
        )
