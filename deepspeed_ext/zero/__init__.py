"""Hierarchical ZeRO-3 for DeepSpeed 0.19: levels package / node / global cut from the DP group.

The main job calls :func:`initialize` where it would call ``deepspeed.initialize``; with
``hierarchical_zero.enabled`` false it is ``deepspeed.initialize``. See docs/hierarchical_zero.md.
"""

from deepspeed_ext.zero.api import (
    HierarchicalPlan,
    check_deepspeed_version,
    initialize,
    model_spec,
    prepare,
    validate_deepspeed_config,
)
from deepspeed_ext.zero.inject import Init, LevelMPU, uninstall_dispatchers
from deepspeed_ext.zero.levels import ZeroLevels, dp_shape

__all__ = [
    "HierarchicalPlan",
    "Init",
    "LevelMPU",
    "ZeroLevels",
    "check_deepspeed_version",
    "dp_shape",
    "initialize",
    "model_spec",
    "prepare",
    "uninstall_dispatchers",
    "validate_deepspeed_config",
]
