"""The main job's ``--tokenizer-type`` values that work from local files, each with files made here:
GPT2BPETokenizer gives the ids of Megatron-LM's own GPT-2 tokenizer (its source, read from the tree
in ../shared/upstream/), HuggingFaceTokenizer those of transformers' AutoTokenizer, and the job
trains with each on its generated corpus in that tokenizer's ids."""

from __future__ import annotations

import argparse
import json
import math
import re
import tarfile
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from megatron_ext.trainer.corpus import synthetic_documents
from tests.helpers.upstream import TARBALLS, UPSTREAM

pytest.importorskip("transformers")
GPT2_TOKENIZATION = "Megatron-LM/megatron/training/tokenizer/gpt2_tokenization.py"
TEXTS = [*synthetic_documents(5, seed=7), "Unseen words: zebra, 42 quokkas!\n\tand  spaces   ", "ünïcödé ✓"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A GPT-2 style byte-level BPE trained here on the job's kind of text: vocab.json and
    merges.txt, and the same tokenizer saved for transformers in a directory."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tokenizers")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(synthetic_documents(300), vocab_size=400, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(root))
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    hf.save_pretrained(str(root / "hf"))
    return {"vocab": str(root / "vocab.json"), "merges": str(root / "merges.txt"), "hf": str(root / "hf")}


def _megatron_lm_gpt2(vocab: str, merges: str) -> object:
    """Megatron-LM's GPT2Tokenizer, built as its ``_GPT2BPETokenizer`` builds it."""
    tarball = UPSTREAM / TARBALLS["megatron-lm"]
    if not tarball.is_file():
        pytest.skip(f"{tarball} is missing (the upstream tarballs beside the project)")
    with tarfile.open(tarball) as tar:
        member = tar.extractfile(GPT2_TOKENIZATION)
        assert member is not None
        source = member.read().decode()
    module = types.ModuleType("gpt2_tokenization")
    exec(compile(source, GPT2_TOKENIZATION, "exec"), module.__dict__)
    return module.GPT2Tokenizer(vocab, merges, errors="replace", special_tokens=[], max_len=None)


def _build(**flags: str) -> object:
    from megatron_ext.trainer.tokenizer import build_tokenizer

    return build_tokenizer(argparse.Namespace(**{"vocab_size": 256, "tokenizer_model": None, **flags}))


def test_gpt2_bpe_gives_megatron_lms_ids_size_and_eod(files: dict[str, str]) -> None:
    ours = _build(tokenizer_type="GPT2BPETokenizer", vocab_file=files["vocab"], merge_file=files["merges"])
    theirs = _megatron_lm_gpt2(files["vocab"], files["merges"])
    for text in TEXTS:
        assert ours.tokenize(text) == theirs.encode(text), text
    assert ours.vocab_size == len(theirs.encoder) and ours.eod == theirs.encoder["<|endoftext|>"]


def test_hugging_face_tokenizer_gives_transformers_ids(files: dict[str, str]) -> None:
    from transformers import AutoTokenizer

    ours = _build(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=files["hf"])
    theirs = AutoTokenizer.from_pretrained(files["hf"])
    for text in TEXTS:
        assert ours.tokenize(text) == theirs(text, add_special_tokens=False).input_ids, text
    assert ours.vocab_size == len(theirs) and ours.eod == theirs.eos_token_id


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "HuggingFaceTokenizer"])
def test_the_job_trains_with_the_tokenizer(
    kind: str,
    files: dict[str, str],
    pretrain_main: Callable[..., int],
    capsys: pytest.CaptureFixture[str],
    lone_rank: Path,
) -> None:
    flags = {
        "GPT2BPETokenizer": ["--vocab-file", files["vocab"], "--merge-file", files["merges"]],
        "HuggingFaceTokenizer": ["--tokenizer-model", files["hf"]],
    }[kind]
    vocab = len(json.loads(Path(files["vocab"]).read_text()))
    assert pretrain_main("--tokenizer-type", kind, *flags, "--train-iters", "2") == 0
    out = capsys.readouterr().out
    # Megatron-LM's lines: 128 x TP 1 = the multiple the vocabulary is padded to
    padded = math.ceil(vocab / 128) * 128
    assert f"> building {kind} tokenizer ..." in out
    assert f" > padded vocab (size: {vocab}) with {padded - vocab} dummy tokens (new size: {padded})" in out
    losses = [float(m) for m in re.findall(r"\| lm loss: (\S+) \|", out)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), out
    # the generated corpus is in the tokenizer's ids: its first document as Megatron-LM's GPT-2
    # tokenizer encodes it (the same BPE), then GPT-2's end of document
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    (corpus,) = (lone_rank / "data").glob("local_corpus_*.idx")
    reference = _megatron_lm_gpt2(files["vocab"], files["merges"])
    first = reference.encode(synthetic_documents(1)[0]) + [reference.encoder["<|endoftext|>"]]
    dataset = IndexedDataset(str(corpus.with_suffix("")))  # held: its items are views of its memory map
    assert dataset[0].tolist() == first


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{vocab}"],
            "error: --tokenizer-type GPT2BPETokenizer needs --merge-file (a local file): not given",
        ),
        (
            ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "gpt2"],
            "error: --tokenizer-type HuggingFaceTokenizer needs --tokenizer-model, a local directory",
        ),
    ],
)
def test_a_missing_tokenizer_file_is_one_line(
    flags: list[str],
    message: str,
    files: dict[str, str],
    pretrain_main: Callable[..., int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert pretrain_main(*(f.format(**files) for f in flags)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
