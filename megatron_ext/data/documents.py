"""Attention masks built where the tokens live, from per-token document ids, instead of the
dataset's [1, s, s] mask per sample (64 MiB at s=8192).

A token's *document id* is the number of EOD tokens strictly before it; with
``reset_attention_mask`` a query and a key in different documents are masked, as upstream's
``_get_ltor_masks_and_position_ids`` does. The ids come from the tokens before GPTDataset replaces
padding (docs/shm_data_loader.md, "The attention mask's cost").
"""

from __future__ import annotations

import numpy as np
import torch


def document_ids(tokens: np.ndarray | torch.Tensor, eod: int) -> np.ndarray | torch.Tensor:
    """Per position, the count of EOD tokens strictly before it (int32, the shape of ``tokens``)."""
    is_eod = tokens == eod
    if isinstance(tokens, torch.Tensor):
        return (is_eod.cumsum(dim=-1) - is_eod.long()).to(torch.int32)
    return (np.cumsum(is_eod, axis=-1) - is_eod).astype(np.int32)


class MaskBuilder:
    """Builds [mbs, 1, s, s] bool masks as GPTDataset does (True = masked): causal, and across
    documents too when document ids are given. The output is the only per-call allocation: the
    causal triangle is made once per sequence length and kept, and the document comparison and the
    union are written into the output in place (no [mbs, s, s] temporaries). Built on ``device``: on
    a GPU it never crosses PCIe and the training thread does no per-element work."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._causal: torch.Tensor | None = None

    def causal(self, seq_length: int) -> torch.Tensor:
        """The [s, s] upper triangle above the diagonal, cached."""
        if self._causal is None or self._causal.shape[0] != seq_length:
            self._causal = None  # the old one is freed before the new one is made
            self._causal = torch.ones(seq_length, seq_length, dtype=torch.bool, device=self.device).triu_(1)
        return self._causal

    def build(
        self, micro_batch_size: int, seq_length: int, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The mask of a micro-batch; ``documents``: its [mbs, s] document ids, or None (causal only)."""
        causal = self.causal(seq_length)
        out = torch.empty(micro_batch_size, 1, seq_length, seq_length, dtype=torch.bool, device=self.device)
        if documents is None:
            return out.copy_(causal)
        torch.ne(documents[:, None, :, None], documents[:, None, None, :], out=out)
        return out.logical_or_(causal)


def attention_mask(
    micro_batch_size: int, seq_length: int, device: torch.device, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """One mask, as :class:`MaskBuilder` builds it (no triangle kept)."""
    return MaskBuilder(device).build(micro_batch_size, seq_length, documents)
