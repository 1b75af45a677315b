"""``--spec megatron_ext.integration.upstream.megatron_lm <block>`` against upstream's own spec builder: every
option Megatron-LM core_v0.16.1's ``gpt_builders.py`` reads is either honoured by the block or
refused at model build with the flag's name, never silently dropped."""

from __future__ import annotations

import argparse
import re
import tarfile

import pytest

from mdsp_base.section import ConfigError
from megatron_ext.integration.upstream.layer_specs import _REFUSED, check_layer_options
from tests.helpers.upstream import TARBALLS, UPSTREAM

# What gpt_builder passes to GPTModel itself, whichever spec is used: --spec changes none of it.
GPT_MODEL_ARGUMENTS = {
    "padded_vocab_size",
    "max_position_embeddings",
    "fp16_lm_cross_entropy",
    "untie_embeddings_and_output_weights",
    "position_embedding_type",
    "rotary_percent",
    "rotary_base",
    "use_rope_scaling",
}
# Read by upstream's builder only on the paths --spec replaces, and only together with a refused option.
WITH_EXPERTS_ONLY = {"moe_grouped_gemm", "moe_use_legacy_grouped_gemm"}
# Checked by check_layer_options itself (value-dependent), or the --spec flag.
CHECKED = {"transformer_impl", "normalization", "spec"}
REFUSED = {name for name, *_ in _REFUSED}


def _upstream_builder_source() -> str:
    path = UPSTREAM / TARBALLS["megatron-lm"]
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    with tarfile.open(path) as tar:
        (member,) = [
            m for m in tar.getmembers() if m.name.endswith("/gpt_builders.py") and m.name.count("/") == 1
        ]
        return tar.extractfile(member).read().decode()


def test_every_option_of_upstreams_spec_builder_is_honoured_or_refused() -> None:
    source = _upstream_builder_source()
    read = set(re.findall(r"\bargs\.([a-z0-9_]+)", source))
    unaccounted = read - GPT_MODEL_ARGUMENTS - WITH_EXPERTS_ONLY - CHECKED - REFUSED
    assert not unaccounted, (
        f"gpt_builders.py reads options the block neither honours nor refuses: {unaccounted}"
    )
    # kitchen layers come in through the config (use_kitchen), set by these two flags
    assert "config.use_kitchen" in source and {"kitchen_config_file", "kitchen_recipe_number"} <= REFUSED


def _args(**fields: object) -> argparse.Namespace:
    defaults = {name: None for name in REFUSED}
    defaults.update(transformer_impl="local", normalization="LayerNorm", num_experts=None)
    return argparse.Namespace(**{**defaults, **fields})


def test_plain_local_layer_options_are_accepted() -> None:
    check_layer_options(_args(), "flash_overlap_layer_spec")
    check_layer_options(_args(normalization="RMSNorm"), "local_layer_spec")


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        *[
            ({name: value}, "--" + name.replace("_", "-"))
            for name, value in [
                ("num_experts", 8),
                ("qk_layernorm", True),
                ("qk_l2_norm", True),
                ("multi_latent_attention", True),
                ("experimental_attention_variant", "gated_delta_net"),
                ("heterogeneous_layers_config_path", "h.json"),
                ("mtp_num_layers", 1),
                ("kitchen_config_file", "k.yaml"),
                ("kitchen_recipe_number", 1),
                ("use_legacy_models", True),
                ("num_layers_per_virtual_pipeline_stage", 2),
                ("num_virtual_stages_per_pipeline_rank", 2),
                ("yaml_cfg", "model.yaml"),
            ]
        ],
        ({"transformer_impl": "transformer_engine"}, "--transformer-impl transformer_engine"),
        ({"normalization": "L2Norm"}, "--normalization"),
        ({"apply_layernorm_1p": True}, "--apply-layernorm-1p"),
    ],
)
def test_options_the_block_cannot_build_are_refused_by_name(fields: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(flag)):
        check_layer_options(_args(**fields), "flash_overlap_layer_spec")
