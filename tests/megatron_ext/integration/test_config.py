"""The plugin sections of the DeepSpeed JSON: defaults, overrides by flags, and errors that name the fix."""

import argparse
import json

import pytest

from mdsp_base.section import ConfigError
from megatron_ext.integration.args import extra_args_provider, plugin_config_from_args
from megatron_ext.integration.plugin_config import PluginConfig, load_plugin_config, validate_against_world


def test_defaults_leave_every_plugin_off():
    config = load_plugin_config({"train_micro_batch_size_per_gpu": 2})
    assert not (
        config.shm_data_loader.enabled or config.hierarchical_zero.enabled or config.flash_overlap.enabled
    )
    assert config.flash_overlap.layers == ["qkv", "proj", "fc1", "fc2"]


def test_every_field_is_documented():
    for section in PluginConfig.model_fields.values():
        model = section.annotation
        if hasattr(model, "model_fields"):
            for name, field in model.model_fields.items():
                assert field.description, f"{model.__name__}.{name} has no docstring"


def test_json_file_and_dict_give_the_same_config(tmp_path):
    raw = {
        "zero_optimization": {"stage": 3},
        "hierarchical_zero": {"enabled": True, "secondary_level": "node"},
        "shm_data_loader": {"enabled": True, "slots": 8},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    assert load_plugin_config(str(path)) == load_plugin_config(raw)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"shm_data_loader": {"slotz": 3}},
            "unknown key 'shm_data_loader.slotz'; valid keys here: enabled, pinned_ring, shm_dir, slots",
        ),
        (
            {"shm_data_loader": {"slots": 0}},
            "shm_data_loader.slots=0: Input should be greater than or equal to 1",
        ),
        ({"shm_data_loader": {"timeout_s": "soon"}}, "shm_data_loader.timeout_s='soon'"),
        (
            {"flash_overlap": {"layers": ["qkv", "fc3"]}},
            "flash_overlap.layers.1='fc3': Input should be 'qkv', 'proj', 'fc1' or 'fc2'",
        ),
        ({"hierarchical_zero": {"enabled": True}}, "needs zero_optimization.stage 3, got stage 0"),
        ({"hierarchical_zero": {"secondary_level": "rack"}}, "hierarchical_zero.secondary_level='rack'"),
        (
            {"flash_overlapp": {"enabled": True}},
            "unknown top-level section 'flash_overlapp': did you mean 'flash_overlap'?",
        ),
        ({"topology": 8}, "topology=8: must be a JSON object"),
        # JSON's types, strictly: a string is neither a number nor a boolean
        ({"shm_data_loader": {"slots": "8"}}, "shm_data_loader.slots='8': Input should be a valid integer"),
        (
            {"flash_overlap": {"enabled": "true"}},
            "flash_overlap.enabled='true': Input should be a valid boolean",
        ),
        (
            {"hierarchical_zero": {"enabled": "yes"}},
            "hierarchical_zero.enabled='yes': Input should be a valid boolean",
        ),
        (
            {"hierarchical_zero": {"link_bandwidth_gbps": {"inter_node": -25}}},
            "hierarchical_zero.link_bandwidth_gbps.inter_node=-25: Input should be greater than 0",
        ),
        (
            {"hierarchical_zero": {"link_bandwidth_gbps": {"inter_node": float("nan")}}},
            "hierarchical_zero.link_bandwidth_gbps.inter_node=nan: Input should be a finite number",
        ),
    ],
)
def test_bad_values_name_key_value_and_what_is_valid(raw, message):
    with pytest.raises(ConfigError) as err:
        load_plugin_config(raw)
    assert message in str(err.value)


def test_missing_and_malformed_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_plugin_config(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json' is not valid JSON"):
        load_plugin_config(str(bad))


def test_json_integers_fill_float_fields_and_enums_take_their_strings():
    config = load_plugin_config(
        {"shm_data_loader": {"timeout_s": 30}, "hierarchical_zero": {"secondary_level": "node"}}
    )
    assert config.shm_data_loader.timeout_s == 30.0 and config.hierarchical_zero.secondary_level == "node"


def test_the_loaders_directory_is_checked_at_start_up(tmp_path, caplog):
    missing = load_plugin_config({"shm_data_loader": {"enabled": True, "shm_dir": str(tmp_path / "gone")}})
    with pytest.raises(ConfigError, match=r"shm_dir='.*gone' is not a directory: point it at a tmpfs"):
        validate_against_world(missing, world_size=2, data_parallel_size=2)
    on_tmpfs = load_plugin_config({"shm_data_loader": {"enabled": True, "shm_dir": "/dev/shm"}})
    validate_against_world(on_tmpfs, world_size=2, data_parallel_size=2)
    assert "not a tmpfs" not in caplog.text


def test_a_ring_that_cannot_fit_fails_at_start_up_with_its_numbers():
    from megatron_ext.data.config import check_shm_space_at_start
    from megatron_ext.data.shm.segment import free_bytes

    config = load_plugin_config({"shm_data_loader": {"enabled": True, "shm_dir": "/dev/shm", "slots": 4}})
    # 8 ranks at TP=1, micro-batch 4 of 2048 tokens, int32 ids: 4 slots of 8 x 4 x 2049 x 4 bytes, about 1 MiB
    check_shm_space_at_start(config.shm_data_loader, 8, 1, 4, 2048, 100_000)
    free = free_bytes("/dev/shm")
    # a micro-batch whose 4 slots need more than the whole tmpfs
    huge = free // (4 * 8 * 4) // 2048 + 1
    with pytest.raises(ConfigError, match=r"needs \d+ bytes in /dev/shm but only \d+ bytes are free: lower"):
        check_shm_space_at_start(config.shm_data_loader, 8, 1, huge, 2048, 100_000)


def test_world_checks_print_every_factor():
    config = load_plugin_config({"topology": {"ranks_per_node": 8, "ranks_per_package": 3}})
    with pytest.raises(
        ConfigError, match=r"ranks_per_node\(8\) is not a multiple of topology.ranks_per_package\(3\)"
    ):
        validate_against_world(config, world_size=16, data_parallel_size=8)
    config = load_plugin_config({"topology": {"ranks_per_node": 8}})
    with pytest.raises(ConfigError, match=r"world\(12\) is not a whole number of nodes"):
        validate_against_world(config, world_size=12, data_parallel_size=12)


def test_flags_override_the_json_and_only_when_given(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3},
                "shm_data_loader": {"slots": 6},
                "flash_overlap": {"mode": "ring"},
            }
        )
    )
    parser = extra_args_provider(argparse.ArgumentParser())
    parser.add_argument("--deepspeed-config", dest="deepspeed_config")
    args = parser.parse_args(
        [
            "--deepspeed-config",
            str(path),
            "--shm-data-loader",
            "--hierarchical-zero",
            "--flash-overlap-layers",
            "fc1",
            "fc2",
        ]
    )
    config = plugin_config_from_args(args)
    assert config.shm_data_loader.enabled and config.shm_data_loader.slots == 6
    assert config.hierarchical_zero.enabled
    assert config.flash_overlap.layers == ["fc1", "fc2"] and config.flash_overlap.mode == "ring"
    assert not config.flash_overlap.enabled


def test_flags_do_not_clash_with_megatron_names():
    megatron_flags = [
        "--tensor-model-parallel-size",
        "--sequence-parallel",
        "--num-layers",
        "--hidden-size",
        "--seq-length",
        "--micro-batch-size",
        "--global-batch-size",
        "--data-path",
        "--save",
        "--load",
        "--dataloader-type",
        "--spec",
        "--lr",
        "--train-iters",
        "--deepspeed",
        "--deepspeed_config",
        "--zero-stage",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
    ]
    parser = argparse.ArgumentParser()
    for flag in megatron_flags:
        parser.add_argument(flag)
    extra_args_provider(parser)  # argparse raises on any clash
