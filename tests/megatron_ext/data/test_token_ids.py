"""The ring carries only token ids, and a rank rebuilds from them exactly the batch megatron-core's
GPTDataset would hand it: tokens, labels, loss mask, position ids and attention mask, under every
setting that changes them (EOD resets, EOD loss masking, padding past the corpus' end, a pad id equal
to the EOD id, no extra label token). The ids are stored in uint16 where the vocabulary fits and in
int32 otherwise, losslessly; an id the chosen type cannot hold is refused by name."""

import dataclasses

import numpy as np
import pytest
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset

from megatron_ext.data.documents import MaskBuilder
from megatron_ext.data.token_ids import TextReader, TextRules, TokenCodec, derive_batch
from megatron_ext.trainer.corpus import (
    ByteTokenizer,
    gpt_dataset_config,
    synthetic_documents,
    write_indexed_dataset,
)

KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
SEQ = 48


class PadIsEodTokenizer(ByteTokenizer):
    pad = ByteTokenizer.eod


class PaddingTokenizer(ByteTokenizer):
    """A tokenizer with a pad id of its own (GPTDataset pads with -1 when the tokenizer has none)."""

    pad = 255


SETTINGS = {
    "plain": {},
    "reset positions and masks": {"reset_position_ids": True, "reset_attention_mask": True},
    "no loss on EOD": {"eod_mask_loss": True},
    "all resets, pad is EOD": {
        "reset_position_ids": True,
        "reset_attention_mask": True,
        "eod_mask_loss": True,
        "tokenizer": PadIsEodTokenizer(),
        "allow_ambiguous_pad_tokens": True,
    },
    "a pad id of its own": {"tokenizer": PaddingTokenizer(), "eod_mask_loss": True},
    "no extra label token": {"add_extra_token_to_sequence": False, "reset_position_ids": True},
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("token-ids")
    write_indexed_dataset(str(root / "corpus"), synthetic_documents(12))  # short: the last samples pad
    return root


def _dataset(corpus, **changes):
    config = gpt_dataset_config(
        str(corpus / "corpus"), SEQ, 1234, str(corpus / "cache"), create_attention_mask=True
    )
    config = dataclasses.replace(config, **changes)
    dataset = BlendedMegatronDatasetBuilder(GPTDataset, [40, 0, 0], lambda: True, config).build()[0]
    read = dataset._query_document_sample_shuffle_indices

    def padded_every_third(idx):
        """As GPTDataset's reader pads a sample that runs past the corpus' end: its pad id at the tail."""
        text, documents = read(idx)
        if idx % 3 == 0:
            text = text.copy()
            text[-(idx % 7 + 2) :] = dataset._pad_token_id
        return text, documents

    dataset._query_document_sample_shuffle_indices = padded_every_third  # upstream's __getitem__ reads it too
    return dataset


@pytest.mark.parametrize("setting", SETTINGS)
def test_every_key_equals_gpt_datasets_item(corpus, setting):
    dataset = _dataset(corpus, **SETTINGS[setting])
    reader, rules, codec = TextReader(dataset), TextRules.of(dataset), TokenCodec.of(dataset)
    indices = list(range(len(dataset)))
    stored = np.zeros((len(indices), SEQ + rules.extra_token), dtype=codec.dtype)
    for row, i in enumerate(indices):
        codec.encode(reader.read(i), stored[row], where=f"sample {i}")
    ours = derive_batch(codec.decode(torch.from_numpy(stored)), rules, KEYS, MaskBuilder(torch.device("cpu")))
    padded = 0
    for row, i in enumerate(indices):
        # Upstream caches the loss mask of the first sample it builds (without resets) and then zeroes
        # that sample's padding in the cached tensor itself, so every later sample of the process
        # inherits it: each item is built afresh here, as its own text alone defines it.
        dataset.masks_and_position_ids_are_cached = False
        item = dataset[i]
        for key in KEYS:
            want = item[key]  # the attention mask: [1, s, s] bool, True where masked, as ours per sample
            assert ours[key][row].dtype == want.dtype, f"{key} of sample {i}"
            assert torch.equal(ours[key][row], want), f"{key} of sample {i} ({setting})"
        padded += bool((item["loss_mask"] == 0).any())
    assert padded, "no sample of this corpus has a masked loss: the case is not exercised"


def test_a_vocabulary_below_65535_ids_is_stored_in_two_bytes_and_larger_in_four():
    assert TokenCodec.for_vocabulary(257, pad=-1).dtype == np.uint16
    assert TokenCodec.for_vocabulary(50_257, pad=-1).dtype == np.uint16  # GPT-2
    assert TokenCodec.for_vocabulary(65_535, pad=None).dtype == np.uint16
    assert TokenCodec.for_vocabulary(65_536, pad=None).dtype == np.int32
    assert TokenCodec.for_vocabulary(128_256, pad=-1).dtype == np.int32  # Llama 3
    assert TokenCodec.for_vocabulary(None, pad=-1).dtype == np.int32  # unknown: the safe width


@pytest.mark.parametrize(
    ("vocab", "pad"), [(50_257, -1), (50_257, 50_256), (128_256, -1), (128_256, 128_000)]
)
def test_ids_and_the_pad_id_survive_the_round_trip(vocab, pad):
    codec = TokenCodec.for_vocabulary(vocab, pad)
    text = np.array([0, 1, vocab - 1, pad, 7, pad], dtype=np.int64)
    row = np.zeros(text.shape, dtype=codec.dtype)
    codec.encode(text, row, where="sample 3")
    assert codec.decode(torch.from_numpy(row)).tolist() == text.tolist()


def test_an_id_the_stored_type_cannot_hold_is_refused_naming_it():
    codec = TokenCodec.for_vocabulary(50_257, pad=-1)
    row = np.zeros(3, dtype=codec.dtype)
    with pytest.raises(
        ValueError, match=r"sample 9 holds token id 70000, which the ring's uint16 cannot hold"
    ):
        codec.encode(np.array([1, 70_000, 2]), row, where="sample 9")
    with pytest.raises(ValueError, match=r"token id -5"):
        codec.encode(np.array([1, -5, 2]), row, where="sample 9")


def test_a_dataset_without_gpt_datasets_reader_is_refused_by_name():
    class Items:
        config = dataclasses.make_dataclass("C", [("sequence_length", int)])(8)

        def __getitem__(self, idx):
            return {"tokens": torch.zeros(8, dtype=torch.int64)}

    with pytest.raises(TypeError, match="Items lacks: pass a megatron-core GPTDataset"):
        TextReader(Items())


class LargeVocabularyTokenizer(ByteTokenizer):
    """A vocabulary past uint16 (Llama 3's size): the ring must store 4-byte ids."""

    vocab_size = 128_256


def test_a_vocabulary_past_uint16_goes_through_the_ring_in_int32_unchanged(corpus, shm_path):
    from tests.helpers.shm import megatron_batches, node_iterator, take

    dataset = _dataset(corpus, tokenizer=LargeVocabularyTokenizer(), reset_position_ids=True)
    assert TokenCodec.of(dataset).dtype == np.int32
    loader = node_iterator(dataset, shm_path, 0, 1, timeout_s=60)
    try:
        got = take(loader, 6)
    finally:
        loader.close()
    dataset.masks_and_position_ids_are_cached = False
    keys = {"tokens", "labels", "loss_mask", "position_ids"}
    expected = megatron_batches(dataset, "random", 0, 0, 1, 6, keys, mbs=2)
    assert len(got) == 6
    for step, (ours, want) in enumerate(zip(got, expected)):
        for key in keys:
            assert torch.equal(ours[key], want[key]), f"step {step} {key}"
