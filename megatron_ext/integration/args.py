"""Megatron flags of the suite, mapped onto the same fields as the DeepSpeed JSON sections.

Pass :func:`extra_args_provider` to Megatron-LM's or Megatron-DeepSpeed's ``pretrain()`` (or call
it on any argparse parser). Every flag defaults to "not given", so the JSON decides unless a flag
is on the command line: one effective configuration, built by :func:`plugin_config_from_args`.
"""

from __future__ import annotations

import argparse
import enum
import json
import types
import typing
from typing import TypedDict

from pydantic.fields import FieldInfo

from megatron_ext.integration.plugin_config import SECTIONS, PluginConfig, load_plugin_config

# A field's flag is --<section>-<field> (topology's fields without the section); these names
# predate that rule and stay, so that existing job scripts keep working.
_NAMED = {
    "shm_data_loader.enabled": "--shm-data-loader",
    "shm_data_loader.timeout_s": "--shm-data-loader-timeout",
    "shm_data_loader.shm_dir": "--shm-data-loader-dir",
    "hierarchical_zero.enabled": "--hierarchical-zero",
    "hierarchical_zero.secondary_memory_budget_gb": "--hierarchical-zero-memory-budget-gb",
    "flash_overlap.enabled": "--flash-overlap",
    "flash_overlap.timeout_s": "--flash-overlap-timeout",
}
_SCALARS = (bool, int, float, str)
PLUGIN_SWITCHES = ("shm_data_loader.enabled", "hierarchical_zero.enabled", "flash_overlap.enabled")


def _flag_name(section: str, field: str) -> str:
    path = f"{section}.{field}"
    if path in _NAMED:
        return _NAMED[path]
    words = ([] if section == "topology" else [section]) + [field]
    return "--" + "-".join(words).replace("_", "-")


class _FlagOptions(TypedDict, total=False):
    """The keyword arguments of ``add_argument`` a field's flag takes."""

    action: str
    const: bool
    choices: list[str]
    type: type
    nargs: str
    help: str


def _options(field: FieldInfo) -> _FlagOptions | None:
    """argparse options of a field: its type, its choices (an enum's values), its docstring as the
    help; None for a field no single flag can set (a mapping)."""
    kind, nargs = field.annotation, None
    if typing.get_origin(kind) is list:
        (kind,), nargs = typing.get_args(kind), "+"
    optional = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(optional) == 1:
        kind = optional[0]
    default = json.dumps(field.get_default(call_default_factory=True))
    help_text = " ".join((field.description or "").split()).replace("%", "%%")
    help_text += f" (default: the DeepSpeed JSON's, else {default.replace('%', '%%')})"
    if kind is bool:
        return {"action": "store_const", "const": True, "help": help_text}
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        options = _FlagOptions(choices=[member.value for member in kind], help=help_text)
    elif isinstance(kind, type) and kind in _SCALARS:
        options = _FlagOptions(type=kind, help=help_text)
    else:
        return None
    if nargs:
        options["nargs"] = nargs
    return options


def _generated_flags() -> dict[str, tuple[str, _FlagOptions]]:
    flags = {}
    for section in SECTIONS:
        model = PluginConfig.model_fields[section].annotation
        assert model is not None  # each section's field is annotated with its model
        for name, field in model.model_fields.items():
            options = _options(field)
            if options is not None:
                flags[_flag_name(section, name)] = (f"{section}.{name}", options)
    return flags


# flag -> (config field, argparse options), generated from the configuration's fields.
_FLAGS = _generated_flags()


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the suite's flags (group "plugins") to ``parser``; returns it, as Megatron expects. Each
    plugin's switch has a ``--no-`` twin, to turn off a plugin the DeepSpeed JSON turns on."""
    group = parser.add_argument_group("plugins", "shared-memory loader, hierarchical ZeRO, Flash-Overlap")
    for flag, (field, options) in _FLAGS.items():
        group.add_argument(flag, dest=_dest(flag), default=None, **options)
        if field in PLUGIN_SWITCHES:
            off = "--no-" + flag.removeprefix("--")
            group.add_argument(
                off, dest=_dest(flag), action="store_const", const=False, help=f"switch {flag} off"
            )
    return parser


def flag_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The config fields set on the command line."""
    return {
        field: getattr(args, _dest(flag))
        for flag, (field, _) in _FLAGS.items()
        if getattr(args, _dest(flag), None) is not None
    }


def has_plugin_flags(args: argparse.Namespace) -> bool:
    """Whether ``args`` came from a parser that holds the suite's flags (a patched upstream script's:
    an unpatched one never asks for the plugins)."""
    return all(hasattr(args, _dest(flag)) for flag in _FLAGS)


def plugin_config_from_args(args: argparse.Namespace) -> PluginConfig:
    """The effective plugin configuration: the DeepSpeed JSON (``--deepspeed-config``, or
    Megatron-DeepSpeed's ``--deepspeed_config``) with the flags given on the command line on top."""
    path = getattr(args, "deepspeed_config", None)
    return load_plugin_config(path, **flag_overrides(args))
