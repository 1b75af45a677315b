"""The ZeRO-3 runs' models: the A/B command's GPT of a Megatron preset's size and its FLOPs, and the
MLP the engine tests and the ZeRO benchmark train."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from deepspeed_ext.zero.cost.workload import Model, Recompute


class Block(nn.Module):
    """Pre-norm attention and MLP, each linear its own module so that ZeRO-3 gathers it by hooks."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        attention = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attention.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class GPT(nn.Module):
    """Embedding, blocks, final norm and an untied output layer: logits [batch, seq, vocab]."""

    def __init__(self, shape: Model) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.hidden)
        self.blocks = nn.ModuleList(Block(shape.hidden, shape.heads) for _ in range(shape.layers))
        self.norm = nn.LayerNorm(shape.hidden)
        self.head = nn.Linear(shape.hidden, shape.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def mlp(widths: Sequence[int], tanh_last: bool = False) -> nn.Sequential:
    """Linear layers from each width to the next, a tanh after each, initialised alike on every rank.

    Args:
        widths: input width, then each layer's output width.
        tanh_last: a tanh after the last layer too.

    Returns:
        The MLP, on the CPU.
    """
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for width_in, width_out in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(width_in, width_out), nn.Tanh()]
    return nn.Sequential(*(layers if tanh_last else layers[:-1]))


def build_model(shape: Model, device: str | torch.device = "cpu") -> nn.Module:
    """The A/B command's GPT, initialised alike on every rank.

    Args:
        shape: the model's size.
        device: where its weights live ("meta" allocates nothing).

    Returns:
        The model.
    """
    torch.manual_seed(0)
    with torch.device(device):
        return GPT(shape)


def flops_per_step(shape: Model, tokens: int) -> float:
    """Forward and backward FLOPs of ``tokens`` tokens (:func:`mdsp_base.gpt_flops.gpt_flops`).

    Args:
        shape: the model.
        tokens: tokens per step, over every rank.

    Returns:
        6 x matmul parameters x tokens + 12 x layers x hidden x sequence x tokens.
    """
    return shape.flops(1, Recompute.NONE) * tokens / shape.seq
