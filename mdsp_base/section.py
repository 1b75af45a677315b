"""What every plugin's section of the DeepSpeed JSON shares: the strict base model, the error it
raises, the suite's one reader of DeepSpeed JSON, and the check of DeepSpeed's own sections.

DeepSpeed forbids unknown keys inside its own sections but keeps unknown top-level sections, so
each plugin owns one top-level section, modelled next to its code; ``plugin_config`` assembles them.
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Any, Self, TypeVar, Union

from pydantic import BaseModel, ConfigDict, ValidationError

ModelT = TypeVar("ModelT", bound=BaseModel)


class ConfigError(ValueError):
    """A plugin section of the DeepSpeed config is wrong; the message names key, value and fix."""


class Section(BaseModel):
    """One plugin's top-level section: unknown keys are errors, assignments are validated, and each
    field's docstring is its description (docs/configuration.md's key table is tested against it).
    A section read from JSON is strict (:func:`validate_json`): ``"8"`` is not a number and
    ``"true"`` not a boolean."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    @classmethod
    def parse(cls, raw: dict | None, name: str) -> Self:
        """The section ``name`` of a DeepSpeed config (None: every default); a bad key or value
        raises ConfigError naming it."""
        if raw is not None and not isinstance(raw, dict):
            raise ConfigError(f'{name}={raw!r}: must be a JSON object like {{"enabled": true}}')
        try:
            return validate_json(cls, raw or {})
        except ValidationError as e:
            raise ConfigError(describe(e, cls, name)) from None


def validate_json(model: type[ModelT], data: dict) -> ModelT:
    """``model`` from JSON-like ``data`` with JSON's types, strictly: a string where a number or a
    boolean belongs is an error, not coerced (a JSON integer still fills a float field, and an enum
    takes its value's string). Objects JSON cannot hold (a ``Path`` handed in from Python) are read
    as their string."""
    return model.model_validate_json(json.dumps(data, default=str), strict=True)


def describe(error: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    """A validation error as one line per problem: the dotted key, the value, what is wrong, and for
    an unknown key the valid keys of the section it sits in."""
    lines = []
    for item in error.errors():
        loc = [str(p) for p in item["loc"]]
        key = ".".join([prefix, *loc] if prefix else loc) or "<root>"
        if item["type"] == "extra_forbidden":
            owner: Any = model
            for part in loc[:-1]:
                owner = owner.model_fields[part].annotation
            lines.append(f"unknown key {key!r}; valid keys here: {', '.join(sorted(owner.model_fields))}")
        elif not loc:
            lines.append(item["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"{key}={item.get('input')!r}: {item['msg']}")
    return "invalid plugin config: " + "; ".join(lines)


def read_ds_config(ds_config: Union[str, os.PathLike, dict, None]) -> dict:
    """The DeepSpeed config as a dict (a dict is returned as is, None gives {}); a missing file or
    invalid JSON raises ConfigError naming the file."""
    if ds_config is None:
        return {}
    if isinstance(ds_config, dict):
        return ds_config
    try:
        with open(ds_config) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"DeepSpeed config {os.fspath(ds_config)!r} does not exist: pass an existing JSON file"
        ) from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"DeepSpeed config {os.fspath(ds_config)!r} is not valid JSON: {e}") from None


def check_deepspeed_sections(config: dict[str, Any], source: str | None) -> None:
    """DeepSpeed's own sections of ``config`` as ``deepspeed.initialize`` would validate them, but
    before the model: an unknown or mistyped key is one :class:`ConfigError` naming it."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    # Only the sections are checked here; the batch keys are the job's (or upstream's) to set.
    config = {k: v for k, v in config.items() if k not in ("train_batch_size", "gradient_accumulation_steps")}
    config.setdefault("train_micro_batch_size_per_gpu", 1)
    where = f"DeepSpeed config {source}" if source else "the DeepSpeed config"
    try:
        DeepSpeedConfig(config)
    except ValidationError as e:
        error = e.errors()[0]
        key = ".".join(str(part) for part in error["loc"])
        known = _fields(DeepSpeedConfigModel).get(e.title, [])
        near = difflib.get_close_matches(str(error["loc"][-1]), known, n=1)
        fix = f"did you mean {near[0]!r}?" if near else "see DeepSpeed's configuration documentation"
        raise ConfigError(f"{where}: {e.title} rejects {key!r} ({error['msg'].lower()}): {fix}") from None
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"{where}: DeepSpeed rejects it: {e}") from None


def _fields(base: type[BaseModel]) -> dict[str, list[str]]:
    """Every DeepSpeed config model's field names (and aliases), by class name."""
    found: dict[str, list[str]] = {}
    for cls in base.__subclasses__():
        found[cls.__name__] = [*cls.model_fields, *(f.alias for f in cls.model_fields.values() if f.alias)]
        found.update(_fields(cls))
    return found
