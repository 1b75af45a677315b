"""The main job's data without a download: a generated corpus of English-like sentences, tokenised
byte by byte (:class:`ByteTokenizer`), written as megatron-core ``.bin/.idx`` files, and
megatron-core ``GPTDataset`` over those or over ``--data-path`` (Megatron's preprocessing)."""

from __future__ import annotations

import os
import random
import struct
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from megatron_ext.data.indexed import IDX_MAGIC, check_indexed_dataset


class Tokenizer(Protocol):
    """What the job reads of a tokenizer: megatron-core's, or :class:`ByteTokenizer`."""

    @property
    def vocab_size(self) -> int: ...


class ByteTokenizer:
    """Bytes are tokens 0..255, end-of-document is 256."""

    vocab_size = 257
    eod = 256
    unique_identifiers = {"class": "ByteTokenizer"}

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


_SUBJECTS = ["the model", "a rank", "the node", "every worker", "the loader", "our cluster", "the optimizer"]
_VERBS = ["reads", "writes", "gathers", "scatters", "reduces", "copies", "trains on", "waits for"]
_OBJECTS = [
    "the batch",
    "its shard",
    "a slot",
    "the gradients",
    "the weights",
    "the next sample",
    "shared memory",
]


def synthetic_documents(num_documents: int, seed: int = 1234) -> list[str]:
    """Generated documents of 3-12 sentences from a tiny grammar: learnable, so the loss falls."""
    rng = random.Random(seed)
    docs = []
    for _ in range(num_documents):
        sentences = [
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."
            for _ in range(rng.randint(3, 12))
        ]
        docs.append(" ".join(sentences).capitalize())
    return docs


def write_indexed_dataset(
    prefix: str,
    documents: Iterable[str],
    eod: int = ByteTokenizer.eod,
    tokenize: Callable[[str], list[int]] | None = None,
) -> None:
    """Tokenise ``documents`` with ``tokenize`` (None: byte by byte) into ``prefix.bin`` /
    ``prefix.idx`` (megatron-core's format), each document ended by ``eod`` (a NullTokenizer of N
    ids has its EOD at N)."""
    tokenize = tokenize or ByteTokenizer().tokenize
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16 if eod < 2**16 else np.int32)
    for doc in documents:
        builder.add_item(torch.tensor(tokenize(doc) + [eod], dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def gpt_dataset_config(
    prefix: str,
    seq_length: int,
    seed: int,
    cache_dir: str,
    create_attention_mask: bool = False,
    tokenizer: Tokenizer | None = None,
) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        blend=([prefix], None),
        random_seed=seed,
        sequence_length=seq_length,
        split="100,0,0",
        path_to_cache=cache_dir,
        tokenizer=tokenizer or ByteTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=create_attention_mask,
    )


def build_train_dataset(
    prefix: str,
    seq_length: int,
    num_samples: int,
    seed: int,
    cache_dir: str,
    is_built_on_rank: bool = True,
    tokenizer: Tokenizer | None = None,
) -> GPTDataset:
    """The training split of a ``GPTDataset`` with at least ``num_samples`` samples. Index caches
    go to ``cache_dir``; build on one rank first when several share it."""
    check_indexed_dataset(prefix)
    config = gpt_dataset_config(prefix, seq_length, seed, cache_dir, tokenizer=tokenizer)
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [num_samples, 0, 0], lambda: is_built_on_rank, config
    ).build()
    return train


def largest_token_id(prefix: str) -> int | None:
    """The largest token id in ``prefix.bin`` (one pass through a memory map), None if it is empty."""
    with open(prefix + ".idx", "rb") as f:
        f.seek(len(IDX_MAGIC) + 8)
        (code,) = struct.unpack("<B", f.read(1))
    dtype = DType.dtype_from_code(code)
    if os.path.getsize(prefix + ".bin") == 0:
        return None
    return int(np.memmap(prefix + ".bin", dtype=dtype, mode="r").max())
