"""The ``.bin``/``.idx`` pairs megatron-core's indexed datasets read: checked by name before any
reader maps them, so that a missing, truncated or corrupt file fails on every rank with its path."""

from __future__ import annotations

import os
import struct

import numpy as np

IDX_MAGIC = b"MMIDIDX\x00\x00"
_DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 8, 8: 2}  # megatron-core's DType codes -> bytes


class DatasetFileError(ValueError):
    """A ``.bin``/``.idx`` pair is missing, truncated or corrupt; the message names the file."""


def check_indexed_dataset(prefix: str) -> None:
    """Fail with the file's name when a ``.bin``/``.idx`` pair is missing, truncated or corrupt,
    instead of an assertion or a crash deep inside numpy's memory map."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_):
        if not os.path.isfile(path):
            raise DatasetFileError(f"{path} does not exist: check --data-path (a prefix without .bin/.idx)")
    with open(idx, "rb") as f:
        head = f.read(len(IDX_MAGIC) + 8 + 1 + 16)
    if len(head) < len(IDX_MAGIC) + 25 or head[: len(IDX_MAGIC)] != IDX_MAGIC:
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
