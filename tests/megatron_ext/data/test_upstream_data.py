"""Our indexed-dataset check against what upstream's own ``tools/preprocess_data.py`` writes with
``--append-eod``: Megatron-DeepSpeed's leaves each EOD out of the recorded sizes (its .bin is larger
than its index says), Megatron-LM's counts it; both must pass, and a truncated copy must not."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.data.indexed import DatasetFileError, check_indexed_dataset
from tests.helpers.upstream import SetupError, prepare


@pytest.fixture(scope="module")
def trees() -> dict:
    try:
        return prepare()
    except SetupError as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"upstream data tests cannot run in CI: {exc}")
        pytest.skip(f"upstream data tests need: {exc}")


@pytest.mark.parametrize("kind", ["megatron-lm", "megatron-deepspeed"])
def test_upstream_append_eod_corpus_passes_the_check(trees: dict, kind: str) -> None:
    check_indexed_dataset(trees[kind].data)


def _described_bytes(prefix: str) -> tuple[int, int]:
    """(bytes the .idx describes, documents) from megatron-core's index layout: 9-byte magic, version
    (8), dtype code (1), sequence and document counts (8 + 8), then int32 sizes."""
    head = Path(prefix + ".idx").read_bytes()[:34]
    dtype_size = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 4, 7: 8, 8: 2}[head[17]]
    n_seq, n_doc = np.frombuffer(head[18:34], dtype="<u8")
    sizes = np.fromfile(prefix + ".idx", dtype=np.int32, count=int(n_seq), offset=34)
    return int(sizes.astype(np.int64).sum()) * dtype_size, int(n_doc) - 1


def test_megatron_deepspeed_leaves_eod_out_of_its_index(trees: dict) -> None:
    # What the check has to tolerate, read from the files: one EOD token per document beyond the sizes.
    mds, mds_docs = _described_bytes(trees["megatron-deepspeed"].data)
    lm, _ = _described_bytes(trees["megatron-lm"].data)
    bin_size = os.path.getsize(trees["megatron-deepspeed"].data + ".bin")
    assert bin_size > mds and (bin_size - mds) % mds_docs == 0, (bin_size, mds, mds_docs)
    assert os.path.getsize(trees["megatron-lm"].data + ".bin") == lm  # Megatron-LM counts its EODs


def test_a_truncated_upstream_bin_is_refused_by_name(trees: dict, tmp_path: Path) -> None:
    prefix = trees["megatron-lm"].data
    copy = tmp_path / "corpus"
    shutil.copy(prefix + ".idx", str(copy) + ".idx")
    data = Path(prefix + ".bin").read_bytes()
    Path(str(copy) + ".bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetFileError, match=f"{copy}.bin holds {len(data) // 2} bytes"):
        check_indexed_dataset(str(copy))
