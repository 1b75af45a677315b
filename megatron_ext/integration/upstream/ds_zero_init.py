"""Megatron-DeepSpeed's ``deepspeed.zero.Init`` with hierarchical ZeRO: partitioned from construction.

``model_provider`` builds the model under ``zero.Init`` so that no rank holds it whole. With
``--hierarchical-zero`` the Init is ours, on a plan made before the model exists: the tree's
``GPTModel`` is built once on the meta device (no memory, no random numbers) for its parameter
shapes, the planner picks the secondary level from them, and the real build partitions each
module over the plan's groups as it is made, the secondary copy included. The group partitioned
over is the one stock's Init gets (sequence x data parallel with Ulysses), so the model is the
one stock builds, to the bit. Megatron-DeepSpeed's ``deepspeed.initialize`` call cannot carry the
plan: :func:`~.megatron_deepspeed.deepspeed_initialize` finds it by the partition.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from mdsp_base.section import ConfigError
from megatron_ext.integration.partitioned_build import partitioned_plan
from megatron_ext.integration.upstream.hooks import installer, megatron_args, plugin_config


def _gpt(args: Any) -> Any:
    """The ``GPTModel`` that ``model_provider`` builds without DeepSpeed's pipeline engine (which
    hierarchical ZeRO refuses), from the same config."""
    from megatron.arguments import core_transformer_config_from_args
    from megatron.model import GPTModel

    config = core_transformer_config_from_args(args)
    return GPTModel(
        config=config, num_tokentypes=0, parallel_output=True, pre_process=True, post_process=True
    )


def hierarchical_zero_init(kwargs: dict) -> Any:
    """``deepspeed_ext.zero.Init`` in place of the ``deepspeed.zero.Init(**kwargs)`` of
    ``model_provider``, over the same group, with the plan made from the meta build."""
    from megatron.core import parallel_state

    from deepspeed_ext.zero import Init

    args = megatron_args()
    if kwargs.get("remote_device") not in (None, "none"):
        raise ConfigError(
            f"--remote-device {kwargs['remote_device']} offloads parameters, which hierarchical_zero does "
            "not support (the secondary copy would be offloaded too): drop --remote-device"
        )
    ds = kwargs.pop("config_dict_or_path", None) or args.deepspeed_config_dict
    mpu = kwargs.pop("mpu", None) or parallel_state
    given = kwargs.pop("data_parallel_group", None)
    kwargs.pop("remote_device", None)
    plan = partitioned_plan(lambda: _gpt(args), ds, plugin_config(), mpu, installer())
    ranks = list(plan.levels.dp_ranks)
    if given is not None and dist.get_process_group_ranks(given) != ranks:
        raise ConfigError(
            f"model_provider partitions over ranks {dist.get_process_group_ranks(given)}, DeepSpeed's engine "
            f"over {ranks}: pass the mpu's sequence-data-parallel group to zero.Init"
        )
    return Init(plan.levels, config_dict_or_path=ds, mpu=mpu, **kwargs)
