"""The node loader's GPU path: batches land on the device equal to the batches Megatron's rules give,
copied with non_blocking=True through a pinned staging buffer (the default) or, with ``pinned_ring``,
straight from the ring (registered once as pinned host memory, no host copy); every key derived and
the attention mask built on the device; ``next()`` makes no synchronising CUDA call."""

import dataclasses

import pytest
import torch
from megatron.core import parallel_state as ps

from megatron_ext.data.config import ShmDataLoaderConfig
from megatron_ext.data.loader import LoaderSettings, build_batch_iterator
from megatron_ext.trainer.corpus import gpt_dataset_config, synthetic_documents, write_indexed_dataset
from tests.helpers.shm import megatron_batches

SEQ, MBS, STEPS = 64, 4, 12


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    root = tmp_path_factory.mktemp("gpu-corpus")
    prefix = str(root / "corpus")
    write_indexed_dataset(prefix, synthetic_documents(400))
    # Documents are shorter than a sample, so masks with reset_attention_mask differ from causal ones.
    config = dataclasses.replace(
        gpt_dataset_config(prefix, SEQ, 1234, str(root / "cache"), create_attention_mask=True),
        reset_attention_mask=True,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, [STEPS * MBS, 0, 0], lambda: True, config).build()[0]


def _iterator(dataset, device, enabled, mask, pinned_ring=False):
    return build_batch_iterator(
        dataset,
        LoaderSettings(
            micro_batch_size=MBS,
            consumed_samples=0,
            config=ShmDataLoaderConfig(enabled=enabled, timeout_s=60, pinned_ring=pinned_ring),
            topology=None,
            tp_group=ps.get_tensor_model_parallel_group(),
            dp_rank=0,
            dp_size=1,
            create_attention_mask=mask,
            name=f"gpu-{enabled}-{mask}",
            device=device,
        ),
    )


@pytest.mark.parametrize("pinned_ring", [False, True], ids=["staged", "pinned ring"])
@pytest.mark.parametrize("mask", [False, True])
def test_batches_on_the_device_equal_megatrons_path(cuda_rank, dataset, mask, pinned_ring):
    keys = {"tokens", "labels", "loss_mask", "position_ids", *(["attention_mask"] if mask else [])}
    megatron = megatron_batches(dataset, "single", 0, 0, 1, STEPS, keys, mbs=MBS)
    expected = [{k: v.to(cuda_rank) for k, v in batch.items()} for batch in megatron]
    ours = _iterator(dataset, cuda_rank, True, mask, pinned_ring)
    try:
        got = [next(ours) for _ in range(STEPS)]
    finally:
        ours.close()
    for step, (want, have) in enumerate(zip(expected, got)):
        assert [k for k in have if have[k] is not None] == list(want), (
            step
        )  # get_batch_on_this_tp_rank's order
        for key in want:
            assert have[key].device == cuda_rank and have[key].dtype == want[key].dtype, (step, key)
            assert torch.equal(have[key], want[key]), (step, key)
    if mask:  # the dataset's own mask, reset at EODs: not the plain causal one
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool, device=cuda_rank).triu(1)
        assert any(not torch.equal(b["attention_mask"][0, 0], causal) for b in got)


@pytest.mark.parametrize("pinned_ring", [False, True], ids=["staged", "pinned ring"])
@pytest.mark.parametrize("mask", [False, True])
def test_next_makes_no_synchronising_cuda_call(cuda_rank, dataset, mask, pinned_ring):
    ours = _iterator(dataset, cuda_rank, True, mask, pinned_ring)
    try:
        next(ours)  # the first call builds the causal triangle on the device
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call inside next() raises
        try:
            for _ in range(STEPS - 2):
                next(ours)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        ours.close()


def test_the_ring_itself_is_pinned_and_its_slots_return_after_their_copies(cuda_rank, dataset):
    ours = _iterator(dataset, cuda_rank, True, False, pinned_ring=True)
    try:
        rows = ours._rows  # the ring's own pages, registered with cudaHostRegister: no staging buffer
        assert all(torch.from_numpy(row).is_pinned() for row in rows)
        batches = [next(ours) for _ in range(STEPS - 1)]  # more steps than slots: slots were released
        torch.cuda.synchronize()
        assert len(batches) == STEPS - 1 and all(b["tokens"].device == cuda_rank for b in batches)
    finally:
        ours.close()  # waits for copies in flight, unregisters the pages, then unmaps
