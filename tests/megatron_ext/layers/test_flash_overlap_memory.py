"""Activation memory of the Flash-Overlap backends against megatron-core's layers: what each one's
autograd saves for backward in one forward of a GPT at TP=2 and 4, per linear. The p2p backend
saves what megatron-core saves, everywhere; the symm_mem backend (its autograd functions over
torch's reference implementations of the fused ops, which return the tensors the fused ops return)
saves TP times megatron-core's bytes for qkv and fc1, whose gathered input it keeps, and the same
elsewhere. ``python -m benchmarks.studies.flash_overlap.activation_memory`` prints the same figures."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.studies.flash_overlap.activation_memory import BACKENDS, SLOTS, measure
from tests.helpers.flash_overlap import setup_tp

GPT = argparse.Namespace(layers=2, hidden=24, heads=4, seq=12, batch=2, vocab=100)


def _saved_bytes(tp: int) -> dict[str, dict[str, int]]:
    setup_tp(tp)
    return {backend: measure(GPT, backend) for backend in BACKENDS}


@pytest.mark.parametrize("tp", [2, 4])
def test_p2p_keeps_what_megatron_core_keeps_and_symm_mem_tp_times_qkv_and_fc1_inputs(run_ranks, tp):
    for rank, saved in enumerate(run_ranks(tp, _saved_bytes, tp)):
        megatron_core, p2p, symm_mem = (saved[b] for b in BACKENDS)
        assert set(megatron_core) == {*SLOTS, "other"}, f"rank {rank}: {megatron_core}"
        assert p2p == megatron_core, f"rank {rank}"
        assert symm_mem == {
            **megatron_core,
            "linear_qkv": tp * megatron_core["linear_qkv"],
            "linear_fc1": tp * megatron_core["linear_fc1"],
        }, f"rank {rank}"
