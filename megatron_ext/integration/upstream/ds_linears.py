"""Flash-Overlap's TP/SP linears inside Megatron-DeepSpeed's legacy GPT (commit 4efb479).

The tree's transformer layer builds its own ``ColumnParallelLinear`` / ``RowParallelLinear``. The
patch gives each a ``flash_overlap`` attribute (None: the tree's forward) and calls
:func:`overlap_linears` at the end of ``ParallelTransformerLayer.__init__``; with ``--flash-overlap``
and ``--sequence-parallel`` at TP > 1 it sets that attribute on the attention's QKV and output
linears and the MLP's fc1 and fc2, whose forward then runs Flash-Overlap's schedules on the module's
own weight and bias. Constructor, parameters and checkpoint layout stay the tree's. What is refused
or left stock: docs/integration.md."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from megatron_ext.integration.upstream.hooks import own_posters, plugin_config
from megatron_ext.layers.config import LayerName
from megatron_ext.layers.p2p.linear import P2PAllGatherLinear, P2PLinearReduceScatter
from megatron_ext.layers.p2p.link import OverlapGroup, check_nccl_waits, run_device

__all__ = ["overlap_linears"]

logger = logging.getLogger(__name__)

# The tree's attribute of each replaceable linear, per module class: (attribute, name, column?).
LINEARS: dict[str, tuple[tuple[str, LayerName, bool], ...]] = {
    "ParallelAttention": (("query_key_value", LayerName.QKV, True), ("dense", LayerName.PROJ, False)),
    "ParallelMLP": (("dense_h_to_4h", LayerName.FC1, True), ("dense_4h_to_h", LayerName.FC2, False)),
}

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


class _TreeLinear(Protocol):
    """What the overlapped forward reads of the tree's Column/RowParallelLinear."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    skip_bias_add: bool


def _column(linear: _TreeLinear, og: OverlapGroup) -> Forward:
    """The tree's ColumnParallelLinear.forward at SP: sequence all-gather fused with Y = X W^T."""

    def forward(
        input_: torch.Tensor, weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight = linear.weight if weight is None else weight
        output = P2PAllGatherLinear.apply(input_, weight, og, False)  # False: no main_grad fusion
        if linear.skip_bias_add:
            return output, linear.bias
        return (output if linear.bias is None else output + linear.bias), None

    return forward


def _row(linear: _TreeLinear, og: OverlapGroup) -> Forward:
    """The tree's RowParallelLinear.forward at SP: Y = X W^T fused with the sequence reduce-scatter."""

    def forward(input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if input_.shape[0] % og.size:
            raise ValueError(
                f"layer {og.name!r}: sequence length {input_.shape[0]} is not divisible by the "
                f"tensor-parallel size {og.size}: pad the sequence to a multiple of {og.size}"
            )
        output = P2PLinearReduceScatter.apply(input_, linear.weight, og, False)  # no main_grad fusion
        if linear.skip_bias_add:
            return output, linear.bias
        return (output if linear.bias is None else output + linear.bias), None

    return forward


def overlap_linears(layer: torch.nn.Module) -> None:
    """Give a ``ParallelTransformerLayer``'s TP linears (its self-attention's and dense MLP's) Flash-
    Overlap's forward where ``flash_overlap`` is on and TP > 1; leave and log the rest (expert MLPs,
    cross-attention, FPDT's chunked attention)."""
    from megatron.core import parallel_state

    overlap = plugin_config().flash_overlap
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if not overlap.enabled or tp == 1:
        return
    own_posters()
    group = parallel_state.get_tensor_model_parallel_group()
    replaced, stock = [], []
    for role, module in (("attention", layer.self_attention), ("mlp", layer.mlp)):
        kind = type(module).__name__
        if kind not in LINEARS:  # SwitchMLP, DeepSpeed's MoE, FPDT's attention
            stock.append(f"{role} ({kind})")
            continue
        for attribute, name, column in LINEARS[kind]:
            if name not in overlap.layers:
                stock.append(f"{role}.{attribute} (not in flash_overlap.layers)")
                continue
            linear = getattr(module, attribute)
            if getattr(linear, "gather_output", False):  # the overlapped column keeps its output split
                stock.append(f"{role}.{attribute} (gather_output)")
                continue
            og = OverlapGroup(
                group,
                overlap.mode,
                overlap.timeout_s,
                f"layer {layer.layer_number} {name.value}",
                compute_slices=overlap.compute_slices,
            )
            check_nccl_waits(og, run_device(linear.weight))
            linear.flash_overlap = _column(linear, og) if column else _row(linear, og)
            replaced.append(f"{role}.{attribute} ({name.value})")
    if hasattr(layer, "inter_attention"):
        stock.append("inter_attention (cross-attention)")
    if layer.layer_number == 1:
        logger.info(
            "flash_overlap: TP/SP linears overlapped over %d ranks (%s P2P) in each transformer layer: %s; "
            "left stock: %s",
            tp,
            overlap.mode.value,
            ", ".join(replaced) or "none",
            ", ".join(stock + ["the LM head (outside the layers)"]),
        )
