"""Hierarchical ZeRO-3 for DeepSpeed 0.19: levels package / node / global cut from the DP group.

The main job calls :func:`initialize` where it would call ``deepspeed.initialize``; with
``hierarchical_zero.enabled`` false it is ``deepspeed.initialize``. See docs/hierarchical_zero.md.
Three floors, each importing only those below it and the section (:mod:`.config`): the cost model
(:mod:`.cost`), the engine that runs inside a step (:mod:`.engine`) and the tools a user runs
beside training (:mod:`.tools`). Names are imported on first use, so that the cost model and the
recommendation CLI load without DeepSpeed.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HierarchicalPlan": "engine.hierarchical_plan",
    "check_deepspeed_version": "engine.contract",
    "initialize": "engine.api",
    "shard_spec": "engine.contract",
    "prepare": "engine.api",
    "validate_deepspeed_config": "engine.contract",
    "Init": "engine.construction",
    "LevelMPU": "engine.inject",
    "ShardSpec": "cost.volume",
    "uninstall_dispatchers": "engine.inject",
    "ZeroLevels": "engine.levels",
    "dp_shape": "cost.shape",
}

_SUBMODULES = ("config", "cost", "engine", "tools")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
