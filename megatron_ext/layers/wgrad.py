"""The Flash-Overlap layers' GEMM precision and weight gradient, as megatron-core computes them.

* :class:`GemmPrecision`: the dtype every GEMM of a forward and its backward runs in (autocast's
  under autocast, else the input's: megatron-core's ``custom_fwd``).
* :func:`weight_gradient`: one wgrad GEMM over the whole sequence, or with
  ``gradient_accumulation_fusion`` accumulated into ``weight.main_grad`` in that buffer's dtype.
* :func:`save_linear` / :func:`saved_linear`: what every Flash-Overlap autograd function keeps from
  forward for backward."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from megatron_ext.layers.autograd_ctx import SavingContext

G = TypeVar("G")
"""The layer's communication group: an OverlapGroup (P2P backend) or a FusedGroup (symm_mem)."""


@dataclass(frozen=True)
class GemmPrecision:
    """The dtype a layer's GEMMs run in, fixed at forward time."""

    dtype: torch.dtype
    """autocast's dtype when autocast is on for the input's device, else the input's dtype."""
    device_type: str
    """Device type of the input (autocast is per device type)."""

    @classmethod
    def of(cls, x: torch.Tensor) -> GemmPrecision:
        device = x.device.type
        return cls(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype, device)

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == self.dtype else t.to(self.dtype)

    def exact(self) -> AbstractContextManager:
        """Autocast off: the GEMMs (some with ``out=``, which autocast cannot cast) run in ``dtype``."""
        return torch.autocast(self.device_type, enabled=False)


def _accumulate(main_grad: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
    """main_grad += g^T x, summed in main_grad's dtype (megatron-core: Apex's wgrad_gemm_accum_fp32)."""
    if main_grad.dtype == g.dtype:
        main_grad.addmm_(g.t(), x)
    elif g.is_cuda:  # 16-bit inputs, fp32 accumulation and output in one GEMM
        main_grad.add_(torch.mm(g.t(), x, out_dtype=main_grad.dtype))
    else:
        main_grad.addmm_(g.t().to(main_grad.dtype), x.to(main_grad.dtype))


def require_main_grad(weight: torch.Tensor, layer: str) -> None:
    """Refuse gradient_accumulation_fusion for a weight without ``main_grad``, at forward time: an
    error in backward would leave the other ranks' transfers unmatched."""
    if getattr(weight, "main_grad", None) is None:
        raise RuntimeError(
            f"layer {layer!r}: gradient_accumulation_fusion is on but the weight has no main_grad: it is set by "
            "megatron-core's DistributedDataParallel (DeepSpeed and plain torch set none); pass "
            "--no-gradient-accumulation-fusion"
        )


def weight_gradient(
    grad_out: torch.Tensor, total_input: torch.Tensor, weight: torch.Tensor, fuse: bool
) -> torch.Tensor | None:
    """dW = G^T X over all tokens ([out, s*b] x [s*b, in]), or, with ``fuse``, accumulated into
    ``weight.main_grad``; then the return is a placeholder (zeros when ``weight.zero_out_wgrad``)
    where megatron-core's DDP marks ``grad_added_to_main_grad``, else None."""
    g = grad_out.reshape(-1, grad_out.shape[-1])
    x = total_input.reshape(-1, total_input.shape[-1])
    if not fuse:
        return g.t().matmul(x)
    main_grad = weight.main_grad  # type: ignore[attr-defined]  # checked by require_main_grad before any transfer was posted
    _accumulate(main_grad, g, x)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(main_grad.shape, dtype=g.dtype, device=g.device)


class LinearContext(SavingContext, Protocol[G]):
    """The attributes :func:`save_linear` sets on a Flash-Overlap autograd function's context."""

    group: G
    precision: GemmPrecision
    fuse_wgrad: bool


@dataclass(frozen=True)
class SavedLinear(Generic[G]):
    """What a Flash-Overlap linear's backward reads, as its forward saved it."""

    activation: torch.Tensor | None
    """The tensor the wgrad GEMM needs (None for a frozen weight)."""
    weight: torch.Tensor
    group: G
    """The layer's communication group."""
    precision: GemmPrecision
    fuse_wgrad: bool
    want_x: bool
    """The input needs a gradient."""
    want_w: bool
    """The weight needs a gradient."""

    def kept(self) -> torch.Tensor:
        """The activation, where the weight takes a gradient (the only case it is read)."""
        if self.activation is None:
            raise RuntimeError("a frozen weight's layer kept no activation: its wgrad is not computed")
        return self.activation


def save_linear(
    ctx: LinearContext[G],
    activation: torch.Tensor | None,
    weight: torch.Tensor,
    group: G,
    precision: GemmPrecision,
    fuse_wgrad: bool,
) -> None:
    """Forward's half of every Flash-Overlap autograd function: ``activation`` is kept only where the
    weight takes a gradient (a frozen weight needs no wgrad, as in megatron-core's frozen path)."""
    ctx.save_for_backward(activation if weight.requires_grad else None, weight)
    ctx.group, ctx.precision, ctx.fuse_wgrad = group, precision, fuse_wgrad


def saved_linear(ctx: LinearContext[G]) -> SavedLinear[G]:
    """Backward's half: what :func:`save_linear` kept, and which gradients are wanted."""
    activation, weight = ctx.saved_tensors
    return SavedLinear(
        activation,
        weight,
        ctx.group,
        ctx.precision,
        ctx.fuse_wgrad,
        ctx.needs_input_grad[0],
        ctx.needs_input_grad[1],
    )
