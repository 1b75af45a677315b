"""megatron-core's GPTModel on CPU/gloo through the shim: TP=2 (with and without sequence
parallelism) trains exactly as a single process does, and the shim is inert when CUDA exists."""

import pytest
import torch

from tests.helpers.gpt import seeded_gpt

STEPS = 4


def _train_losses(tp: int, sequence_parallel: bool) -> list[float]:
    from megatron.core import parallel_state as ps

    from megatron_ext.integration.core_on_cpu import enable_cpu_support
    from megatron_ext.integration.gpt import gpt_loss
    from megatron_ext.layers.sequence_parallel import allreduce_sequence_parallel_grads

    enable_cpu_support()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    model = seeded_gpt(1, hidden=48, vocab=128, seq=16, tp=tp, sequence_parallel=sequence_parallel)
    allreduce_sequence_parallel_grads(model, ps.get_tensor_model_parallel_group())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(STEPS):  # one batch, learnt by heart: the loss must fall
        batch = {
            "tokens": tokens[:, :-1],
            "labels": tokens[:, 1:],
            "loss_mask": torch.ones(2, 16),
            "position_ids": torch.arange(16).expand(2, 16),
        }
        loss = gpt_loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _all_layouts() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = {}
    for tp, sp in ((2, False), (2, True)):
        out[(tp, sp)] = _train_losses(tp, sp)
        ps.destroy_model_parallel()
    # A TP=1 reference on the same process: DP=2 ranks see the same data, so each is a single-process run.
    out[(1, False)] = _train_losses(1, False)
    dist.barrier()
    return out


def test_tensor_and_sequence_parallel_gpt_match_a_single_process(run_ranks):
    results = run_ranks(2, _all_layouts, timeout=300)
    reference = results[0][(1, False)]
    assert reference[-1] < reference[0]
    # A TP-split GEMM sums over its shards and then across ranks, one rank's GEMM in one order: fp32
    # differences of a few ulps per step, carried through the training steps into the losses.
    for rank_result in results:
        for layout, losses in rank_result.items():
            assert losses == pytest.approx(reference, rel=1e-5, abs=1e-6), layout


def test_shim_is_inert_when_cuda_is_present(monkeypatch):
    import megatron_ext.integration.core_on_cpu as cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpu, "_undo", [])
    before = torch.cuda.current_device
    assert cpu.enable_cpu_support() is False
    assert torch.cuda.current_device is before


def test_shim_is_undone_by_disable(monkeypatch):
    from megatron.core.tensor_parallel import random as mp_random

    import megatron_ext.integration.core_on_cpu as cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpu, "_undo", [])  # as in a fresh process, whatever earlier tests enabled
    names = [
        (torch.cuda, "current_device"),
        (mp_random, "_get_cuda_rng_state"),
        (mp_random, "_set_cuda_rng_state"),
        (mp_random.CudaRNGStatesTracker, "add"),
    ]
    before = [getattr(owner, name) for owner, name in names]
    assert cpu.enable_cpu_support() and torch.cuda.current_device() == "cpu"
    cpu.disable_cpu_support()
    assert not cpu.cpu_support_enabled()
    assert [getattr(owner, name) for owner, name in names] == before
