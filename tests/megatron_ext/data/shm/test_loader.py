"""The shared-memory node loader, and the plugin's stock path (TP rank 0 reads, then broadcasts),
against the batches Megatron-LM feeds its model for the same settings: its sampler's indices
(tests/helpers/megatron_samplers.py), GPTDataset's samples stacked, each key in get_batch_on_this_tp_rank's
dtype (helpers.shm.megatron_batches). Every rank must receive them, token for token.
tests/megatron_ext/integration/test_shm_megatron_reference.py checks the same against upstream's own functions."""

import glob
import uuid

import pytest
import torch.distributed as dist

from mdsp_base.topology import Topology
from megatron_ext.data.config import ShmDataLoaderConfig
from megatron_ext.data.loader import LoaderSettings, build_batch_iterator
from tests.helpers.shm import MBS, MEGATRON_KEYS, batch_differences, gpt_dataset, megatron_batches, take

SLOTS = 3


def _compare(
    prefix, cache, tp, sampler, consumed, steps, job, topology=None, mask=False, documents_apart=False
):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    dataset = gpt_dataset(prefix, cache, documents_apart)
    world = dist.get_world_size()
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    kwargs = dict(
        micro_batch_size=MBS,
        consumed_samples=consumed,
        topology=topology or Topology(world_size=world, ranks_per_node=world, ranks_per_package=1),
        tp_group=ps.get_tensor_model_parallel_group(),
        dp_rank=dp_rank,
        dp_size=dp,
        sampler=sampler,
        create_attention_mask=mask,
    )
    keys = {k for k in MEGATRON_KEYS if mask or k != "attention_mask"}
    megatron = megatron_batches(dataset, sampler, consumed, dp_rank, dp, steps, keys)
    stock = build_batch_iterator(dataset, LoaderSettings(config=ShmDataLoaderConfig(enabled=False), **kwargs))
    from_stock = take(stock, steps)
    stock.close()
    ours = build_batch_iterator(
        dataset,
        LoaderSettings(
            config=ShmDataLoaderConfig(enabled=True, slots=SLOTS, timeout_s=60), job_id=job, **kwargs
        ),
    )
    dist.barrier()
    attached_left = glob.glob(f"/dev/shm/*{job}*")  # unlinked once the node's ranks attached
    got = take(ours, steps)
    ours.close()
    dist.barrier()
    listed = [k for k in MEGATRON_KEYS if k in keys]  # get_batch hands the values on by position
    return dict(
        batches=len(got),
        wrong_keys=[list(b) for b in got + from_stock if list(b) != listed],
        differences=[f"shm loader {d}" for d in batch_differences(got, megatron, keys)]
        + [f"stock path {d}" for d in batch_differences(from_stock, megatron, keys)],
        counters=ours.counters.as_dict(),
        stock=stock.counters.as_dict(),
        left=attached_left + glob.glob(f"/dev/shm/*{job}*"),
        dp=dp_rank,
        tokens=[b["tokens"].sum().item() for b in got],
    )


def _check(results, batches):
    """Every rank got ``batches`` batches, with Megatron's keys in its order and its tensors."""
    assert [r["left"] for r in results] == [[]] * len(results), "segments left in /dev/shm"
    assert [r["batches"] for r in results] == [batches] * len(results)
    assert [r["wrong_keys"] for r in results] == [[]] * len(results), "keys not Megatron's, in its order"
    report = [f"rank {rank}: {line}" for rank, r in enumerate(results) for line in r["differences"]]
    assert not report, "batches differ from Megatron's:\n" + "\n".join(report)


def _check_reads(results, steps, streams_per_node, leaders):
    for r, res in enumerate(results):
        if r in leaders:  # each node reads its samples once, at most `slots` steps ahead
            assert steps * streams_per_node * MBS <= res["counters"]["samples_read"]
            assert res["counters"]["samples_read"] <= (steps + SLOTS) * streams_per_node * MBS
        else:
            assert res["counters"]["samples_read"] == 0


def test_tp_peers_share_a_batch_in_megatrons_single_order_with_masks_read_once_per_node(
    run_ranks, gpt_corpus
):
    results = run_ranks(
        4, _compare, *gpt_corpus, 2, "single", 0, 10, uuid.uuid4().hex[:8], mask=True, timeout=120
    )
    _check(results, 10)
    assert (
        results[0]["tokens"] == results[1]["tokens"] != results[2]["tokens"]
    )  # TP peers share, DP ranks differ
    assert [r["stock"]["samples_read"] for r in results] == [20, 0, 20, 0]  # stock: TP rank 0 of each DP rank
    _check_reads(results, 10, streams_per_node=2, leaders={0})


def test_masks_keep_documents_apart_when_the_dataset_hides_its_eods(run_ranks, gpt_corpus):
    """reset_attention_mask with pad id == EOD id: GPTDataset returns its EODs as 0 after building
    its mask, so the loader carries the document ids of the tokens the dataset read."""
    results = run_ranks(
        2,
        _compare,
        *gpt_corpus,
        2,
        "single",
        0,
        30,
        uuid.uuid4().hex[:8],
        mask=True,
        documents_apart=True,
        timeout=120,
    )
    _check(results, 30)


def test_four_dp_streams_of_one_node_follow_megatrons_random_order_read_once(run_ranks, gpt_corpus):
    results = run_ranks(4, _compare, *gpt_corpus, 1, "random", 0, 10, uuid.uuid4().hex[:8], timeout=120)
    _check(results, 10)
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
    run_ranks, gpt_corpus, sampler, consumed, batches
):
    results = run_ranks(4, _compare, *gpt_corpus, 2, sampler, consumed, 12, uuid.uuid4().hex[:8], timeout=120)
    _check(results, batches)


def test_each_node_reads_its_own_dp_streams_once_with_its_own_producer(run_ranks, gpt_corpus):
    topology = Topology(world_size=4, ranks_per_node=2, ranks_per_package=1)
    results = run_ranks(
        4, _compare, *gpt_corpus, 1, "random", 50 * 8, 8, uuid.uuid4().hex[:8], topology, timeout=120
    )
    _check(results, 8)
    _check_reads(results, 8, streams_per_node=2, leaders={0, 2})


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("sampler,consumed", [("random", 50 * 2), ("single", 428 - 7 * 2 - 1)])
def test_the_producers_workers_deliver_megatrons_order_whatever_their_number(
    gpt_corpus, shm_path, workers, sampler, consumed
):
    # Workers fill steps in turn and publish independently; the rank must still see step after step.
    from megatron_ext.data.batch import ALL_KEYS
    from megatron_ext.data.samplers import SamplerSettings
    from megatron_ext.data.shm.node_loader import ShmBatchIterator

    dataset = gpt_dataset(*gpt_corpus)
    it = ShmBatchIterator(
        dataset,
        SamplerSettings(MBS, consumed, 1, kind=sampler),
        keys=ALL_KEYS,
        config=ShmDataLoaderConfig(enabled=True, slots=SLOTS, timeout_s=60, workers=workers),
        path=shm_path,
        local_index=0,
        node_dp_ranks=[0],
        rank=0,
    )
    got = take(it, 12)
    it.close()
    keys = {"tokens", "labels", "loss_mask", "position_ids"}
    megatron = megatron_batches(dataset, sampler, consumed, 0, 1, 12, keys)
    assert len(megatron) == (12 if sampler == "random" else 7)  # a single pass with 7 steps left
    assert batch_differences(got, megatron, keys) == []


def _rank_with_its_own_rendezvous_label(prefix, cache, job_suffix):
    """Ranks whose environments differ (each its own launcher, say) still meet at one segment: its
    name comes from the node's first rank (label and token), not from what each rank computes."""
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, TORCHELASTIC_RUN_ID=f"launcher-of-rank-{dist.get_rank()}"):
        dataset = gpt_dataset(prefix, cache)
        it = build_batch_iterator(
            dataset,
            LoaderSettings(
                micro_batch_size=MBS,
                consumed_samples=0,
                config=ShmDataLoaderConfig(enabled=True, slots=SLOTS, timeout_s=20),
                topology=Topology(world_size=2, ranks_per_node=2, ranks_per_package=1),
                tp_group=None,
                dp_rank=dist.get_rank(),
                dp_size=2,
                name=f"label{job_suffix}",
            ),
        )
        got = take(it, 3)
        it.close()
    return len(got)


def test_ranks_with_different_environments_share_the_first_ranks_segment(run_ranks, gpt_corpus):
    results = run_ranks(2, _rank_with_its_own_rendezvous_label, *gpt_corpus, uuid.uuid4().hex[:8], timeout=60)
    assert results == [3, 3]
