"""Hierarchical ZeRO-3 builds a megatron-core GPT partitioned from construction: the planner reads the
parameters from a meta-device build, no rank ever holds a parameter whole, and the model is the one
a whole build makes, to the bit (DeepSpeed's own zero.Init is not: it loses the position
embeddings' initialisation, which megatron-core writes from the parent module)."""

from __future__ import annotations

import math

import pytest
import torch

from mdsp_base.topology import Topology
from tests.helpers.gpt import seeded_gpt

WORLD = 4
TOPOLOGY = Topology(world_size=WORLD, ranks_per_node=4, ranks_per_package=2)
DS = {
    "train_batch_size": WORLD,
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "Adam", "params": {"torch_adam": True}},
    "hierarchical_zero": {"enabled": True, "secondary_level": "package"},
}


def _gpt() -> torch.nn.Module:
    """A tiny megatron-core GPT, seeded as the main job seeds it."""
    return seeded_gpt(1234, hidden=32, vocab=128, seq=32)


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def _three_builds() -> dict:
    """On each rank: the whole build, DeepSpeed's zero.Init, ours (with what each rank holds)."""
    import deepspeed
    from megatron.core import parallel_state as ps

    from deepspeed_ext.zero import Init, prepare
    from deepspeed_ext.zero.engine.inject import unregister
    from megatron_ext.integration.core_on_cpu import disable_cpu_support, enable_cpu_support
    from megatron_ext.integration.mpu import MegatronMPU
    from megatron_ext.integration.partitioned_build import megatron_model_spec

    enable_cpu_support()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, create_gloo_process_groups=False)
    try:
        whole = {name: p.detach().clone() for name, p in _gpt().named_parameters()}
        with deepspeed.zero.Init(config_dict_or_path=DS, data_parallel_group=ps.get_data_parallel_group()):
            stock = _gathered(_gpt())
        spec = megatron_model_spec(_gpt, DS)
        plan = prepare(spec, DS, mpu=MegatronMPU(), topology=TOPOLOGY)
        with Init(plan.levels, config_dict_or_path=DS):
            model = _gpt()
        held = {name: (p.numel(), p.ds_tensor.numel(), p.ds_numel) for name, p in model.named_parameters()}
        ours = _gathered(model)
        unregister(plan.levels)
        plan.levels.destroy_groups()
        return {"whole": whole, "stock": stock, "ours": ours, "held": held, "spec": spec.param_numels}
    finally:
        ps.destroy_model_parallel()
        disable_cpu_support()


@pytest.fixture(scope="module")
def builds(run_ranks):
    return run_ranks(WORLD, _three_builds, timeout=300)


def test_the_planner_reads_the_parameters_from_a_meta_device_build(builds):
    for rank in builds:
        assert rank["spec"] == tuple(t.numel() for t in rank["whole"].values())


def test_no_rank_holds_a_parameter_whole(builds):
    for rank in builds:
        for name, (visible, partition, numel) in rank["held"].items():
            assert visible == 0, name  # the placeholder DeepSpeed gathers into
            assert partition == math.ceil(numel / WORLD), name


def test_ours_builds_the_whole_builds_model_to_the_bit(builds):
    for rank in builds:
        for name, want in rank["whole"].items():
            assert torch.equal(rank["ours"][name], want), name


def test_deepspeed_zero_init_loses_what_a_parent_initialises(builds):
    """Why ours partitions a module when its parent's __init__ ends: megatron-core initialises the
    position embeddings after torch.nn.Embedding built them, which DeepSpeed's Init has already
    partitioned, so that write is lost and every number drawn after it shifts."""
    stock, whole = builds[0]["stock"], builds[0]["whole"]
    assert torch.equal(stock["embedding.word_embeddings.weight"], whole["embedding.word_embeddings.weight"])
    assert not torch.equal(
        stock["embedding.position_embeddings.weight"], whole["embedding.position_embeddings.weight"]
    )
    assert not torch.equal(
        stock["decoder.layers.0.self_attention.linear_qkv.weight"],
        whole["decoder.layers.0.self_attention.linear_qkv.weight"],
    )
