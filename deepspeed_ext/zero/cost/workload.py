"""What a projection is of: the machine, the GPT and DeepSpeed's ZeRO-3 buckets (from its JSON)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from deepspeed_ext.zero.cost.collectives import CollectiveCosts
from mdsp_base.gpt_flops import gpt_flops


class Recompute(StrEnum):
    """Activation recomputation (Korthikanti et al., arXiv 2205.05198)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


@dataclass(frozen=True)
class System:
    """A machine: ranks per node and package, peak compute, memory, collective costs."""

    costs: CollectiveCosts
    """Collective costs (documented, published or measured by the probe)."""
    ranks_per_node: int = 8
    """GPUs (GCDs) per node."""
    ranks_per_package: int = 2
    """GCDs per package (MI250X: 2)."""
    peak_tflops: float = 191.5
    """Dense bf16 peak per GCD (MI250X: 383 per module)."""
    memory_gb: float = 64.0
    """Memory per GCD."""
    gemm_efficiency: float = 0.4
    """Fraction of ``peak_tflops`` the model's GEMMs reach (an assumption; the projection sweeps
    0.3-0.6)."""
    overlap: float = 0.0
    """Fraction of the communication hidden behind compute (an assumption; the projection sweeps
    0, 0.5 and 0.9)."""


# Megatron flag -> Model field
MEGATRON_FLAGS = {
    "--num-layers": "layers",
    "--hidden-size": "hidden",
    "--num-attention-heads": "heads",
    "--seq-length": "seq",
    "--vocab-size": "vocab",
}


@dataclass(frozen=True)
class Model:
    """A GPT and how it is trained."""

    layers: int
    """Transformer layers."""
    hidden: int
    """Hidden size."""
    heads: int
    """Attention heads."""
    seq: int
    """Sequence length."""
    vocab: int = 50432
    """Vocabulary (input and output embeddings untied; Megatron pads GPT-2's 50257 to 50304 at TP=1)."""

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.heads, self.seq, self.vocab) < 1 or self.hidden % self.heads:
            raise ValueError(
                f"model layers={self.layers} hidden={self.hidden} heads={self.heads} seq={self.seq} "
                f"vocab={self.vocab}: every value >= 1 and hidden divisible by heads"
            )

    @classmethod
    def from_megatron_args(cls, path: str | Path, **defaults: int) -> Model:
        """The GPT a Megatron flags file (scripts/presets/*.args) gives; a flag it lacks takes
        ``defaults`` (by field name), and one without a default is refused by name."""
        words = shlex.split(Path(path).read_text(), comments=True)
        values = dict(defaults)
        for flag, name in MEGATRON_FLAGS.items():
            if flag in words:
                values[name] = int(words[words.index(flag) + 1])
        missing = [flag for flag, name in MEGATRON_FLAGS.items() if name not in values and name != "vocab"]
        if missing:
            raise ValueError(f"{path} lacks {', '.join(missing)}: add them to the file or give them as flags")
        return cls(**values)

    @property
    def params(self) -> int:
        h = self.hidden
        return self.layers * (12 * h * h + 13 * h) + 2 * self.vocab * h

    def modules(self, tp: int) -> list[int]:
        """Elements of each gathered module on one TP rank: QKV, projection, fc1, fc2, embeddings."""
        h = self.hidden
        return [3 * h * h // tp, h * h // tp, 4 * h * h // tp, 4 * h * h // tp] * self.layers + [
            self.vocab * h // tp
        ] * 2

    def flops(self, micro_batch: int, recompute: Recompute) -> float:
        """Forward + backward FLOPs of one micro-batch (Narayanan et al., arXiv 2104.04473, eq. 3
        without recomputation; full recomputation adds a forward, selective its attention scores)."""
        h, s, n = self.hidden, self.seq, self.layers
        base = gpt_flops(micro_batch, s, n, h, self.vocab)
        extra = {Recompute.NONE: 0.0, Recompute.SELECTIVE: 4 * micro_batch * s * s * h * n}
        return base * 4 / 3 if recompute == Recompute.FULL else base + extra[recompute]

    def activation_bytes(self, micro_batch: int, tp: int, recompute: Recompute) -> float:
        """Activation memory per rank (Korthikanti et al., arXiv 2205.05198, Table 2, tensor
        parallel without sequence parallelism: sbh(10 + 24/t + 5as/(ht)) per layer)."""
        s, b, h, a = self.seq, micro_batch, self.hidden, self.heads
        per_layer = {
            Recompute.NONE: s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)),
            Recompute.SELECTIVE: s * b * h * (10 + 24 / tp),
            Recompute.FULL: 2 * s * b * h,
        }[recompute]
        return per_layer * self.layers + 4 * s * b * self.vocab / tp  # + fp32 logits


@dataclass(frozen=True)
class Buckets:
    """DeepSpeed's ZeRO-3 buckets (elements), read from the JSON being projected."""

    prefetch: int = 50_000_000
    """stage3_prefetch_bucket_size."""
    reduce: int = 500_000_000
    """reduce_bucket_size."""
    persistence: int = 100_000
    """stage3_param_persistence_threshold: smaller parameters stay whole on every rank."""
    max_live: int = 1_000_000_000
    """stage3_max_live_parameters."""

    @classmethod
    def from_json(cls, ds: dict) -> Buckets:
        z = ds.get("zero_optimization") or {}
        d = cls()
        return cls(
            prefetch=int(z.get("stage3_prefetch_bucket_size", d.prefetch)),
            reduce=int(z.get("reduce_bucket_size", d.reduce)),
            persistence=int(z.get("stage3_param_persistence_threshold", d.persistence)),
            max_live=int(z.get("stage3_max_live_parameters", d.max_live)),
        )
