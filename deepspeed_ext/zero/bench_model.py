"""The A/B command's model: a GPT-shaped stack of a Megatron preset's size, and its FLOPs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from deepspeed_ext.zero.cost.workload import Model, Recompute


@dataclass(frozen=True)
class ModelShape:
    """What sets the model's compute and its parameters' sizes."""

    layers: int = 2
    """Transformer layers."""
    hidden: int = 64
    """Hidden size."""
    heads: int = 4
    """Attention heads (hidden must divide by it)."""
    seq_length: int = 32
    """Tokens per sample."""
    vocab: int = 1024
    """Vocabulary size (Megatron pads GPT-2's 50257 to 50304 at TP=1)."""

    def __post_init__(self) -> None:
        bad = {k: v for k, v in vars(self).items() if v < 1}
        if bad or self.hidden % self.heads:
            raise ValueError(
                f"model shape layers={self.layers} hidden={self.hidden} heads={self.heads} "
                f"seq_length={self.seq_length} vocab={self.vocab}: every value >= 1 and hidden divisible by heads"
            )

    @classmethod
    def from_megatron_args(cls, path: str | Path, **defaults: int) -> ModelShape:
        """The shape a Megatron flags file (scripts/presets/*.args) gives; absent flags keep
        ``defaults`` (Megatron pads GPT-2's vocabulary to 50304 when the file gives none)."""
        given = {"layers": cls.layers, "hidden": cls.hidden, "heads": cls.heads, "seq": cls.seq_length}
        model = Model.from_megatron_args(path, **{"vocab": 50304, **given, **_as_model(defaults)})
        return cls(model.layers, model.hidden, model.heads, model.seq, model.vocab)

    def model(self) -> Model:
        """The same GPT as the cost model describes it."""
        return Model(self.layers, self.hidden, self.heads, self.seq_length, self.vocab)


def _as_model(fields: dict[str, int]) -> dict[str, int]:
    return {("seq" if k == "seq_length" else k): v for k, v in fields.items()}


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

    def __init__(self, shape: ModelShape) -> None:
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


def build_model(shape: ModelShape, device: str | torch.device = "cpu") -> nn.Module:
    """The model, initialised alike on every rank (on ``device``; "meta" allocates nothing)."""
    torch.manual_seed(0)
    with torch.device(device):
        return GPT(shape)


def flops_per_step(shape: ModelShape, tokens: int) -> float:
    """Forward and backward FLOPs of ``tokens`` tokens: the cost model's count per sequence
    (Narayanan et al.'s, :meth:`.cost.workload.Model.flops`: 6 x matmul parameters x tokens + 12 x
    layers x hidden x sequence x tokens) times the sequences."""
    return shape.model().flops(1, Recompute.NONE) * tokens / shape.seq_length
