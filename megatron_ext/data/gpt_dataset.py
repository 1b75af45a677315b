"""The local corpus, its ``.bin/.idx`` files, and megatron-core ``GPTDataset`` over them.

The demo needs no download: :func:`synthetic_documents` writes a small corpus of generated
English-like sentences, tokenised byte by byte (:class:`ByteTokenizer`). Real runs point
``--data-path`` at files made by Megatron's preprocessing; both are read by the same code.
"""

from __future__ import annotations

import os
import random
import struct
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

_IDX_MAGIC = b"MMIDIDX\x00\x00"
_DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 8, 8: 2}  # megatron-core's DType codes -> bytes


class DatasetFileError(ValueError):
    """A ``.bin``/``.idx`` pair is missing, truncated or corrupt; the message names the file."""


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


def write_indexed_dataset(prefix: str, documents: Iterable[str], eod: int = ByteTokenizer.eod) -> None:
    """Tokenise ``documents`` byte by byte into ``prefix.bin`` / ``prefix.idx`` (megatron-core's
    format), each document ended by ``eod`` (a NullTokenizer of N ids has its EOD at N)."""
    tokenizer = ByteTokenizer()
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16 if eod < 2**16 else np.int32)
    for doc in documents:
        builder.add_item(torch.tensor(tokenizer.tokenize(doc) + [eod], dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def check_indexed_dataset(prefix: str) -> None:
    """Fail with the file's name when a ``.bin``/``.idx`` pair is missing, truncated or corrupt,
    instead of an assertion or a crash deep inside numpy's memory map."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_):
        if not os.path.isfile(path):
            raise DatasetFileError(f"{path} does not exist: check --data-path (a prefix without .bin/.idx)")
    with open(idx, "rb") as f:
        head = f.read(len(_IDX_MAGIC) + 8 + 1 + 16)
    if len(head) < len(_IDX_MAGIC) + 25 or head[: len(_IDX_MAGIC)] != _IDX_MAGIC:
        raise DatasetFileError(f"{idx} is not a megatron-core index file (bad or short header)")
    (dtype_code,) = struct.unpack("<B", head[17:18])
    n_seq, n_doc = struct.unpack("<QQ", head[18:34])
    if dtype_code not in _DTYPE_SIZES:
        raise DatasetFileError(f"{idx} has an unknown token dtype code {dtype_code}")
    expected_idx = 34 + n_seq * (4 + 8) + n_doc * 8
    if os.path.getsize(idx) != expected_idx:
        raise DatasetFileError(
            f"{idx} is truncated or corrupt: {os.path.getsize(idx)} bytes, expected {expected_idx}"
        )
    lengths = np.fromfile(idx, dtype=np.int32, count=n_seq, offset=34)
    expected_bin = int(lengths.astype(np.int64).sum()) * _DTYPE_SIZES[dtype_code]
    # A larger .bin is valid: Megatron-DeepSpeed's tools/preprocess_data.py --append-eod writes each EOD
    # but leaves it out of the recorded sizes, and every reader reads only the bytes the index describes.
    if os.path.getsize(bin_) < expected_bin or os.path.getsize(bin_) % _DTYPE_SIZES[dtype_code]:
        raise DatasetFileError(
            f"{bin_} holds {os.path.getsize(bin_)} bytes but {idx} describes {expected_bin}: truncated or mismatched pair"
        )


def gpt_dataset_config(
    prefix: str,
    seq_length: int,
    seed: int,
    cache_dir: str,
    create_attention_mask: bool = False,
    tokenizer: Any = None,
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
    tokenizer: Any = None,
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
        f.seek(len(_IDX_MAGIC) + 8)
        (code,) = struct.unpack("<B", f.read(1))
    dtype = DType.dtype_from_code(code)
    if os.path.getsize(prefix + ".bin") == 0:
        return None
    return int(np.memmap(prefix + ".bin", dtype=dtype, mode="r").max())
