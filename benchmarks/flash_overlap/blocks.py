"""The blocks the benchmark times, built from megatron-core's GPT layer spec with one linear class pair
swapped per method, and a compute-only twin of the same per-rank GEMM shapes.

Method in full: benchmarks/results/methods.md, `benchmarks.flash_overlap.blocks`.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from benchmarks.flash_overlap.chunked import ChunkedColumnParallelLinear, ChunkedRowParallelLinear
from benchmarks.flash_overlap.fused_attention import FusedDotProductAttention
from benchmarks.flash_overlap.same_transport import megatron_core_on_p2p, megatron_core_without_communication
from benchmarks.flash_overlap.te_split import TESplitColumnParallelLinear, TESplitRowParallelLinear
from megatron_ext.integration.gpt import causal_mask, local_layer_spec
from megatron_ext.layers.config import FlashOverlapConfig
from megatron_ext.layers.spec import get_flash_overlap_layer_spec

BLOCKS = ("mlp", "layer", "layers")
"""The MLP alone, one transformer layer, or a stack of ``Shapes.layers`` layers."""
METHODS = (
    "megatron_core",
    "chunked_4",
    "flash_overlap",
    "flash_overlap_merged",
    "megatron_core_p2p",
    "te_split_p2p",
    "domino_p2p",
)
WHOLE_SEQUENCE = ("domino_p2p",)
"""Methods whose ranks hold the whole sequence (TP without sequence parallelism), not a 1/N shard."""
_COLLECTIVES = {
    "megatron_core_p2p": megatron_core_on_p2p,
    "compute_only": megatron_core_without_communication,
}
"""What megatron-core's collectives become in a method's step (the others keep their own)."""


@dataclass(frozen=True)
class Shapes:
    """Sizes of the timed block."""

    seq: int
    """Whole sequence length s (each rank holds s/N under sequence parallelism)."""
    batch: int
    """Micro-batch size b."""
    hidden: int
    """Hidden size h."""
    heads: int
    """Attention heads (a multiple of the TP size)."""
    ffn: int
    """MLP width f (a multiple of the TP size)."""
    layers: int = 1
    """Layers of the ``layers`` block."""


def _config(shapes: Shapes, tp: int, dtype: torch.dtype) -> TransformerConfig:
    return TransformerConfig(
        num_layers=shapes.layers,
        hidden_size=shapes.hidden,
        num_attention_heads=shapes.heads,
        kv_channels=shapes.hidden // shapes.heads,
        ffn_hidden_size=shapes.ffn,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
    )


def _layer_spec(method: str, compute_slices: int) -> ModuleSpec:
    """The method's layer spec, its core attention the fused kernel a GPU runs (``fused_attention``);
    ``flash_overlap_merged`` is Flash-Overlap with ``compute_slices`` GEMMs per collective."""
    ours = method in ("flash_overlap", "flash_overlap_merged")
    if ours:
        merged = compute_slices if method == "flash_overlap_merged" else 0
        config = FlashOverlapConfig(enabled=True, backend="p2p", compute_slices=merged)
        spec = get_flash_overlap_layer_spec(config)
    else:
        spec = local_layer_spec()
    spec.submodules.self_attention.submodules.core_attention = FusedDotProductAttention
    if ours:
        return spec
    swapped = {
        "chunked_4": (ChunkedColumnParallelLinear, ChunkedRowParallelLinear),
        "te_split_p2p": (TESplitColumnParallelLinear, TESplitRowParallelLinear),
    }
    if method in swapped:
        column, row = swapped[method]
        spec.submodules.self_attention.submodules.linear_qkv = column
        spec.submodules.self_attention.submodules.linear_proj = row
        spec.submodules.mlp.submodules.linear_fc1 = column
        spec.submodules.mlp.submodules.linear_fc2 = row
    return spec


class Block(torch.nn.Module):
    """One method's block; ``step(x)`` runs forward and backward and returns the output."""

    def __init__(
        self,
        block: str,
        method: str,
        shapes: Shapes,
        group: dist.ProcessGroup,
        tp: int,
        dtype: torch.dtype = torch.float32,
        compute_slices: int = 0,
    ) -> None:
        """``group``: the TP group of size ``tp``; ``dtype``: of the weights (bf16 on a stand-in
        device, as GPUs train); ``compute_slices``: GEMMs per collective of ``flash_overlap_merged``.
        ``compute_only``: megatron-core's layers whose collectives move nothing, the compute-only
        twin of every method."""
        super().__init__()
        if method == "domino_p2p":
            raise ValueError("domino_p2p is its own module: benchmarks.flash_overlap.domino.DominoStack")
        config = _config(shapes, tp, dtype)
        spec = copy.deepcopy(
            _layer_spec("megatron_core" if method == "compute_only" else method, compute_slices)
        )
        # megatron-core's own layers with their collectives swapped for the step only
        self.collectives = _COLLECTIVES.get(method, contextlib.nullcontext)
        if block == "mlp":
            self.module = build_module(spec.submodules.mlp, config=config, tp_group=group)
            self.mask = None
        else:
            layers = shapes.layers if block == "layers" else 1
            self.module = torch.nn.Sequential(*(
                build_module(spec, config=config, layer_number=i + 1, pg_collection=_pgs(group))
                for i in range(layers)
            ))  # fmt: skip
            self.mask = causal_mask(shapes.seq, "cpu")
        self.block = block

    def step(self, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_()
        with self.collectives():
            if self.block == "mlp":
                out, _ = self.module(x)
            else:
                out = x
                for layer in self.module:
                    out, _ = layer(out, attention_mask=self.mask)
            out.backward(grad)
        return out


def _pgs(tp: dist.ProcessGroup):
    """megatron-core's process-group collection with ``tp`` as the tensor-parallel group."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.tp = tp
    return pgs
