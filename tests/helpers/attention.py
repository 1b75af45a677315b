"""Dense references for the attention tests: attention over the whole sequence on one rank, and
the relative error the tests bound."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of [s, b, heads, d] queries over [s, b, kv_heads, d] keys/values (each kv head
    serving heads/kv_heads consecutive query heads, as Megatron's repeat_kv), masked where ``mask``
    ([b, 1, s, s]) is True; returns [s, b, heads * d] as Megatron's CoreAttention."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), attn_mask=~mask)
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference over the largest magnitude: the projections' sums run in another order."""
    return ((got - expected).abs().max() / expected.abs().max()).item()
