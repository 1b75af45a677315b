"""What every plugin's section of the DeepSpeed JSON shares: the strict base model, the error it
raises, and the suite's one reader of DeepSpeed JSON.

DeepSpeed forbids unknown keys inside its own sections but keeps unknown top-level sections, so
each plugin owns one top-level section, modelled next to its code; ``plugin_config`` assembles them.
"""

from __future__ import annotations

import json
import os
from typing import Union

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A plugin section of the DeepSpeed config is wrong; the message names key, value and fix."""


class Section(BaseModel):
    """One plugin's top-level section: unknown keys are errors, assignments are validated, and each
    field's docstring is its description (the README's key table is tested against it)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


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
