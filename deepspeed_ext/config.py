"""Typed models of the suite's top-level DeepSpeed JSON sections.

DeepSpeed forbids unknown keys inside its own sections but keeps unknown top-level sections, so
each plugin owns one top-level section. The user passes the same JSON (path or dict) to
``deepspeed.initialize`` and to :func:`load_plugin_config`; Megatron flags (``megatron_ext.args``)
then override fields of the result. :func:`validate_against_world` runs the checks that need the
world size, once, before any collective.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

logger = logging.getLogger(__name__)

SECTIONS = ("topology", "hierarchical_zero", "shm_data_loader", "flash_overlap")
LAYER_NAMES = ("qkv", "proj", "fc1", "fc2")


class ConfigError(ValueError):
    """A plugin section of the DeepSpeed config is wrong; the message names key, value and fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class TopologyConfig(_Section):
    ranks_per_node: int | None = Field(default=None, ge=1)
    """Ranks (GPUs/GCDs) per node; null detects it from Slurm or torchrun variables."""
    ranks_per_package: int | None = Field(default=None, ge=1)
    """Ranks sharing one package (2 GCDs of an MI250X on Frontier, 1 elsewhere); null detects it."""


class HierarchicalZeroConfig(_Section):
    enabled: bool = False
    """Use the hierarchical ZeRO-3 variant (needs zero_optimization.stage 3)."""
    secondary_level: Literal["auto", "package", "node"] = "auto"
    """Level of the secondary 16-bit weight partition; auto picks the fastest one that fits the budget."""
    secondary_memory_budget_gb: float = Field(default=8.0, gt=0)
    """Extra memory per rank (GB) that the secondary weight copy may take when secondary_level is auto."""
    grad_reduce: Literal["hierarchical", "flat"] = "hierarchical"
    """Gradient reduce-scatter in hops package -> node -> global, or one flat reduce-scatter."""
    link_bandwidth_gbps: dict[Literal["package", "node", "inter_node"], float] | None = None
    """GB/s per link class for the cost model; null uses Frontier's 200 / 50 / 25."""


class ShmDataLoaderConfig(_Section):
    enabled: bool = False
    """Feed batches through one producer per node and a ring in shared memory."""
    slots: int = Field(default=4, ge=1, le=1024)
    """Ring slots, each holding one step's micro-batches for the node: the prefetch depth."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Seconds a rank waits for its next batch before raising; the producer waits for live ranks
    as long as they live and raises as soon as one dies."""
    shm_dir: str = "/dev/shm"
    """Directory of the shared-memory segments (a tmpfs)."""


class FlashOverlapConfig(_Section):
    enabled: bool = False
    """Replace megatron-core's TP linears by the P2P-overlapped ones."""
    layers: list[Literal["qkv", "proj", "fc1", "fc2"]] = Field(default_factory=lambda: list(LAYER_NAMES))
    """Which linears of each transformer layer are replaced."""
    mode: Literal["direct", "ring"] = "direct"
    """P2P pattern: direct (each step a different peer) or ring (neighbours only)."""
    backend: Literal["auto", "p2p", "symm_mem"] = "auto"
    """auto: torch's symmetric-memory fused ops where they run (NCCL on CUDA, ROCm gfx942/950), else p2p."""
    timeout_s: float = Field(default=300.0, gt=0)
    """Seconds to wait for a peer's transfer before raising."""


class PluginConfig(_Section):
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
        if self.hierarchical_zero.enabled and self.zero_stage != 3:
            raise ValueError(
                f"hierarchical_zero.enabled=true needs zero_optimization.stage 3, got stage {self.zero_stage}: "
                'set "zero_optimization": {"stage": 3} or disable hierarchical_zero'
            )
        return self


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"]) or "<root>"
        if item["type"] == "extra_forbidden":
            section = item["loc"][0] if item["loc"] else ""
            model = PluginConfig.model_fields.get(section)
            valid = sorted(model.annotation.model_fields) if model is not None and len(item["loc"]) > 1 else SECTIONS
            lines.append(f"unknown key {key!r}; valid keys here: {', '.join(valid)}")
        elif not item["loc"]:
            lines.append(item["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"{key}={item.get('input')!r}: {item['msg']}")
    return "invalid plugin config: " + "; ".join(lines)


def read_ds_config(ds_config: Union[str, os.PathLike, dict, None]) -> dict:
    """The DeepSpeed config as a dict (a dict is returned as is, None gives {}); a missing file or
    invalid JSON raises ConfigError naming the file. The suite's one reader of DeepSpeed JSON."""
    if ds_config is None:
        return {}
    if isinstance(ds_config, dict):
        return ds_config
    try:
        with open(ds_config) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"DeepSpeed config {os.fspath(ds_config)!r} does not exist: pass an existing JSON file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"DeepSpeed config {os.fspath(ds_config)!r} is not valid JSON: {e}") from None


def load_plugin_config(ds_config: Union[str, os.PathLike, dict, None], **overrides: Any) -> PluginConfig:
    """Parse our sections from the DeepSpeed config (path or dict); ``overrides`` are dotted
    field paths such as ``{"shm_data_loader.enabled": True}`` (what Megatron flags set)."""
    raw = read_ds_config(ds_config)
    for key in raw:
        near = difflib.get_close_matches(key, SECTIONS, n=1, cutoff=0.8)
        if near and key not in SECTIONS:
            raise ConfigError(f"unknown top-level section {key!r}: did you mean {near[0]!r}?")
    for name in SECTIONS:
        if name in raw and not isinstance(raw[name], dict):
            raise ConfigError(f"{name}={raw[name]!r}: must be a JSON object like {{\"enabled\": true}}")
    sections: dict[str, Any] = {name: dict(raw.get(name) or {}) for name in SECTIONS}
    for path, value in overrides.items():
        section, _, field = path.partition(".")
        if section not in sections or not field:
            raise ConfigError(f"override {path!r}: expected '<section>.<field>' with section in {SECTIONS}")
        sections[section][field] = value
    stage = (raw.get("zero_optimization") or {}).get("stage", 0)
    try:
        return PluginConfig(**sections, zero_stage=stage)
    except ValidationError as e:
        raise ConfigError(_describe(e)) from None


def validate_against_world(config: PluginConfig, world_size: int, data_parallel_size: int) -> None:
    """Checks that need the job's size; run once at start-up, before any collective."""
    topo = config.topology
    if topo.ranks_per_node and topo.ranks_per_package and topo.ranks_per_node % topo.ranks_per_package:
        raise ConfigError(
            f"topology.ranks_per_node({topo.ranks_per_node}) is not a multiple of "
            f"topology.ranks_per_package({topo.ranks_per_package})"
        )
    if topo.ranks_per_node and world_size % topo.ranks_per_node and world_size > topo.ranks_per_node:
        raise ConfigError(
            f"world({world_size}) is not a whole number of nodes of topology.ranks_per_node({topo.ranks_per_node})"
        )
    if data_parallel_size < 1 or world_size % data_parallel_size:
        raise ConfigError(f"data-parallel size {data_parallel_size} does not divide world({world_size})")


def log_effective_config(config: PluginConfig, rank: int) -> None:
    """Log the effective configuration once per job (on global rank 0)."""
    if rank == 0:
        logger.info("plugin config: %s", config.model_dump_json())
