"""DeepSpeed's Domino (``deepspeed.runtime.domino``) as a TP baseline: its own transformer layers,
unmodified, with their all-reduces on the project's P2P exchange so that it shares Flash-Overlap's
transport.

Domino hides TP communication by splitting the micro-batch in two halves along the batch dimension:
while one half's all-reduce (after the attention projection and after fc2, and of the column linears'
input gradients in backward) is in flight, the other half computes. It runs TP without sequence
parallelism, so every rank holds the whole sequence and the all-reduces move 2 (N-1)/N of an
[s, b/2, h] activation each; its default, inter-layer overlap is what is timed (DeepSpeed's example
scripts turn the intra-layer variant on with a flag).

Method in full: benchmarks/results/methods.md, `benchmarks.flash_overlap.domino`.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.distributed as dist

from benchmarks.flash_overlap.blocks import Shapes
from benchmarks.flash_overlap.same_transport import deepspeed_all_reduce_on_p2p

INIT_STD = 0.02
"""Weight init of Domino's linears (megatron's default ``init_method_std``)."""


class _TensorParallel:
    """The two questions Domino asks of megatron's ``mpu``, answered for one TP group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.group.size()

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self.group


def _init(weight: torch.Tensor) -> None:
    torch.nn.init.normal_(weight, std=INIT_STD)


def _scaled_init(layers: int):
    """megatron's output-layer init: std / sqrt(2 layers)."""
    std = INIT_STD / math.sqrt(2 * layers)
    return lambda weight: torch.nn.init.normal_(weight, std=std)


class DominoStack(torch.nn.Module):
    """``layers`` of DeepSpeed's ``DominoTransformer`` at ``shapes`` on the TP ``group``; ``step(x, grad)``
    runs forward and backward of the whole sequence ``x`` [s, b, h] (b even: Domino halves it)."""

    def __init__(self, shapes: Shapes, layers: int, group: dist.ProcessGroup, dtype: torch.dtype) -> None:
        super().__init__()
        if shapes.batch % 2:
            raise ValueError(
                f"Domino splits the micro-batch in two halves: batch {shapes.batch} must be even (--batch)"
            )
        import deepspeed.comm as ds_comm
        from deepspeed.runtime.domino.transformer import DominoTransformer, ModelType

        if not ds_comm.is_initialized():  # Domino's layers call deepspeed.comm
            ds_comm.init_distributed(dist_backend="gloo")
        config = SimpleNamespace(
            num_layers=layers,
            hidden_size=shapes.hidden,
            ffn_hidden_size=shapes.ffn,
            num_attention_heads=shapes.heads,
            kv_channels=shapes.hidden // shapes.heads,
            params_dtype=dtype,
            add_bias_linear=False,
            init_method=_init,
            output_layer_init_method=_scaled_init(layers),
            perform_initialization=True,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            apply_residual_connection_post_layernorm=False,
            layernorm_epsilon=1e-5,
            gated_linear_unit=False,
            domino_intra_layer_overlap=False,
        )
        self.module = DominoTransformer(
            config, _TensorParallel(group), None, ModelType.encoder_or_decoder, post_layer_norm=False
        ).to(dtype)  # its LayerNorms are built in fp32; a bf16 run casts the model, as a user does

    def step(self, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_()
        with deepspeed_all_reduce_on_p2p():
            out = self.module(x, attention_mask=None)
            out.backward(grad)
        return out
