"""Megatron's count of a GPT's training FLOPs (Narayanan et al., arXiv 2104.04473, eq. 3)."""

from __future__ import annotations


def gpt_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Forward and backward FLOPs of ``batch`` sequences, without activation recomputation.

    Args:
        batch: sequences.
        seq: tokens per sequence.
        layers: transformer layers.
        hidden: hidden size.
        vocab: vocabulary of the output layer (padded, as the model holds it).

    Returns:
        ``72 B s l h^2 (1 + s / (6h) + V / (12 l h))``: eq. 3's
        ``96 B s l h^2 (1 + s / (6h) + V / (16 l h))`` without its recomputed forward.
    """
    return (
        72
        * batch
        * seq
        * layers
        * hidden
        * hidden
        * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))
    )
