"""The loaders' attention mask is the one megatron-core's GPTDataset builds for the same tokens."""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from megatron_ext.data.batch import build_attention_mask

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
    dataset = SimpleNamespace(config=SimpleNamespace(reset_attention_mask=reset, tokenizer=SimpleNamespace(eod=EOD)))
    ours = build_attention_mask(tokens, dataset)
    assert ours.dtype == torch.bool and ours.shape == (6, 1, 48, 48)
    assert torch.equal(ours, _upstream(tokens, reset))
