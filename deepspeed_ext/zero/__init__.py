"""Hierarchical ZeRO-3 for DeepSpeed 0.19: levels package / node / global cut from the DP group.

The main job calls :func:`initialize` where it would call ``deepspeed.initialize``; with
``hierarchical_zero.enabled`` false it is ``deepspeed.initialize``. See docs/hierarchical_zero.md.
Names are imported on first use, so that the cost model (:mod:`.cost`) and the planner load
without DeepSpeed.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HierarchicalPlan": "api",
    "check_deepspeed_version": "contract",
    "initialize": "api",
    "model_spec": "contract",
    "prepare": "api",
    "validate_deepspeed_config": "contract",
    "Init": "construction",
    "LevelMPU": "inject",
    "ModelSpec": "cost.volume",
    "uninstall_dispatchers": "inject",
    "ZeroLevels": "levels",
    "dp_shape": "levels",
}

_SUBMODULES = (
    "api",
    "contract",
    "cost",
    "hops",
    "inject",
    "levels",
    "planner",
    "plan",
)

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
