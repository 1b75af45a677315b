"""The key table of docs/configuration.md is the configuration's documentation: one row per field of every plugin
section, with the field's JSON default, the Megatron flag that sets it, and its docstring."""

from __future__ import annotations

import json
import re
from pathlib import Path

from megatron_ext.integration import args
from megatron_ext.integration.plugin_config import SECTIONS, PluginConfig

KEY_TABLE = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"
HEADER = "| key | default | flag | meaning |"


def flag_of(field: str) -> str | None:
    """The flag that sets ``field`` (a dotted path such as "flash_overlap.backend"), or None."""
    return next((flag for flag, (path, _) in args._FLAGS.items() if path == field), None)


def expected_rows() -> list[str]:
    rows = []
    for section in SECTIONS:
        model = PluginConfig.model_fields[section].annotation
        for name, field in model.model_fields.items():
            key = f"{section}.{name}"
            default = json.dumps(field.get_default(call_default_factory=True))
            flag = flag_of(key)
            meaning = " ".join(field.description.split())
            rows.append(f"| `{key}` | `{default}` | {f'`{flag}`' if flag else ''} | {meaning} |")
    return rows


def documented_rows() -> list[str]:
    lines = KEY_TABLE.read_text().splitlines()
    start = lines.index(HEADER) + 2  # past the header and its |---| line
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return lines[start:end]


def test_every_field_has_a_docstring():
    for section in SECTIONS:
        for name, field in PluginConfig.model_fields[section].annotation.model_fields.items():
            assert field.description, f"{section}.{name} has no docstring"


def test_the_key_table_is_the_fields_defaults_flags_and_docstrings():
    want, have = expected_rows(), documented_rows()
    missing = [row for row in want if row not in have]
    extra = [row for row in have if row not in want]
    assert not missing and not extra, (
        "docs/configuration.md key table out of date; rows to have:\n" + "\n".join(want)
    )
    assert [re.match(r"\| `([^`]*)`", row)[1] for row in have] == [
        re.match(r"\| `([^`]*)`", row)[1] for row in want
    ]
