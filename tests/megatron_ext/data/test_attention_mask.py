"""The loaders' attention mask is the one megatron-core's GPTDataset builds for the same sample,
also when the dataset hides its EOD tokens (pad id == EOD id)."""

import dataclasses

import pytest
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, _get_ltor_masks_and_position_ids

from megatron_ext.data.documents import MaskBuilder, attention_mask, document_ids
from megatron_ext.data.token_ids import TextReader, TextRules, derive_batch
from megatron_ext.trainer.corpus import (
    ByteTokenizer,
    gpt_dataset_config,
    synthetic_documents,
    write_indexed_dataset,
)

EOD = 7


def _upstream(tokens: torch.Tensor, reset: bool) -> torch.Tensor:
    masks = [_get_ltor_masks_and_position_ids(row, EOD, False, reset, False, True)[0] for row in tokens]
    return torch.stack(masks)  # each [1, s, s]


@pytest.mark.parametrize("reset", [False, True])
def test_mask_equals_gpt_datasets_for_documents_of_any_length(reset):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 10, (6, 48), generator=gen)  # about one EOD in ten tokens
    tokens[0, 0] = EOD  # a document of one token at the start
    tokens[1, -1] = EOD  # and at the end
    tokens[2] = EOD  # every token ends a document
    tokens[3] = 1  # one document
    ours = attention_mask(6, 48, tokens.device, document_ids(tokens, EOD) if reset else None)
    assert ours.dtype == torch.bool and ours.shape == (6, 1, 48, 48)
    assert torch.equal(ours, _upstream(tokens, reset))


def test_document_ids_agree_for_numpy_and_torch():
    tokens = torch.tensor([[EOD, 1, 2, EOD, EOD, 3]])
    assert document_ids(tokens, EOD).tolist() == [[0, 1, 1, 1, 2, 3]]
    assert document_ids(tokens.numpy(), EOD).tolist() == [[0, 1, 1, 1, 2, 3]]


class PadIsEodTokenizer(ByteTokenizer):
    """As many Hugging Face tokenizers: padding uses the EOD id (megatron-core keeps it as the pad id
    with ``allow_ambiguous_pad_tokens``, Megatron-LM's --allow-ambiguous-pad-tokens)."""

    pad = ByteTokenizer.eod


def test_masks_follow_the_tokens_the_dataset_read_when_pad_is_eod(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_indexed_dataset(prefix, synthetic_documents(20))
    config = dataclasses.replace(
        gpt_dataset_config(
            prefix,
            64,
            1234,
            str(tmp_path / "cache"),
            create_attention_mask=True,
            tokenizer=PadIsEodTokenizer(),
        ),
        reset_attention_mask=True,
        allow_ambiguous_pad_tokens=True,
    )  # else megatron-core drops the pad id
    dataset = BlendedMegatronDatasetBuilder(GPTDataset, [40, 0, 0], lambda: True, config).build()[0]
    expected = [dataset[i] for i in range(len(dataset))]
    reader, rules, masks = TextReader(dataset), TextRules.of(dataset), MaskBuilder(torch.device("cpu"))
    differing = 0
    for i, want in enumerate(expected):
        got = dataset[i]
        assert torch.equal(got["tokens"], want["tokens"])  # the dataset's items are unchanged
        text = torch.from_numpy(reader.read(i))[None]
        mask = derive_batch(text, rules, ("attention_mask",), masks)["attention_mask"]
        assert torch.equal(mask[0], want["attention_mask"]), f"sample {i}"
        from_tokens = attention_mask(
            1, 64, torch.device("cpu"), document_ids(got["tokens"], ByteTokenizer.eod)[None]
        )
        differing += not torch.equal(from_tokens[0], want["attention_mask"])
    # The case is real: the returned tokens hold no EOD (replaced by 0), so a rebuild from them is wrong.
    assert differing > len(expected) // 4, f"{differing} of {len(expected)}"
