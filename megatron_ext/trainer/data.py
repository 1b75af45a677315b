"""The main job's data: its tokenizer, the corpus (``--data-path`` or a generated one),
and this rank's batches (the node loader when enabled, Megatron's stock path otherwise)."""

from __future__ import annotations

import argparse
import os
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from mdsp_base.installer import Installer
from mdsp_base.topology import Topology
from megatron_ext.integration.gpt import padded_vocab_size
from megatron_ext.integration.plugin_config import PluginConfig
from megatron_ext.trainer import tokenizer
from megatron_ext.trainer.tokenizer import tokenizer_digest
from megatron_ext.trainer.usage_error import UsageError


def build_tokenizer(args: argparse.Namespace) -> Any:
    """The ``--tokenizer-type`` tokenizer (:mod:`megatron_ext.trainer.tokenizer`), its
    ``--vocab-size`` checked where it sets the vocabulary."""
    if args.tokenizer_type == "NullTokenizer":
        if args.vocab_size < 1:
            raise UsageError(f"--vocab-size {args.vocab_size} must be positive")
        if not args.data_path and args.vocab_size < 256:
            raise UsageError(
                f"--vocab-size {args.vocab_size} is too small for the generated corpus (byte ids 0-255): "
                "pass --vocab-size 256 or more, or --data-path"
            )
    built = tokenizer.build_tokenizer(args)
    # Megatron-LM's two lines about the tokenizer, in its words, from rank 0
    padded = padded_vocab_size(
        built.vocab_size, args.tensor_model_parallel_size, args.make_vocab_size_divisible_by
    )
    if dist.get_rank() == 0:
        print(f"> building {args.tokenizer_type} tokenizer ...", flush=True)
        print(
            f" > padded vocab (size: {built.vocab_size}) with {padded - built.vocab_size} dummy tokens "
            f"(new size: {padded})",
            flush=True,
        )
    return built


def prepare_data(args: argparse.Namespace, rank: int, tokenizer: Any) -> str:
    """The dataset prefix: --data-path (its token ids checked against the vocabulary), or a
    generated local corpus (written by rank 0, documents ended by the tokenizer's EOD)."""
    from megatron_ext.data.indexed import check_indexed_dataset
    from megatron_ext.trainer.corpus import largest_token_id, synthetic_documents, write_indexed_dataset

    if not args.data_path:
        if args.tokenizer_type != "NullTokenizer":  # the documents in the tokenizer's own ids
            name, tokenize = f"local_corpus_{tokenizer_digest(args)}", tokenizer.tokenize
        else:  # bytes: ids below 256, whatever --vocab-size says
            name = "local_corpus" if tokenizer.eod == 256 else f"local_corpus_eod{tokenizer.eod}"
            tokenize = None
        prefix = os.path.join(_cache_dir(args), name)
        if rank == 0 and not os.path.exists(prefix + ".idx"):
            write_indexed_dataset(prefix, synthetic_documents(4000), eod=tokenizer.eod, tokenize=tokenize)
        dist.barrier()
        return prefix
    check_indexed_dataset(args.data_path)
    # One rank reads the ids, every rank gets the answer: all stop together on a mismatch, before
    # megatron-core's embedding silently zeroes out-of-range ids (TP>1) or indexes past its table.
    largest = [largest_token_id(args.data_path) if rank == 0 else None]
    dist.broadcast_object_list(largest, src=0)
    if largest[0] is not None and largest[0] >= tokenizer.vocab_size:
        raise UsageError(
            f"--data-path {args.data_path} holds token id {largest[0]} but the vocabulary has {tokenizer.vocab_size} ids "
            f"(--tokenizer-type {args.tokenizer_type} --vocab-size {args.vocab_size}): pass the --vocab-size of the "
            f"tokenizer that made the data ({largest[0]} or more)"
        )
    return args.data_path


def _cache_dir(args: argparse.Namespace) -> str:
    return args.data_cache_path or os.path.join(os.getcwd(), "runs", "data")


def build_data_iterator(
    args: argparse.Namespace,
    plugins: PluginConfig,
    topology: Topology,
    prefix: str,
    consumed_samples: int,
    global_batch: int,
    tokenizer: Any,
    installer: Installer,
) -> Any:
    """Micro-batches for this rank from ``consumed_samples`` on: the shared-memory loader when
    enabled, otherwise Megatron's stock path (TP rank 0 reads, then broadcasts)."""
    from megatron_ext.data.loader import LoaderSettings, build_batch_iterator
    from megatron_ext.trainer.corpus import build_train_dataset

    rank = dist.get_rank()
    cache = os.path.join(_cache_dir(args), "index-cache")
    num_samples = args.train_iters * global_batch
    # Rank 0 writes the index caches; the others then only read them.
    build = partial(
        build_train_dataset, prefix, args.seq_length, num_samples, args.seed, cache, tokenizer=tokenizer
    )
    dataset = build(is_built_on_rank=True) if rank == 0 else None
    dist.barrier()
    if dataset is None:
        dataset = build()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    settings = LoaderSettings.from_megatron_args(
        args, plugins.shm_data_loader, topology, consumed_samples=consumed_samples, device=device
    )
    # On GPUs the loader stages batches in pinned memory and queues the copy: no host wait per step.
    iterator = build_batch_iterator(dataset, settings)
    installer.add("megatron_ext.data", "a loader (its producer and shared-memory segment)", iterator.close)
    return iterator
