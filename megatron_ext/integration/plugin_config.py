"""The effective configuration of the suite: each plugin's section of the DeepSpeed JSON (modelled
next to the plugin) assembled into one object, validated once.

The user passes the same JSON (path or dict) to ``deepspeed.initialize`` and to
:func:`load_plugin_config`; Megatron flags (``megatron_ext.integration.args``) then override fields of the
result. :func:`validate_against_world` runs the checks that need the world size, once, before any
collective. Sections: ``topology`` (``mdsp_base/topology.py``), ``hierarchical_zero``
(``deepspeed_ext/zero/config.py``), ``shm_data_loader`` (``megatron_ext/data/config.py``),
``flash_overlap`` (``megatron_ext/layers/config.py``).
"""

from __future__ import annotations

import difflib
import logging
import os
from typing import Union

from pydantic import Field, ValidationError, model_validator

from deepspeed_ext.zero.config import HierarchicalZeroConfig, check_zero_stage
from mdsp_base.section import ConfigError, Section, describe, read_ds_config, validate_json
from mdsp_base.topology import TopologyConfig, check_data_parallel, check_layout
from megatron_ext.data.config import ShmDataLoaderConfig, check_shm_dir_at_start
from megatron_ext.layers.config import FlashOverlapConfig

logger = logging.getLogger(__name__)

SECTIONS = ("topology", "hierarchical_zero", "shm_data_loader", "flash_overlap")


class PluginConfig(Section):
    """The effective configuration of all plugins."""

    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    """Rank placement on nodes and packages."""
    hierarchical_zero: HierarchicalZeroConfig = Field(default_factory=HierarchicalZeroConfig)
    """The hierarchical ZeRO-3 variant."""
    shm_data_loader: ShmDataLoaderConfig = Field(default_factory=ShmDataLoaderConfig)
    """The shared-memory node data loader."""
    flash_overlap: FlashOverlapConfig = Field(default_factory=FlashOverlapConfig)
    """The Flash-Overlap tensor-parallel linears."""
    zero_stage: int = 0
    """zero_optimization.stage of the DeepSpeed config (read, not set, here)."""

    @model_validator(mode="after")
    def _zero_stage_fits(self) -> PluginConfig:
        if self.hierarchical_zero.enabled:
            check_zero_stage(self.zero_stage)
        return self


def load_plugin_config(ds_config: Union[str, os.PathLike, dict, None], **overrides: object) -> PluginConfig:
    """Parse our sections from the DeepSpeed config (path or dict); ``overrides`` are dotted
    field paths such as ``{"shm_data_loader.enabled": True}`` (what Megatron flags set)."""
    raw = read_ds_config(ds_config)
    for key in raw:
        near = difflib.get_close_matches(key, SECTIONS, n=1, cutoff=0.8)
        if near and key not in SECTIONS:
            raise ConfigError(f"unknown top-level section {key!r}: did you mean {near[0]!r}?")
    for name in SECTIONS:
        if name in raw and not isinstance(raw[name], dict):
            raise ConfigError(f'{name}={raw[name]!r}: must be a JSON object like {{"enabled": true}}')
    sections: dict[str, dict[str, object]] = {name: dict(raw.get(name) or {}) for name in SECTIONS}
    for path, value in overrides.items():
        section, _, field = path.partition(".")
        if section not in sections or not field:
            raise ConfigError(f"override {path!r}: expected '<section>.<field>' with section in {SECTIONS}")
        sections[section][field] = value
    stage = (raw.get("zero_optimization") or {}).get("stage", 0)
    try:
        return validate_json(PluginConfig, {**sections, "zero_stage": stage})
    except ValidationError as e:
        raise ConfigError(describe(e, PluginConfig)) from None


def validate_against_world(config: PluginConfig, world_size: int, data_parallel_size: int) -> None:
    """Checks that need the job's size or this machine (the loader's directory); run once at
    start-up, before any model or collective. Warnings are logged."""
    check_layout(world_size, config.topology.ranks_per_node, config.topology.ranks_per_package)
    check_data_parallel(world_size, data_parallel_size)
    for warning in check_shm_dir_at_start(config.shm_data_loader):
        logger.warning(warning)


def log_effective_config(config: PluginConfig, rank: int) -> None:
    """Log the effective configuration once per job (on global rank 0)."""
    if rank == 0:
        logger.info("plugin config: %s", config.model_dump_json())
