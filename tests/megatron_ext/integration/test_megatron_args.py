"""The suite's flags inside upstream parsers: no clash with Megatron-LM core_v0.16.1 or
Megatron-DeepSpeed, the Slurm presets parse there, and every flag sets the same field as the JSON."""

import argparse
import glob
import json
import os
import re
from pathlib import Path

import pytest

from mdsp_base.section import ConfigError
from megatron_ext.integration.args import extra_args_provider, plugin_config_from_args
from megatron_ext.integration.plugin_config import load_plugin_config
from megatron_ext.integration.upstream import hooks

DATA = str(Path(__file__).resolve().parents[2] / "data")
PRESETS = os.path.join(str(Path(__file__).resolve().parents[3]), "scripts", "presets")
# What scripts/slurm/common.sh appends to a preset's flags.
SLURM_FLAGS = ["--deepspeed-config", "cfg.json", "--data-path", "corpus", "--save", "ckpt", "--load", "ckpt"]


def _flags(name):
    with open(os.path.join(DATA, name)) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def _upstream_parser(name):
    """A parser holding every flag of the upstream list (any arity), as the upstream parser would."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    for flag in _flags(name):
        parser.add_argument(flag, nargs="*")
    return parser


def _our_flags():
    """The option strings extra_args_provider adds, read from the help text (public API only)."""
    base = set(re.findall(r"--[a-z][a-z0-9-]*", argparse.ArgumentParser().format_help()))
    ours = set(re.findall(r"--[a-z][a-z0-9-]*", extra_args_provider(argparse.ArgumentParser()).format_help()))
    return ours - base


@pytest.mark.parametrize("name", ["megatron_lm_flags.txt", "megatron_deepspeed_flags.txt"])
def test_no_clash_with_upstream_flags(name):
    upstream = set(_flags(name))
    assert len(upstream) > 300, f"{name} looks truncated"
    clash = (_our_flags() | {"--deepspeed-config"}) & upstream
    if name == "megatron_lm_flags.txt":
        assert not clash, f"the suite's flags clash with Megatron-LM's: {sorted(clash)}"
    else:
        assert not clash, f"the suite's flags clash with Megatron-DeepSpeed's: {sorted(clash)}"
    hooks.with_plugin_args()(_upstream_parser(name))  # argparse raises on any clash


def test_megatron_deepspeed_order_and_both_json_flags():
    import deepspeed

    # Megatron-DeepSpeed calls the provider, then adds DeepSpeed's flags.
    parser = deepspeed.add_config_arguments(
        hooks.with_plugin_args()(_upstream_parser("megatron_deepspeed_flags.txt"))
    )
    assert parser.parse_args(["--deepspeed_config", "a.json"]).deepspeed_config == "a.json"
    assert parser.parse_args(["--deepspeed-config", "b.json"]).deepspeed_config == "b.json"


def test_base_provider_runs_first():
    calls = []

    def base(parser):
        calls.append("base")
        parser.add_argument("--modelopt-flag")
        return parser

    args = hooks.with_plugin_args(base)(argparse.ArgumentParser()).parse_args(
        ["--modelopt-flag", "1", "--flash-overlap"]
    )
    assert calls == ["base"] and args.modelopt_flag == "1" and args.flash_overlap is True


def _preset_tokens(path):
    with open(path) as f:
        return [tok for line in f for tok in line.split("#", 1)[0].split()]


@pytest.mark.parametrize("name", ["megatron_lm_flags.txt", "megatron_deepspeed_flags.txt"])
@pytest.mark.parametrize("preset", sorted(glob.glob(os.path.join(PRESETS, "*.args"))), ids=os.path.basename)
def test_slurm_presets_parse_upstream(name, preset):
    parser = hooks.with_plugin_args()(_upstream_parser(name))
    tokens = _preset_tokens(preset) + SLURM_FLAGS
    args, unknown = parser.parse_known_args(tokens)
    assert unknown == [], f"{os.path.basename(preset)} has flags {name[:-10]} does not know: {unknown}"
    assert args.deepspeed_config == "cfg.json"


@pytest.mark.parametrize(
    ("name", "preset"),
    [
        ("megatron_lm_flags.txt", "megatron-lm-local.args"),
        ("megatron_deepspeed_flags.txt", "megatron-deepspeed-local.args"),
    ],
)
def test_upstream_slurm_presets_parse_upstream(name, preset):
    import deepspeed

    parser = hooks.with_plugin_args()(_upstream_parser(name))
    if name.startswith("megatron_deepspeed"):
        parser = deepspeed.add_config_arguments(
            parser
        )  # Megatron-DeepSpeed adds DeepSpeed's flags (--deepspeed)
    args, unknown = parser.parse_known_args(_preset_tokens(os.path.join(PRESETS, "upstream", preset)))
    assert unknown == [], f"{preset} has flags {name[:-10]} does not know: {unknown}"


BASE = {"zero_optimization": {"stage": 3}}
# flag argv -> the JSON section that must give the same configuration
CASES = [
    (["--shm-data-loader"], {"shm_data_loader": {"enabled": True}}),
    (["--shm-data-loader-slots", "8"], {"shm_data_loader": {"slots": 8}}),
    (["--shm-data-loader-timeout", "30"], {"shm_data_loader": {"timeout_s": 30.0}}),
    (["--shm-data-loader-workers", "3"], {"shm_data_loader": {"workers": 3}}),
    (["--shm-data-loader-dir", "/tmp"], {"shm_data_loader": {"shm_dir": "/tmp"}}),
    (["--shm-data-loader-pinned-ring"], {"shm_data_loader": {"pinned_ring": True}}),
    (["--hierarchical-zero"], {"hierarchical_zero": {"enabled": True}}),
    (["--hierarchical-zero-secondary-level", "node"], {"hierarchical_zero": {"secondary_level": "node"}}),
    (
        ["--hierarchical-zero-memory-budget-gb", "4"],
        {"hierarchical_zero": {"secondary_memory_budget_gb": 4.0}},
    ),
    (["--hierarchical-zero-grad-reduce", "flat"], {"hierarchical_zero": {"grad_reduce": "flat"}}),
    (
        ["--hierarchical-zero-grad-sync", "accumulation_boundary"],
        {"hierarchical_zero": {"grad_sync": "accumulation_boundary"}},
    ),
    (["--hierarchical-zero-quantized-weights"], {"hierarchical_zero": {"quantized_weights": True}}),
    (
        ["--hierarchical-zero-quantized-gradients", "int4"],
        {"hierarchical_zero": {"quantized_gradients": "int4"}},
    ),
    (["--hierarchical-zero-quantization-block", "128"], {"hierarchical_zero": {"quantization_block": 128}}),
    (
        ["--hierarchical-zero-inter-node-algorithm", "recursive"],
        {"hierarchical_zero": {"inter_node_algorithm": "recursive"}},
    ),
    (["--hierarchical-zero-pipeline-chunks", "4"], {"hierarchical_zero": {"pipeline_chunks": 4}}),
    (
        ["--hierarchical-zero-sequence-parallel-gradients", "mean"],
        {"hierarchical_zero": {"sequence_parallel_gradients": "mean"}},
    ),
    (["--hierarchical-zero-profile", "profile.json"], {"hierarchical_zero": {"profile": "profile.json"}}),
    (["--flash-overlap"], {"flash_overlap": {"enabled": True}}),
    (["--flash-overlap-layers", "qkv", "fc2"], {"flash_overlap": {"layers": ["qkv", "fc2"]}}),
    (["--flash-overlap-mode", "ring"], {"flash_overlap": {"mode": "ring"}}),
    (["--flash-overlap-backend", "symm_mem"], {"flash_overlap": {"backend": "symm_mem"}}),
    (["--flash-overlap-timeout", "12"], {"flash_overlap": {"timeout_s": 12.0}}),
    (["--flash-overlap-compute-slices", "2"], {"flash_overlap": {"compute_slices": 2}}),
    (["--ranks-per-node", "8"], {"topology": {"ranks_per_node": 8}}),
    (["--ranks-per-package", "2"], {"topology": {"ranks_per_package": 2}}),
]


def test_cases_cover_every_flag():
    switches_off = {flag for flag in _our_flags() if flag.startswith("--no-")}
    assert {argv[0] for argv, _ in CASES} == _our_flags() - switches_off
    assert switches_off == {"--no-shm-data-loader", "--no-hierarchical-zero", "--no-flash-overlap"}


@pytest.mark.parametrize("section", ["shm_data_loader", "hierarchical_zero", "flash_overlap"])
def test_a_no_flag_switches_off_a_plugin_the_json_switches_on(tmp_path, section):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, section: {"enabled": True}}))
    parser = hooks.with_plugin_args()(_upstream_parser("megatron_lm_flags.txt"))
    flag = "--no-" + section.replace("_", "-")
    config = plugin_config_from_args(parser.parse_args([flag, "--deepspeed-config", str(path)]))
    assert getattr(config, section).enabled is False


@pytest.mark.parametrize(("argv", "section"), CASES, ids=[argv[0] for argv, _ in CASES])
def test_flag_sets_the_json_field(tmp_path, argv, section):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(BASE))
    parser = hooks.with_plugin_args()(_upstream_parser("megatron_lm_flags.txt"))
    from_flags = plugin_config_from_args(parser.parse_args([*argv, "--deepspeed-config", str(path)]))
    assert from_flags == load_plugin_config({**BASE, **section})
    assert from_flags != load_plugin_config(BASE), f"{argv[0]} changed nothing"


def test_flag_wins_over_json(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"shm_data_loader": {"enabled": True, "slots": 2}}))
    parser = hooks.with_plugin_args()(argparse.ArgumentParser())
    config = plugin_config_from_args(
        parser.parse_args(["--deepspeed-config", str(path), "--shm-data-loader-slots", "6"])
    )
    assert (config.shm_data_loader.enabled, config.shm_data_loader.slots) == (True, 6)


# -- the checks of hooks.plugin_config, on the fields Megatron's validate_args sets ----------


def _megatron_lm_args(argv, **fields):
    args = hooks.with_plugin_args()(argparse.ArgumentParser()).parse_args(argv)
    defaults = dict(
        world_size=4,
        data_parallel_size=2,
        pipeline_model_parallel_size=1,
        dataloader_type="single",
        spec=None,
        full_validation=False,
        sft=False,
        hybrid_context_parallel=False,
    )
    for key, value in {**defaults, **fields}.items():
        setattr(args, key, value)
    return args


def _megatron_deepspeed_args(argv, ds, **fields):
    args = _megatron_lm_args(argv, **fields)
    del args.spec, args.full_validation, args.sft, args.hybrid_context_parallel
    # DeepSpeed's --deepspeed flag; Megatron-DeepSpeed moves the JSON into deepspeed_config_dict.
    args.deepspeed, args.deepspeed_config, args.deepspeed_config_dict = True, None, ds
    args.no_pipeline_parallel = fields.get("no_pipeline_parallel", True)
    return args


def test_megatron_lm_spec_and_loader_accepted_with_pipeline_parallelism():
    args = _megatron_lm_args(
        ["--flash-overlap", "--shm-data-loader"],
        spec=list(hooks.SPEC_FLAG),
        dataloader_type="cyclic",
        world_size=8,
        pipeline_model_parallel_size=2,
    )
    config = hooks.plugin_config(args)
    assert config.flash_overlap.enabled and config.shm_data_loader.enabled
    assert hooks.plugin_config(args) is config  # checked and logged once


@pytest.mark.parametrize(
    ("argv", "fields", "needle"),
    [
        (
            ["--flash-overlap"],
            {},
            "--spec megatron_ext.integration.upstream.megatron_lm flash_overlap_layer_spec",
        ),
        (
            ["--flash-overlap"],
            {"spec": list(hooks.SPEC_FLAG), "tensor_model_parallel_size": 2},
            "--sequence-parallel",
        ),
        (
            ["--shm-data-loader"],
            {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
            "--num-layers-per-virtual-pipeline-stage",
        ),
        (["--shm-data-loader"], {"pipeline_model_parallel_size": 2, "mtp_num_layers": 1}, "--mtp-num-layers"),
        (["--shm-data-loader"], {"dataloader_type": "external"}, "single or cyclic"),
        (["--shm-data-loader"], {"full_validation": True}, "--full-validation"),
        (["--hierarchical-zero", "--deepspeed-config", "{stage3}"], {}, "--deepspeed"),
        (["--ranks-per-node", "3"], {}, "ranks_per_node"),
    ],
)
def test_megatron_lm_unsupported_settings_fail(tmp_path, argv, fields, needle):
    stage3 = tmp_path / "ds.json"
    stage3.write_text(json.dumps(BASE))
    argv = [a.replace("{stage3}", str(stage3)) for a in argv]
    with pytest.raises(ConfigError, match=re.escape(needle)):
        hooks.plugin_config(_megatron_lm_args(argv, **fields))


def test_megatron_deepspeed_reads_the_moved_json():
    ds = {
        "zero_optimization": {"stage": 3},
        "hierarchical_zero": {"enabled": True},
        "shm_data_loader": {"slots": 3},
    }
    config = hooks.plugin_config(_megatron_deepspeed_args(["--shm-data-loader"], ds))
    assert config.hierarchical_zero.enabled and config.zero_stage == 3
    assert (config.shm_data_loader.enabled, config.shm_data_loader.slots) == (True, 3)


def test_megatron_deepspeed_takes_flash_overlap_for_its_ulysses_attention():
    args = _megatron_deepspeed_args(["--flash-overlap"], {}, ds_sequence_parallel_size=2)
    assert hooks.plugin_config(args).flash_overlap.enabled


def test_megatron_deepspeed_takes_flash_overlap_for_its_tp_linears_with_sequence_parallelism():
    args = _megatron_deepspeed_args(
        ["--flash-overlap"], {}, tensor_model_parallel_size=2, sequence_parallel=True
    )
    assert hooks.plugin_config(args).flash_overlap.enabled


TP2_SP = {"tensor_model_parallel_size": 2, "sequence_parallel": True}


@pytest.mark.parametrize(
    ("argv", "ds", "fields", "needle"),
    [
        (["--flash-overlap"], {}, {}, "--ds-sequence-parallel-size > 1"),
        (["--flash-overlap"], {}, {}, "--tensor-model-parallel-size > 1 with --sequence-parallel"),
        (
            ["--flash-overlap"],
            {},
            {"ds_sequence_parallel_size": 2, "tensor_model_parallel_size": 2},
            "use --tensor-model-parallel-size 1",
        ),
        (["--flash-overlap"], {}, {"tensor_model_parallel_size": 2}, "pass --sequence-parallel (TP=2)"),
        (["--flash-overlap"], {}, {**TP2_SP, "enable_zbh1_pipeline": True}, "drop --enable-zbh1-pipeline"),
        (["--flash-overlap"], {}, {**TP2_SP, "fp8_hybrid": True}, "drop --fp8-e4m3/--fp8-hybrid"),
        (
            ["--flash-overlap"],
            {"flash_overlap": {"backend": "symm_mem"}},
            TP2_SP,
            'backend "symm_mem" runs in megatron-core\'s linears only',
        ),
        (["--shm-data-loader"], {}, {"no_pipeline_parallel": False}, "--no-pipeline-parallel"),
        (["--shm-data-loader"], {}, {"pipeline_model_parallel_size": 2}, "--pipeline-model-parallel-size 1"),
    ],
)
def test_megatron_deepspeed_unsupported_settings_fail(argv, ds, fields, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        hooks.plugin_config(_megatron_deepspeed_args(argv, ds, **fields))


def test_ulysses_with_clipping_under_zero3_is_told_how_sp_scales_its_gradients():
    from megatron_ext.integration.upstream.ds_parallelism import ulysses_clipping_notice

    notice = ulysses_clipping_notice(sp=2, clipping=1.0, zero_stage=3)
    assert notice is not None and "1/2 of the gradient" in notice and "SP=1 would clip at 2" in notice
    assert "gradient_clipping to clipping/SP" in notice
    for quiet in ((1, 1.0, 3), (2, 0.0, 3), (2, 1.0, 1)):  # no Ulysses, no clipping, not ZeRO-3
        assert ulysses_clipping_notice(*quiet) is None
