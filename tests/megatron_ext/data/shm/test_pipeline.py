"""Pipeline parallelism: every rank's batches from the shared-memory node loader, and from the
plugin's stock path, against the batches Megatron-LM feeds its model (helpers.shm.megatron_batches:
its sampler's indices, GPTDataset's samples stacked), at 4 gloo ranks with megatron-core's own pipeline layout (TP=2 x PP=2, TP=1 x PP=2 x
DP=2 on one node and on two nodes, TP=1 x PP=4 with two middle stages).

The keys each stage must get are written here from Megatron-LM core_v0.16.1, not taken from the
module under test: ``pretrain_gpt.get_batch`` returns before touching the iterator on a stage that is
neither first nor last; ``get_batch_on_this_tp_rank`` with PP > 1 broadcasts tokens, attention_mask
and position_ids to the first stage (labels, loss_mask None there) and labels, loss_mask and
attention_mask to the last (tokens, position_ids None there), while TP rank 0, which read the
batch, keeps every key; with PP=1 all five. tests/megatron_ext/integration/test_shm_megatron_reference.py checks the same
against upstream's function itself."""

import glob
import uuid

import pytest
import torch
import torch.distributed as dist

from mdsp_base.topology import Topology
from megatron_ext.data.config import ShmDataLoaderConfig
from megatron_ext.data.loader import LoaderSettings, build_batch_iterator
from megatron_ext.data.shm.node_loader import ShmBatchIterator
from tests.helpers.shm import MBS, batch_differences, gpt_dataset, megatron_batches, take

ALL = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def megatron_stage_keys(first: bool, last: bool, mask: bool, tp_rank: int) -> set[str]:
    if (first and last) or (tp_rank == 0 and (first or last)):
        keys = set(ALL)
    elif first:
        keys = {"tokens", "attention_mask", "position_ids"}
    elif last:
        keys = {"labels", "loss_mask", "attention_mask"}
    else:
        keys = set()
    return keys if mask else keys - {"attention_mask"}


def _compare(prefix, cache, tp, pp, sampler, consumed, steps, job, mask, topology=None):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, create_gloo_process_groups=False
    )
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    dataset = gpt_dataset(prefix, cache)
    kwargs = dict(
        micro_batch_size=MBS,
        consumed_samples=consumed,
        topology=topology or Topology(world_size=4, ranks_per_node=4, ranks_per_package=1),
        tp_group=ps.get_tensor_model_parallel_group(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        sampler=sampler,
        create_attention_mask=mask,
        first_pipeline_stage=first,
        last_pipeline_stage=last,
    )
    want = megatron_stage_keys(first, last, mask, ps.get_tensor_model_parallel_rank())
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    megatron = megatron_batches(dataset, sampler, consumed, dp_rank, dp, steps, want)
    stock = build_batch_iterator(dataset, LoaderSettings(config=ShmDataLoaderConfig(enabled=False), **kwargs))
    expected = take(stock, steps)
    stock.close()
    ours = build_batch_iterator(
        dataset,
        LoaderSettings(
            config=ShmDataLoaderConfig(enabled=True, slots=max(3, pp), timeout_s=60),
            job_id=job,
            pipeline_stages=pp,
            **kwargs,
        ),
    )
    got = take(ours, steps)
    ours.close()
    dist.barrier()
    listed = [k for k in ALL if mask or k != "attention_mask"]
    for batches in (got, expected):
        for b in batches:
            assert list(b) == (listed if pp > 1 else [k for k in ALL if k in want])
            assert {k for k, v in b.items() if v is not None} == want
            assert all(isinstance(b[k], torch.Tensor) for k in want)
    return dict(
        differences=[f"shm loader {d}" for d in batch_differences(got, megatron, want)]
        + [f"stock path {d}" for d in batch_differences(expected, megatron, want)],
        batches=len(got),
        first=first,
        last=last,
        dp=dp_rank,
        on_ring=isinstance(ours, ShmBatchIterator),
        read=ours.counters.samples_read,
        stock_read=stock.counters.samples_read,
        tokens=[b["tokens"].sum().item() for b in got if b.get("tokens") is not None],
        labels=[b["labels"].sum().item() for b in got if b.get("labels") is not None],
        left=glob.glob(f"/dev/shm/*{job}*"),
    )


def _run(run_ranks, corpus, tp, pp, sampler="random", consumed=0, steps=8, mask=True, topology=None):
    results = run_ranks(
        4,
        _compare,
        *corpus,
        tp,
        pp,
        sampler,
        consumed,
        steps,
        uuid.uuid4().hex[:8],
        mask,
        topology,
        timeout=180,
    )
    for r, res in enumerate(results):
        assert res["left"] == [], f"rank {r} saw leftover segments {res['left']}"
    report = [f"rank {rank}: {line}" for rank, r in enumerate(results) for line in r["differences"]]
    assert not report, "batches differ from Megatron's:\n" + "\n".join(report)
    return results


def test_tp2_pp2_first_stage_gets_tokens_last_stage_labels_from_one_read_per_node(run_ranks, gpt_corpus):
    results = _run(run_ranks, gpt_corpus, tp=2, pp=2)
    assert [(r["first"], r["last"]) for r in results] == [(True, False)] * 2 + [(False, True)] * 2
    assert all(r["on_ring"] and r["batches"] == 8 for r in results)
    assert results[0]["tokens"] == results[1]["tokens"] and results[2]["labels"] == results[3]["labels"]
    # one DP stream, read once for the node by its first rank; stock: TP rank 0 of each stage reads
    assert 8 * MBS <= results[0]["read"] <= (8 + 3) * MBS and [r["read"] for r in results[1:]] == [0] * 3
    assert [r["stock_read"] for r in results] == [8 * MBS, 0, 8 * MBS, 0]


@pytest.mark.parametrize("nodes", [1, 2])
def test_pipeline_stages_of_each_dp_rank_get_megatrons_batches_on_one_or_two_nodes(
    run_ranks, gpt_corpus, nodes
):
    topology = Topology(world_size=4, ranks_per_node=4 // nodes, ranks_per_package=1)
    results = _run(run_ranks, gpt_corpus, tp=1, pp=2, topology=topology, mask=False)
    assert [(r["dp"], r["first"]) for r in results] == [(0, True), (1, True), (0, False), (1, False)]
    assert results[0]["tokens"] != results[1]["tokens"]
    leaders = {0} if nodes == 1 else {0, 2}  # each node's ring holds the node's 2 DP streams
    for r, res in enumerate(results):
        assert (res["read"] >= 8 * 2 * MBS) if r in leaders else res["read"] == 0


def test_tp1_pp4_middle_stages_read_nothing_and_stop_with_the_others(run_ranks, gpt_corpus):
    consumed = 428 - 5 * MBS - 1  # a single pass with 5 steps left: every stage stops after 5
    results = _run(run_ranks, gpt_corpus, tp=1, pp=4, sampler="single", consumed=consumed, steps=12)
    assert [r["batches"] for r in results] == [5] * 4
    assert [r["on_ring"] for r in results] == [True, False, False, True]  # middle stages never attach
    assert [r["read"] for r in results] == [5 * MBS, 0, 0, 0] and [r["stock_read"] for r in results][1:3] == [
        0,
        0,
    ]
