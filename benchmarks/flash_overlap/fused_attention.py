"""megatron-core's core attention as one fused kernel, as a GPU run computes it.

megatron-core's local layer spec (what runs without TransformerEngine, as on this CPU host) computes
attention unfused: a baddbmm for the scores, a softmax over [b, heads, s, s], a bmm for the context. A
GPU run uses TransformerEngine's or FlashAttention's fused kernel, and DeepSpeed's Domino layers call
``scaled_dot_product_attention``. Every TP method of the benchmark, and its compute-only twin, takes
this module for ``core_attention`` so that all of them, Domino included, run the same attention kernel.

Method in full: benchmarks/results/methods.md, `benchmarks.flash_overlap.fused_attention`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class FusedDotProductAttention(DotProductAttention):
    """megatron-core's ``DotProductAttention`` (same construction) whose forward is the causal fused
    kernel: [s, b, heads, d] query, key and value in, [s, b, heads x d] context out."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError(
                "the fused benchmark attention takes neither an attention bias nor packed sequences"
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        grouped = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        context = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=grouped
        )
        return context.permute(2, 0, 1, 3).reshape(
            query.shape[0], query.shape[1], self.hidden_size_per_partition
        )
