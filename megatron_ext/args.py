"""Megatron flags of the suite, mapped onto the same fields as the DeepSpeed JSON sections.

Pass :func:`extra_args_provider` to Megatron-LM's or Megatron-DeepSpeed's ``pretrain()`` (or call
it on any argparse parser). Every flag defaults to "not given", so the JSON decides unless a flag
is on the command line: one effective configuration, built by :func:`plugin_config_from_args`.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_ext.layers.config import LAYER_NAMES
from plugin_config import PluginConfig, load_plugin_config

# flag -> (config field, argparse options). Names are prefixed so none clashes with Megatron-LM's.
_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "--shm-data-loader": (
        "shm_data_loader.enabled",
        {
            "action": "store_const",
            "const": True,
            "help": "feed batches through the node's shared-memory ring",
        },
    ),
    "--shm-data-loader-slots": (
        "shm_data_loader.slots",
        {"type": int, "help": "ring slots (prefetch depth)"},
    ),
    "--shm-data-loader-timeout": (
        "shm_data_loader.timeout_s",
        {"type": float, "help": "seconds before a wait fails"},
    ),
    "--shm-data-loader-workers": (
        "shm_data_loader.workers",
        {"type": int, "help": "producer processes that read the node's steps"},
    ),
    "--shm-data-loader-dir": (
        "shm_data_loader.shm_dir",
        {"help": "tmpfs directory of the ring (default /dev/shm)"},
    ),
    "--hierarchical-zero": (
        "hierarchical_zero.enabled",
        {"action": "store_const", "const": True, "help": "ZeRO-3 with package/node/global partitions"},
    ),
    "--hierarchical-zero-secondary-level": (
        "hierarchical_zero.secondary_level",
        {"choices": ["auto", "package", "node"], "help": "level of the secondary 16-bit weight copy"},
    ),
    "--hierarchical-zero-memory-budget-gb": (
        "hierarchical_zero.secondary_memory_budget_gb",
        {"type": float, "help": "extra GB per rank for the secondary copy"},
    ),
    "--hierarchical-zero-grad-reduce": (
        "hierarchical_zero.grad_reduce",
        {"choices": ["hierarchical", "flat"], "help": "gradient reduce-scatter in hops or flat"},
    ),
    "--hierarchical-zero-grad-sync": (
        "hierarchical_zero.grad_sync",
        {"choices": ["every_micro_batch", "accumulation_boundary"], "help": "when gradients cross nodes"},
    ),
    "--hierarchical-zero-quantized-weights": (
        "hierarchical_zero.quantized_weights",
        {"action": "store_const", "const": True, "help": "int8 weight all-gather across nodes"},
    ),
    "--hierarchical-zero-quantized-gradients": (
        "hierarchical_zero.quantized_gradients",
        {"choices": ["none", "int8", "int4"], "help": "gradient reduction across nodes, with error feedback"},
    ),
    "--flash-overlap": (
        "flash_overlap.enabled",
        {"action": "store_const", "const": True, "help": "P2P-overlapped TP/SP linears (Flash-Overlap)"},
    ),
    "--flash-overlap-layers": (
        "flash_overlap.layers",
        {"nargs": "+", "choices": list(LAYER_NAMES), "help": "which linears to replace"},
    ),
    "--flash-overlap-mode": ("flash_overlap.mode", {"choices": ["direct", "ring"], "help": "P2P pattern"}),
    "--flash-overlap-backend": (
        "flash_overlap.backend",
        {
            "choices": ["auto", "p2p", "symm_mem"],
            "help": "our P2P schedule (default), torch's fused symm_mem ops, or auto",
        },
    ),
    "--flash-overlap-timeout": (
        "flash_overlap.timeout_s",
        {"type": float, "help": "seconds a gloo wait for a peer may take (NCCL: the group's own timeout)"},
    ),
    "--ranks-per-node": (
        "topology.ranks_per_node",
        {"type": int, "help": "ranks per node (default: detect)"},
    ),
    "--ranks-per-package": (
        "topology.ranks_per_package",
        {"type": int, "help": "ranks per package, 2 on Frontier (default: detect)"},
    ),
}


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the suite's flags (group "plugins") to ``parser``; returns it, as Megatron expects."""
    group = parser.add_argument_group("plugins", "shared-memory loader, hierarchical ZeRO, Flash-Overlap")
    for flag, (_, options) in _FLAGS.items():
        group.add_argument(flag, dest=_dest(flag), default=None, **options)
    return parser


def flag_of(field: str) -> str | None:
    """The flag that sets ``field`` (a dotted path such as "flash_overlap.backend"), or None."""
    return next((flag for flag, (path, _) in _FLAGS.items() if path == field), None)


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields set on the command line."""
    return {
        field: getattr(args, _dest(flag))
        for flag, (field, _) in _FLAGS.items()
        if getattr(args, _dest(flag), None) is not None
    }


def plugin_config_from_args(args: argparse.Namespace) -> PluginConfig:
    """The effective plugin configuration: the DeepSpeed JSON (``--deepspeed-config``, or
    Megatron-DeepSpeed's ``--deepspeed_config``) with the flags given on the command line on top."""
    path = getattr(args, "deepspeed_config", None)
    return load_plugin_config(path, **flag_overrides(args))
