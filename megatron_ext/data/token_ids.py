"""What the ring carries (each sample's token ids, narrow) and how a rank rebuilds Megatron's batch
from them.

megatron-core's ``GPTDataset`` derives tokens, labels, loss mask, position ids and attention mask
from ``seq_length + 1`` ids per sample. The ring stores only those ids, read before the dataset
replaces padding (:class:`TextReader`), in ``uint16`` where the vocabulary fits and ``int32``
otherwise (:class:`TokenCodec`): 2 bytes per token instead of 32. Each rank derives the rest where
its tokens go (:func:`derive_batch`), on the GPU for a CUDA device.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import numpy as np
import torch

from megatron_ext.data.dataset import SampleDataset, SampleQuery
from megatron_ext.data.documents import MaskBuilder, document_ids

_QUERY = "_query_document_sample_shuffle_indices"  # GPTDataset's reader of a sample's ids
_NARROW_LIMIT = 0xFFFF  # uint16 holds ids below it; the value itself codes a pad id it cannot hold


def _gpt_datasets(dataset: SampleDataset) -> list[SampleDataset]:
    """The GPT datasets under ``dataset``: itself, or those a BlendedDataset draws from."""
    return list(getattr(dataset, "datasets", None) or [dataset])


@dataclasses.dataclass(frozen=True)
class TextRules:
    """The GPTDataset settings that turn a sample's ids into Megatron's batch keys."""

    extra_token: int
    """1: ``seq_length + 1`` ids per sample, labels are the ids shifted (add_extra_token_to_sequence)."""
    eod: int | None
    """The tokenizer's end-of-document id (None: a dataset without a tokenizer, nothing resets)."""
    pad: int | None
    """The id GPTDataset pads with and masks out of the loss (its ``_pad_token_id``)."""
    reset_position_ids: bool
    """Position ids restart after each EOD."""
    reset_attention_mask: bool
    """Attention does not cross an EOD."""
    eod_mask_loss: bool
    """No loss on EOD tokens."""

    @classmethod
    def of(cls, dataset: SampleDataset) -> TextRules:
        """The rules of a megatron-core GPTDataset (or of the datasets a BlendedDataset blends,
        which share one config)."""
        config = dataset.config
        tokenizer = getattr(config, "tokenizer", None)
        pads = {getattr(d, "_pad_token_id", None) for d in _gpt_datasets(dataset)}
        if len(pads) > 1:
            raise ValueError(
                f"the blended datasets pad with different ids {sorted(pads)}: give them one tokenizer"  # type: ignore[type-var]  # every GPTDataset sets one: no None among several
            )
        rules = cls(
            extra_token=int(getattr(config, "add_extra_token_to_sequence", True)),
            eod=None if tokenizer is None else int(tokenizer.eod),
            pad=pads.pop(),
            reset_position_ids=bool(getattr(config, "reset_position_ids", False)),
            reset_attention_mask=bool(getattr(config, "reset_attention_mask", False)),
            eod_mask_loss=bool(getattr(config, "eod_mask_loss", False)),
        )
        if rules.eod is None and (
            rules.reset_position_ids or rules.reset_attention_mask or rules.eod_mask_loss
        ):
            raise ValueError(
                f"{type(dataset).__name__}'s config resets positions, masks or losses at EOD but has no tokenizer "
                "to name the EOD id"
            )
        return rules


@dataclasses.dataclass(frozen=True)
class TokenCodec:
    """How ids are stored in the ring: 2 bytes where every id fits, else 4; lossless either way."""

    token_bytes: int
    """2 (uint16) or 4 (int32)."""
    pad: int | None
    """The pad id; in uint16 it is stored as 0xFFFF when it lies outside 0..0xFFFE (GPTDataset's -1)."""

    @classmethod
    def for_vocabulary(cls, vocab_size: int | None, pad: int | None) -> TokenCodec:
        """uint16 when every id of the vocabulary lies below 0xFFFF; int32 otherwise (or unknown)."""
        narrow = vocab_size is not None and vocab_size <= _NARROW_LIMIT
        return cls(2 if narrow else 4, pad)

    @classmethod
    def of(cls, dataset: SampleDataset) -> TokenCodec:
        tokenizer = getattr(dataset.config, "tokenizer", None)
        return cls.for_vocabulary(getattr(tokenizer, "vocab_size", None), TextRules.of(dataset).pad)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.token_bytes == 2 else np.int32)

    @property
    def _pad_code(self) -> int | None:
        """The stored value of the pad id when it is not its own value, else None."""
        if self.token_bytes == 2 and self.pad is not None and not 0 <= self.pad < _NARROW_LIMIT:
            return _NARROW_LIMIT
        return None

    def encode(self, text: np.ndarray, out: np.ndarray, where: str) -> None:
        """Write ``text`` (int64 ids) into ``out`` (a ring row); refuses an id the type cannot hold."""
        info = np.iinfo(self.dtype)
        high = _NARROW_LIMIT - 1 if self.token_bytes == 2 else info.max
        low, top = int(text.min()), int(text.max())
        if info.min <= low and top <= high:
            out[:] = text
            return
        code = self._pad_code
        is_pad = text == self.pad if self.pad is not None else np.zeros(text.shape, dtype=bool)
        bad = ~is_pad & ((text < info.min) | (text > high))
        if bad.any() or (is_pad.any() and code is None and not info.min <= cast(int, self.pad) <= high):
            value = int(text[bad][0]) if bad.any() else self.pad
            raise ValueError(
                f"{where} holds token id {value}, which the ring's {self.dtype} cannot hold (the tokenizer's "
                f"vocabulary chose {self.token_bytes}-byte ids): the .bin was written with another tokenizer, or the "
                "tokenizer's vocab_size is wrong"
            )
        assert self.pad is not None  # every id out of range is the pad
        out[:] = np.where(is_pad, code if code is not None else self.pad, text)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """The int64 ids of stored rows (on their device)."""
        if stored.dtype == torch.uint16:  # through int16, which every backend converts
            ids = stored.view(torch.int16).to(torch.int64).bitwise_and_(0xFFFF)
        else:
            ids = stored.to(torch.int64)
        code = self._pad_code
        if code is not None:
            assert self.pad is not None  # a code stands for the pad
            ids.masked_fill_(ids == code, self.pad)
        return ids


class TextReader:
    """Reads a sample's ids as GPTDataset does, before it replaces padding: straight from its
    ``_query_document_sample_shuffle_indices`` for a GPTDataset; for a BlendedDataset through its
    item (which picks the dataset and sample), keeping the ids the chosen dataset read. Runs in the
    producer, on its forked copy of the dataset."""

    def __init__(self, dataset: SampleDataset) -> None:
        self._dataset = dataset
        self._last: np.ndarray | None = None
        self._direct = getattr(dataset, _QUERY, None)
        if self._direct is not None:
            return
        for d in _gpt_datasets(dataset):
            setattr(d, _QUERY, self._keeping(_query(d)))

    def _keeping(self, query: SampleQuery) -> SampleQuery:
        def query_and_keep(idx: int) -> tuple[np.ndarray, np.ndarray]:
            text, documents = query(idx)
            self._last = np.array(text)  # __getitem__ then rewrites the padding in place
            return text, documents

        return query_and_keep

    def read(self, idx: int) -> np.ndarray:
        """Sample ``idx``'s ids, int64, ``seq_length + extra token`` of them."""
        if self._direct is not None:
            return self._direct(int(idx))[0]
        self._dataset[idx]
        text, self._last = self._last, None
        if text is None:
            raise RuntimeError(
                f"{type(self._dataset).__name__}[{idx}] returned a sample without reading its ids"
            )
        return text


def _query(dataset: SampleDataset) -> SampleQuery:
    query = getattr(dataset, _QUERY, None)
    if query is None:
        raise TypeError(
            "the node loader reads token ids through GPTDataset._query_document_sample_shuffle_indices, "
            f"which {type(dataset).__name__} lacks: pass a megatron-core GPTDataset (or a BlendedDataset of them)"
        )
    return query


def check_readable(dataset: SampleDataset) -> None:
    """Refuse, before any process starts, a dataset whose ids :class:`TextReader` cannot read."""
    if not hasattr(dataset, _QUERY):
        for d in _gpt_datasets(dataset):
            _query(d)


def derive_batch(
    text: torch.Tensor, rules: TextRules, keys: tuple[str, ...], masks: MaskBuilder | None
) -> dict[str, torch.Tensor]:
    """Megatron's batch keys (those in ``keys``) from ``text``, the [mbs, seq + extra] int64 ids of a
    micro-batch, on their device: what GPTDataset's ``__getitem__`` computes per sample, stacked."""
    mbs = text.shape[0]
    if rules.extra_token:
        tokens, labels = text[:, :-1], text[:, 1:].clone()
    else:
        tokens, labels = text, torch.roll(text, shifts=-1, dims=1)
        labels[:, -1] = -1 if rules.pad is None else rules.pad
    seq = tokens.shape[1]
    is_eod = tokens == rules.eod if rules.eod is not None else None
    out: dict[str, torch.Tensor] = {}
    if "loss_mask" in keys:
        loss_mask = torch.ones(mbs, seq, dtype=torch.float32, device=text.device)
        if rules.eod_mask_loss:
            assert is_eod is not None  # TextRules.of refuses EOD settings without an EOD id
            loss_mask.masked_fill_(is_eod, 0.0)
        if rules.pad is not None:
            loss_mask.masked_fill_(labels == rules.pad, 0.0)
        out["loss_mask"] = loss_mask
    if "position_ids" in keys:
        positions = torch.arange(seq, device=text.device).repeat(mbs, 1)
        if rules.reset_position_ids:
            # A position restarts after the last EOD before it: subtract (that EOD's index + 1).
            assert is_eod is not None  # TextRules.of refuses EOD settings without an EOD id
            after_eod = torch.where(is_eod, positions + 1, torch.zeros_like(positions))
            start = after_eod.cummax(dim=1).values
            positions[:, 1:] -= start[:, :-1]
        out["position_ids"] = positions
    if "attention_mask" in keys and masks is not None:
        documents = None
        if rules.reset_attention_mask:
            assert rules.eod is not None  # TextRules.of refuses EOD settings without an EOD id
            documents = cast(torch.Tensor, document_ids(tokens, rules.eod))  # a tensor's are a tensor
        out["attention_mask"] = masks.build(mbs, seq, documents)
    if rules.pad is not None:
        if "tokens" in keys:
            out["tokens"] = tokens.masked_fill(tokens == rules.pad, 0)
        labels.masked_fill_(labels == rules.pad, 0)
    else:
        out["tokens"] = tokens.contiguous()
    out["labels"] = labels
    return {key: out[key] for key in keys if key in out}
