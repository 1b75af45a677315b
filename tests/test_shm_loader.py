"""The shared-memory node loader against Megatron's stock path (TP rank 0 reads, then broadcasts):
every rank must receive the same batches, token for token, for the same settings."""

import dataclasses
import glob
import itertools
import uuid

import pytest
import torch
import torch.distributed as dist
from megatron_samplers import megatron_order

from deepspeed_ext.topology import Topology
from megatron_ext.data.config import ShmDataLoaderConfig
from megatron_ext.data.gpt_dataset import (
    ByteTokenizer,
    gpt_dataset_config,
    synthetic_documents,
    write_indexed_dataset,
)
from megatron_ext.data.loader import build_batch_iterator

SEQ, MBS, SLOTS = 32, 2, 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A 428-sample corpus (one epoch is short, so resumes cross epoch boundaries), index cached."""
    root = tmp_path_factory.mktemp("shm-corpus")
    prefix = str(root / "corpus")
    write_indexed_dataset(prefix, synthetic_documents(60))
    assert len(_dataset(prefix, str(root / "cache"))) == 428  # builds the cache once, before the ranks
    return prefix, str(root / "cache")


class PadIsEodTokenizer(ByteTokenizer):
    pad = ByteTokenizer.eod


def _dataset(prefix, cache, documents_apart=False):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    # The dataset creates the attention mask, so the stock path broadcasts Megatron's own mask.
    config = gpt_dataset_config(prefix, SEQ, 1234, cache, create_attention_mask=True)
    if documents_apart:  # masks keep documents apart, and the returned tokens hide the EODs (set to 0)
        config = dataclasses.replace(
            config, reset_attention_mask=True, tokenizer=PadIsEodTokenizer(), allow_ambiguous_pad_tokens=True
        )
    return BlendedMegatronDatasetBuilder(GPTDataset, [10, 0, 0], lambda: True, config).build()[0]


def _take(iterator, steps):
    batches = []
    for _ in range(steps):
        try:
            batches.append(next(iterator))
        except StopIteration:
            break
    return batches


def _compare(
    prefix, cache, tp, sampler, consumed, steps, job, topology=None, mask=False, documents_apart=False
):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    dataset = _dataset(prefix, cache, documents_apart)
    world = dist.get_world_size()
    kwargs = dict(
        micro_batch_size=MBS,
        consumed_samples=consumed,
        topology=topology or Topology(world_size=world, ranks_per_node=world, ranks_per_package=1),
        tp_group=ps.get_tensor_model_parallel_group(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        sampler=sampler,
        create_attention_mask=mask,
    )
    stock = build_batch_iterator(dataset, config=ShmDataLoaderConfig(enabled=False), **kwargs)
    expected = _take(stock, steps)
    stock.close()
    ours = build_batch_iterator(
        dataset, config=ShmDataLoaderConfig(enabled=True, slots=SLOTS, timeout_s=60), job_id=job, **kwargs
    )
    dist.barrier()
    attached_left = glob.glob(f"/dev/shm/*{job}*")  # unlinked once the node's ranks attached
    got = _take(ours, steps)
    ours.close()
    dist.barrier()
    assert [list(b) for b in got] == [list(b) for b in expected], "keys differ"
    for i, (a, b) in enumerate(zip(got, expected)):
        for key in a:
            assert torch.equal(a[key], b[key]), f"rank {dist.get_rank()} batch {i} key {key} differs"
    # and both hold the samples Megatron's own sampler picks
    order = megatron_order(
        sampler, len(dataset), consumed, MBS, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    )
    for batch, indices in zip(got, order):
        assert torch.equal(batch["tokens"], torch.stack([dataset[j]["tokens"] for j in indices]))
    return dict(
        batches=len(got),
        counters=ours.counters.as_dict(),
        stock=stock.counters.as_dict(),
        left=attached_left + glob.glob(f"/dev/shm/*{job}*"),
        dp=ps.get_data_parallel_rank(),
        tokens=[b["tokens"].sum().item() for b in got],
    )


def _check_reads(results, steps, streams_per_node, leaders):
    for r, res in enumerate(results):
        assert res["left"] == [], f"rank {r} saw leftover segments {res['left']}"
        if r in leaders:  # each node reads its samples once, at most `slots` steps ahead
            assert steps * streams_per_node * MBS <= res["counters"]["samples_read"]
            assert res["counters"]["samples_read"] <= (steps + SLOTS) * streams_per_node * MBS
        else:
            assert res["counters"]["samples_read"] == 0


def test_tp_peers_share_a_batch_in_megatrons_single_order_with_masks_read_once_per_node(run_ranks, corpus):
    results = run_ranks(
        4, _compare, *corpus, 2, "single", 0, 10, uuid.uuid4().hex[:8], mask=True, timeout=120
    )
    assert [r["batches"] for r in results] == [10] * 4
    assert (
        results[0]["tokens"] == results[1]["tokens"] != results[2]["tokens"]
    )  # TP peers share, DP ranks differ
    assert [r["stock"]["samples_read"] for r in results] == [20, 0, 20, 0]  # stock: TP rank 0 of each DP rank
    _check_reads(results, 10, streams_per_node=2, leaders={0})


def test_masks_keep_documents_apart_when_the_dataset_hides_its_eods(run_ranks, corpus):
    """reset_attention_mask with pad id == EOD id: GPTDataset returns its EODs as 0 after building
    its mask, so the loader carries the document ids of the tokens the dataset read."""
    results = run_ranks(
        2,
        _compare,
        *corpus,
        2,
        "single",
        0,
        30,
        uuid.uuid4().hex[:8],
        mask=True,
        documents_apart=True,
        timeout=120,
    )
    assert [r["batches"] for r in results] == [30] * 2


def test_four_dp_streams_of_one_node_follow_megatrons_random_order_read_once(run_ranks, corpus):
    results = run_ranks(4, _compare, *corpus, 1, "random", 0, 10, uuid.uuid4().hex[:8], timeout=120)
    assert len({tuple(r["tokens"]) for r in results}) == 4
    _check_reads(results, 10, streams_per_node=4, leaders={0})


@pytest.mark.parametrize(
    "sampler,consumed,batches",
    [
        ("random", 100 * 4, 12),  # 7 steps left in epoch 0, then epoch 1
        ("single", 428 - 3 * 4 - 1, 3),  # 3 steps left: both paths stop at the same step
    ],
)
def test_a_resumed_loader_continues_megatrons_order_from_the_consumed_samples(
    run_ranks, corpus, sampler, consumed, batches
):
    results = run_ranks(4, _compare, *corpus, 2, sampler, consumed, 12, uuid.uuid4().hex[:8], timeout=120)
    assert [r["batches"] for r in results] == [batches] * 4


def test_each_node_reads_its_own_dp_streams_once_with_its_own_producer(run_ranks, corpus):
    topology = Topology(world_size=4, ranks_per_node=2, ranks_per_package=1)
    results = run_ranks(
        4, _compare, *corpus, 1, "random", 50 * 8, 8, uuid.uuid4().hex[:8], topology, timeout=120
    )
    _check_reads(results, 8, streams_per_node=2, leaders={0, 2})


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("sampler,consumed", [("random", 50 * 2), ("single", 428 - 7 * 2 - 1)])
def test_the_producers_workers_deliver_megatrons_order_whatever_their_number(
    corpus, workers, sampler, consumed
):
    # Workers fill steps in turn and publish independently; the rank must still see step after step.
    from megatron_ext.data.batch import ALL_KEYS
    from megatron_ext.data.samplers import SamplerSettings
    from megatron_ext.data.shm_loader import ShmBatchIterator
    from megatron_ext.data.shm_segment import segment_path

    dataset = _dataset(*corpus)
    it = ShmBatchIterator(
        dataset,
        SamplerSettings(MBS, consumed, 1, kind=sampler),
        keys=ALL_KEYS,
        config=ShmDataLoaderConfig(enabled=True, slots=SLOTS, timeout_s=60, workers=workers),
        path=segment_path("/dev/shm", f"workers{uuid.uuid4().hex[:8]}", 0),
        local_index=0,
        node_dp_ranks=[0],
        rank=0,
    )
    got = _take(it, 12)
    it.close()
    order = list(itertools.islice(megatron_order(sampler, len(dataset), consumed, MBS, 0, 1), 12))
    assert len(got) == len(order) == (12 if sampler == "random" else 7)
    for batch, indices in zip(got, order):
        assert torch.equal(batch["tokens"], torch.stack([dataset[j]["tokens"] for j in indices]))
        assert torch.equal(batch["labels"], torch.stack([dataset[j]["labels"] for j in indices]))


def _rank_with_its_own_rendezvous_label(prefix, cache, job_suffix):
    """Ranks whose environments differ (each its own launcher, say) still meet at one segment: its
    name comes from the node's first rank (label and token), not from what each rank computes."""
    import os

    os.environ["TORCHELASTIC_RUN_ID"] = f"launcher-of-rank-{dist.get_rank()}"
    dataset = _dataset(prefix, cache)
    it = build_batch_iterator(
        dataset,
        micro_batch_size=MBS,
        consumed_samples=0,
        config=ShmDataLoaderConfig(enabled=True, slots=SLOTS, timeout_s=20),
        topology=Topology(world_size=2, ranks_per_node=2, ranks_per_package=1),
        tp_group=None,
        dp_rank=dist.get_rank(),
        dp_size=2,
        name=f"label{job_suffix}",
    )
    got = _take(it, 3)
    it.close()
    del os.environ["TORCHELASTIC_RUN_ID"]
    return len(got)


def test_ranks_with_different_environments_share_the_first_ranks_segment(run_ranks, corpus):
    assert run_ranks(2, _rank_with_its_own_rendezvous_label, *corpus, uuid.uuid4().hex[:8], timeout=60) == [
        3,
        3,
    ]
