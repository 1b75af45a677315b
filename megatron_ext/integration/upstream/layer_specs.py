"""The transformer blocks behind Megatron-LM's ``--spec megatron_ext.integration.upstream.megatron_lm <name>``.

Megatron-LM's ``gpt_builder`` reads the named attribute of that module once the flags are parsed
(computed on access, PEP 562) and hands it to ``GPTModel``: ``local_layer_spec``, megatron-core's
local GPT layer with torch norms that work under sequence parallelism (upstream's own refuses
``--sequence-parallel`` without Apex or Transformer Engine), or ``flash_overlap_layer_spec``, the
same with the Flash-Overlap linears. Both are whole-block specs, so the final norm is ours too;
:func:`check_layer_options` refuses each layer option a fixed block would silently ignore."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import torch.distributed as dist

from mdsp_base.section import ConfigError
from mdsp_base.topology import Topology, detect_topology
from megatron_ext.integration.upstream.hooks import SPEC_MODULE, plugin_config
from megatron_ext.layers.config import FlashOverlapConfig

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

# (args attribute, is it set?, why the block cannot honour it, what to do)
_REFUSED = (
    ("num_experts", bool, "mixture-of-experts layers", "drop --num-experts"),
    ("qk_layernorm", bool, "query/key norms", "drop --qk-layernorm"),
    ("qk_l2_norm", bool, "query/key L2 norms", "drop --qk-l2-norm"),
    ("multi_latent_attention", bool, "multi-latent attention", "drop --multi-latent-attention"),
    (
        "experimental_attention_variant",
        lambda v: v is not None,
        "experimental attention variants",
        "drop --experimental-attention-variant",
    ),
    (
        "heterogeneous_layers_config_path",
        lambda v: v is not None,
        "heterogeneous layers",
        "drop --heterogeneous-layers-config-path",
    ),
    ("mtp_num_layers", lambda v: v is not None, "multi-token prediction layers", "drop --mtp-num-layers"),
    ("kitchen_config_file", lambda v: v is not None, "kitchen layers", "drop --kitchen-config-file"),
    ("kitchen_recipe_number", lambda v: v is not None, "kitchen layers", "drop --kitchen-recipe-number"),
    ("use_legacy_models", bool, "legacy models (upstream ignores --spec there)", "drop --use-legacy-models"),
    (
        "yaml_cfg",
        lambda v: v is not None,
        "a model configured from YAML (the block counts layers from the flags)",
        "drop --yaml-cfg",
    ),
    (
        "num_layers_per_virtual_pipeline_stage",
        lambda v: v is not None,
        "virtual pipeline stages",
        "drop --num-layers-per-virtual-pipeline-stage",
    ),
    (
        "num_virtual_stages_per_pipeline_rank",
        lambda v: v is not None,
        "virtual pipeline stages",
        "drop --num-virtual-stages-per-pipeline-rank",
    ),
)


def check_layer_options(args: argparse.Namespace, spec_name: str) -> None:
    """Refuse every layer option of upstream's spec builder that the block would not honour.
    Honoured: ``--normalization`` (LayerNorm, RMSNorm), ``--layernorm-epsilon``, and everything the
    layer reads from the TransformerConfig (hidden sizes, activation, GLU, bias, dropout, ...)."""
    flag = f"--spec {SPEC_MODULE} {spec_name}"
    impl = getattr(args, "transformer_impl", "local")
    if impl != "local":
        raise ConfigError(
            f"{flag} builds megatron-core's local (torch) layer, not --transformer-impl {impl}: "
            "pass --transformer-impl local, or drop --spec to use upstream's own layers"
        )
    for name, is_set, what, fix in _REFUSED:
        if is_set(getattr(args, name, None)):
            raise ConfigError(
                f"{flag} does not build {what} (--{name.replace('_', '-')} is set): {fix}, "
                "or drop --spec to use upstream's own spec builder"
            )
    if getattr(args, "normalization", "LayerNorm") not in ("LayerNorm", "RMSNorm"):
        raise ConfigError(f"{flag} supports --normalization LayerNorm or RMSNorm, not {args.normalization}")
    if getattr(args, "apply_layernorm_1p", False) or getattr(args, "layernorm_zero_centered_gamma", False):
        raise ConfigError(
            f"{flag}: zero-centred gamma (--apply-layernorm-1p) is not supported by the torch norms: drop it"
        )


def flash_overlap_submodules(
    submodules: TransformerLayerSubmodules, overlap: FlashOverlapConfig, topology: Topology | None = None
) -> TransformerLayerSubmodules:
    """A copy of transformer-layer ``submodules`` whose linears named in ``overlap.layers`` are the
    Flash-Overlap ones (``overlap.mode``, ``timeout_s``, ``backend`` and ``topology`` applied)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_ext.layers.spec import get_flash_overlap_layer_spec

    return get_flash_overlap_layer_spec(
        overlap, base=ModuleSpec(module=TransformerLayer, submodules=submodules), topology=topology
    ).submodules


def layer_spec(overlap: FlashOverlapConfig | None = None, topology: Topology | None = None) -> ModuleSpec:
    """The layer ModuleSpec: megatron-core's local GPT layer with sequence-parallel norms, with the
    Flash-Overlap linears of ``overlap`` when given (``topology`` for ``backend`` auto)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_ext.layers.spec import local_layer_spec

    spec = local_layer_spec()
    if overlap is None:
        return spec
    return ModuleSpec(
        module=TransformerLayer, submodules=flash_overlap_submodules(spec.submodules, overlap, topology)
    )


def block_spec(
    args: argparse.Namespace, spec_name: str, overlap: FlashOverlapConfig | None
) -> TransformerBlockSubmodules:
    """The block for this pipeline stage: :func:`layer_spec` repeated as many times as upstream
    builds layers on this rank, then the sequence-parallel final norm. Where the Flash-Overlap
    backend may be torch's symmetric-memory ops, the layers get the job's topology (the node check)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_ext.layers.norm import SequenceParallelNorm

    check_layer_options(args, spec_name)
    topology = None
    if overlap is not None and overlap.backend != "p2p":
        topology = detect_topology(plugin_config(args).topology, world_size=dist.get_world_size())
    layer = layer_spec(overlap, topology)
    count = get_num_layers_to_build(core_transformer_config_from_args(args))
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=SequenceParallelNorm)
