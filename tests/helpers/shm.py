"""Helpers shared by the shared-memory loader's tests: the GPT dataset they read, the batches
Megatron-LM would hand its model (written out from its rules, not taken from the plugin), the
node's ring as a forked rank opens it, a dead pid. Waits on events: tests/helpers/waits.py."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch

from megatron_ext.trainer.corpus import ByteTokenizer, gpt_dataset_config
from tests.helpers.megatron_samplers import megatron_order

SEQ, MBS = 32, 2
ATTACKER, VICTIM = "mdspattacker", "mdspvictim"  # local users of the attacks (conftest's ``users``)
# What Megatron-LM's get_batch_on_this_tp_rank hands the model (core_v0.16.1, megatron/training/
# utils.py): the keys in this order, with the dtypes of the buffers the other TP ranks receive into
# (TP rank 0 keeps the collated tensors of GPTDataset, which have the same dtypes).
MEGATRON_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
MEGATRON_DTYPES = {
    "tokens": torch.int64,
    "labels": torch.int64,
    "loss_mask": torch.float32,
    "attention_mask": torch.bool,
    "position_ids": torch.int64,
}


class PadIsEodTokenizer(ByteTokenizer):
    pad = ByteTokenizer.eod


def gpt_dataset(prefix: str, cache: str, documents_apart: bool = False) -> Any:
    """megatron-core's GPTDataset over ``prefix`` (sequences of SEQ, seed 1234), building its own
    attention masks. ``documents_apart``: the masks keep documents apart, and the returned tokens
    hide the EODs (set to 0), as with a tokenizer whose pad id is the EOD id."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    config = gpt_dataset_config(prefix, SEQ, 1234, cache, create_attention_mask=True)
    if documents_apart:
        config = dataclasses.replace(
            config, reset_attention_mask=True, tokenizer=PadIsEodTokenizer(), allow_ambiguous_pad_tokens=True
        )
    return BlendedMegatronDatasetBuilder(GPTDataset, [10, 0, 0], lambda: True, config).build()[0]


def take(iterator: Iterator, steps: int) -> list:
    """Up to ``steps`` items: fewer when the iterator ends."""
    items = []
    for _ in range(steps):
        try:
            items.append(next(iterator))
        except StopIteration:
            break
    return items


def megatron_batches(
    dataset: Any,
    sampler: str,
    consumed: int,
    dp_rank: int,
    dp: int,
    steps: int,
    keys: set[str],
    mbs: int = MBS,
) -> list[dict[str, torch.Tensor]]:
    """The micro-batches Megatron-LM feeds one DP rank's model for ``steps`` steps: its sampler's
    sample indices (tests/helpers/megatron_samplers.py), each key the samples of GPTDataset stacked as
    torch's default collate does, TP peers receiving the same tensors by broadcast. Only ``keys``."""
    order = megatron_order(sampler, len(dataset), consumed, mbs, dp_rank, dp)
    batches = []
    for _, indices in zip(range(steps), order):
        samples = [dataset[j] for j in indices]
        batches.append({key: torch.stack([s[key] for s in samples]) for key in MEGATRON_KEYS if key in keys})
    return batches


def batch_differences(got: list[dict], expected: list[dict], keys: set[str]) -> list[str]:
    """Where ``got`` differs from Megatron's batches in ``keys`` (dtype, shape, values), per step."""
    found = [] if len(got) == len(expected) else [f"{len(got)} batches, Megatron {len(expected)}"]
    for step, (a, b) in enumerate(zip(got, expected)):
        for key in sorted(keys):
            x, y = a.get(key), b[key]
            if x is None:
                found.append(f"step {step} {key}: missing")
            elif (x.dtype, x.shape) != (MEGATRON_DTYPES[key], y.shape):
                found.append(
                    f"step {step} {key}: {x.dtype}{list(x.shape)}, Megatron {MEGATRON_DTYPES[key]}{list(y.shape)}"
                )
            elif not torch.equal(x, y.to(x.dtype)):
                found.append(f"step {step} {key}: values differ")
    return found


def node_iterator(
    dataset: Any,
    path: str,
    local: int,
    consumers: int,
    timeout_s: float,
    workers: int = 1,
) -> Any:
    """Local rank ``local`` of a node of ``consumers`` ranks (each its own DP rank) on the ring at
    ``path``: micro-batches of 2 in Megatron's random order, 2 slots, no attention mask."""
    from megatron_ext.data.batch import ALL_KEYS
    from megatron_ext.data.config import ShmDataLoaderConfig
    from megatron_ext.data.samplers import SamplerSettings
    from megatron_ext.data.shm.node_loader import ShmBatchIterator

    return ShmBatchIterator(
        dataset,
        SamplerSettings(2, 0, consumers, kind="random"),
        keys=ALL_KEYS,
        path=path,
        local_index=local,
        config=ShmDataLoaderConfig(enabled=True, slots=2, timeout_s=timeout_s, workers=workers),
        node_dp_ranks=list(range(consumers)),
        rank=local,
    )


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; None when it is gone or a zombie (tests
    watch their own children with it: pid plus start time names a process of this namespace)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return None
    fields = stat_line[stat_line.rindex(b")") + 2 :].split()  # the name may hold spaces and parentheses
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def is_alive(pid: int, start_time: int | None) -> bool:
    return pid > 0 and start_time is not None and process_start_time(pid) == start_time
