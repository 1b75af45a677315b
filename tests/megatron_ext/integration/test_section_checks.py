"""Each plugin's start-up checks of Megatron's flags are methods of its configuration section, usable
without the upstream hooks: a disabled section accepts any flags, an enabled one refuses what its
plugin cannot honour, naming the flag. (Through the hooks, per upstream: test_megatron_args.py.)"""

from __future__ import annotations

import argparse

import pytest

from deepspeed_ext.zero.config import HierarchicalZeroConfig
from mdsp_base.section import ConfigError
from megatron_ext.data.config import ShmDataLoaderConfig
from megatron_ext.layers.config import FlashOverlapConfig

# flags none of the plugins can honour as given
EVERYTHING = argparse.Namespace(
    pipeline_model_parallel_size=2,
    virtual_pipeline_model_parallel_size=2,
    sft=True,
    dataloader_type="external",
    ds_sequence_parallel_size=2,
    tensor_model_parallel_size=2,
    sequence_parallel=False,
    deepspeed=False,
)


@pytest.mark.parametrize(
    "check",
    [
        ShmDataLoaderConfig().check_megatron_args,
        HierarchicalZeroConfig().check_megatron_args,
        FlashOverlapConfig().check_megatron_args,
        FlashOverlapConfig().check_legacy_model_args,
    ],
)
def test_a_disabled_section_accepts_any_flags(check):
    check(EVERYTHING)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"pipeline_model_parallel_size": 2, "mtp_num_layers": 1}, "drop --mtp-num-layers"),
        ({"full_validation": True}, "cannot be combined with --full-validation"),
        ({"dataloader_type": "external"}, "--dataloader-type external with shm_data_loader"),
        ({"ds_sequence_parallel_size": 2}, "--ds-sequence-parallel-size > 1"),
    ],
)
def test_the_loader_refuses_what_it_cannot_feed(fields, needle):
    with pytest.raises(ConfigError, match=needle):
        ShmDataLoaderConfig(enabled=True).check_megatron_args(argparse.Namespace(**fields))
    ShmDataLoaderConfig(enabled=True).check_megatron_args(argparse.Namespace(dataloader_type="cyclic"))


def test_hierarchical_zero_needs_deepspeed():
    with pytest.raises(ConfigError, match="pass --deepspeed"):
        HierarchicalZeroConfig(enabled=True).check_megatron_args(argparse.Namespace())
    HierarchicalZeroConfig(enabled=True).check_megatron_args(argparse.Namespace(deepspeed=True))


def test_flash_overlap_needs_sequence_parallelism_at_tp_above_one():
    tp2 = argparse.Namespace(tensor_model_parallel_size=2, sequence_parallel=False)
    with pytest.raises(ConfigError, match="pass --sequence-parallel$"):
        FlashOverlapConfig(enabled=True).check_megatron_args(tp2)
    with pytest.raises(ConfigError, match=r"pass --sequence-parallel \(TP=2\)"):
        FlashOverlapConfig(enabled=True).check_legacy_model_args(tp2)
    tp2.sequence_parallel = True
    FlashOverlapConfig(enabled=True).check_megatron_args(tp2)
    FlashOverlapConfig(enabled=True).check_legacy_model_args(tp2)
